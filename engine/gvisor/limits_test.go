package gvisor

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/sandboxnet"
)

// TestLimitsInSpec: a spec's pids, writable-layer and /tmp limits become
// RLIMIT_NPROC, the cgroup's pids.max backstop, the root overlay's size and
// a sized /tmp; a spec without them has none of these (the spec sandboxes
// had before limits, which their checkpoints need at restore).
func TestLimitsInSpec(t *testing.T) {
	e := &Engine{scope: "tptest"}
	base := engine.Spec{ID: "sbx-x-00000001", RootFS: "/img.erofs", GuestDir: "/guest", MemoryMiB: 256}
	p := sandboxnet.For("tptest", base.ID)

	with := base
	with.PidsLimit, with.WritableMiB, with.TmpMiB, with.ShmMiB, with.AgentPidsExempt = 100, 192, 96, 32, true
	s := e.ociSpec(with, p)
	for _, set := range []string{"bounding", "effective", "permitted"} {
		if !slices.Contains(s.Process.Capabilities[set], "CAP_SYS_RESOURCE") {
			t.Errorf("%s capabilities %v: want CAP_SYS_RESOURCE for the agent (it drops it from its bounding set)", set, s.Process.Capabilities[set])
		}
	}
	if len(s.Process.Capabilities["inheritable"]) != 0 || len(s.Process.Capabilities["ambient"]) != 0 {
		t.Errorf("capabilities %v: want no inheritable or ambient ones (a command would keep them)", s.Process.Capabilities)
	}
	j := slices.IndexFunc(s.Mounts, func(m ociMount) bool { return m.Destination == "/dev/shm" })
	if j < 0 || s.Mounts[j].Type != "tmpfs" || !slices.Contains(s.Mounts[j].Options, "size=32m") || !slices.Contains(s.Mounts[j].Options, "mode=1777") ||
		j < slices.IndexFunc(s.Mounts, func(m ociMount) bool { return m.Destination == "/dev" }) {
		t.Errorf("mounts %+v: want a tmpfs /dev/shm of size=32m, mode=1777, after /dev", s.Mounts)
	}
	if !slices.Contains(s.Process.Rlimits, ociRlimit{Type: "RLIMIT_NPROC", Hard: 100, Soft: 100}) {
		t.Errorf("rlimits %+v: want RLIMIT_NPROC 100", s.Process.Rlimits)
	}
	if s.Linux.Resources.Pids == nil || s.Linux.Resources.Pids.Limit != hostPidsLimit(100) {
		t.Errorf("resources.pids %+v: want %d", s.Linux.Resources.Pids, hostPidsLimit(100))
	}
	if got := s.Annotations["dev.gvisor.spec.rootfs.options"]; got != "size=192m" {
		t.Errorf("rootfs options %q: want size=192m", got)
	}
	i := slices.IndexFunc(s.Mounts, func(m ociMount) bool { return m.Destination == "/tmp" })
	if i < 0 || s.Mounts[i].Type != "tmpfs" || !slices.Contains(s.Mounts[i].Options, "size=96m") {
		t.Errorf("mounts %+v: want a tmpfs /tmp of size=96m", s.Mounts)
	}

	s = e.ociSpec(base, p)
	if len(s.Process.Rlimits) != 1 || s.Linux.Resources.Pids != nil || s.Annotations["dev.gvisor.spec.rootfs.options"] != "" ||
		slices.ContainsFunc(s.Mounts, func(m ociMount) bool { return m.Destination == "/tmp" || m.Destination == "/dev/shm" }) ||
		slices.Contains(s.Process.Capabilities["effective"], "CAP_SYS_RESOURCE") {
		t.Errorf("spec without limits: rlimits %+v pids %+v annotations %v mounts %+v", s.Process.Rlimits, s.Linux.Resources.Pids, s.Annotations, s.Mounts)
	}
}

// TestRestoredLimits: a restore takes the limits its checkpoint recorded,
// whatever the spec asks, and none from a checkpoint without a record.
func TestRestoredLimits(t *testing.T) {
	e := &Engine{cfg: Config{StateDir: t.TempDir()}}
	const id = "sbx-y-00000001"
	if err := os.MkdirAll(e.bundle(id), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeLimits(e.bundle(id), engine.Spec{PidsLimit: 64, AgentPidsExempt: true, WritableMiB: 96, TmpMiB: 48, ShmMiB: 24}); err != nil {
		t.Fatal(err)
	}
	ckpt := t.TempDir()
	if err := e.recordLimits(id, ckpt); err != nil {
		t.Fatal(err)
	}
	asked := engine.Spec{PidsLimit: 1024, WritableMiB: 384, TmpMiB: 192, ShmMiB: 96}
	got, err := restoredLimits(ckpt, asked)
	if err != nil || got.PidsLimit != 64 || !got.AgentPidsExempt || got.WritableMiB != 96 || got.TmpMiB != 48 || got.ShmMiB != 24 {
		t.Errorf("restored limits %+v (%v), want the checkpoint's 64/exempt/96/48/24", got, err)
	}
	asked.AgentPidsExempt = true
	got, err = restoredLimits(t.TempDir(), asked)
	if err != nil || got.PidsLimit != 0 || got.AgentPidsExempt || got.WritableMiB != 0 || got.TmpMiB != 0 || got.ShmMiB != 0 {
		t.Errorf("restored limits from a checkpoint without a record %d/%d (%v), want none", got.PidsLimit, got.WritableMiB, err)
	}
	if err := os.WriteFile(filepath.Join(ckpt, limitsFile), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := restoredLimits(ckpt, engine.Spec{}); err == nil {
		t.Error("a corrupt limits record restored without an error")
	}
	// An instance started before limits (no record in its bundle) gives its
	// checkpoints none.
	ckpt2 := t.TempDir()
	if err := e.recordLimits("sbx-z-00000001", ckpt2); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(ckpt2, limitsFile)); !os.IsNotExist(err) {
		t.Errorf("checkpoint of an instance without a record has %s (%v)", limitsFile, err)
	}
}
