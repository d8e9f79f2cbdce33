package gvisor_test

import (
	"net/netip"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/gvisor"
)

// TestShapeKey: a prepared container fits every restore whose OCI spec differs
// only in what the instance id names (and in egress, applied at the restore),
// and no other.
func TestShapeKey(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip(err)
	}
	e, err := gvisor.New(gvisor.Config{Runsc: sh, StateDir: filepath.Join(t.TempDir(), "gvisor")})
	if err != nil {
		t.Fatal(err)
	}
	base := engine.Spec{ID: "sbx-a-00000001", RootFS: "/run/torpor/rootfs/sha256/x.erofs", GuestDir: "/g/1",
		MemoryMiB: 512, CPUs: 1, PidsLimit: 1024, WritableMiB: 256, TmpMiB: 128, Env: map[string]string{"A": "1"}}
	key := gvisor.ShapeKey(e, base)
	same := []func(s *engine.Spec){
		func(s *engine.Spec) { s.ID = "sbx-b-00000007" },
		func(s *engine.Spec) { s.CPUs = 2 }, // applied after the restore (applyCPU)
		func(s *engine.Spec) {
			s.Egress = &engine.Egress{InternetAccess: true, AllowOut: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
		},
	}
	for i, f := range same {
		s := base
		f(&s)
		if got := gvisor.ShapeKey(e, s); got != key {
			t.Errorf("same shape %d: key %s, want %s", i, got, key)
		}
	}
	other := map[string]func(s *engine.Spec){
		"image":    func(s *engine.Spec) { s.RootFS = "/run/torpor/rootfs/sha256/y.erofs" },
		"agent":    func(s *engine.Spec) { s.GuestDir = "/g/2" },
		"memory":   func(s *engine.Spec) { s.MemoryMiB = 1024 },
		"pids":     func(s *engine.Spec) { s.PidsLimit = 0 },
		"writable": func(s *engine.Spec) { s.WritableMiB = 64 },
		"tmp":      func(s *engine.Spec) { s.TmpMiB = 0 },
		"env":      func(s *engine.Spec) { s.Env = map[string]string{"A": "2"} },
		"volume":   func(s *engine.Spec) { s.Mounts = []engine.Mount{{Source: "/v", Destination: "/data"}} },
	}
	for name, f := range other {
		s := base
		f(&s)
		if got := gvisor.ShapeKey(e, s); got == key {
			t.Errorf("a different %s has the same shape key %s", name, key)
		}
	}
}
