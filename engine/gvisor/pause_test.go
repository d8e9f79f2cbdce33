package gvisor_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/torpor/torpor/engine/gvisor"
)

// controlServer answers uRPC calls on a unix socket at path the way a sandbox's
// control socket does ({"success":…,"err":…}): ok, called with each call's
// method while the caller waits for the answer, decides which.
func controlServer(t *testing.T, path string, ok func(method string) bool) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			var call struct {
				Method string `json:"method"`
			}
			if json.NewDecoder(c).Decode(&call) == nil {
				res := map[string]any{"success": true}
				if !ok(call.Method) {
					res = map[string]any{"success": false, "err": "refused by the test"}
				}
				_ = json.NewEncoder(c).Encode(res)
			}
			c.Close()
		}
	}()
}

// TestPauseRecordOrder: a pause is recorded paused in runsc's state file before
// its control call and an unpause running only after its call succeeded, and a
// call the sandbox refuses leaves the record as it was: running after a failed
// pause, paused after a failed unpause (the record keeps gVisor's stop count
// balanced: pause.go). No runsc runs: the state file, lock file and control
// socket are the test's.
func TestPauseRecordOrder(t *testing.T) {
	sh, err := exec.LookPath("false")
	if err != nil {
		t.Skip(err)
	}
	dir, err := os.MkdirTemp("", "tp-pause-") // short: a socket path is < 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e, err := gvisor.New(gvisor.Config{Runsc: sh, StateDir: filepath.Join(dir, "g")})
	if err != nil {
		t.Fatal(err)
	}
	const id = "sbx-pause-1"
	root := filepath.Join(dir, "g", "root")
	state := filepath.Join(root, id+"_sandbox:"+id+".state")
	sock := filepath.Join(dir, "ctl.sock")
	status := func() string {
		t.Helper()
		b, err := os.ReadFile(state)
		if err != nil {
			t.Fatal(err)
		}
		var st struct {
			Status string `json:"status"`
			Extra  string `json:"extra"`
		}
		if err := json.Unmarshal(b, &st); err != nil {
			t.Fatal(err)
		}
		if st.Extra != "kept" {
			t.Fatalf("state file lost a field: %s", b)
		}
		return st.Status
	}
	rec, _ := json.Marshal(map[string]any{"status": "running", "extra": "kept",
		"sandbox": map[string]any{"controlSocketPath": sock, "pid": 0}})
	if err := os.WriteFile(state, rec, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, id+"_sandbox:"+id+".lock"), nil, 0o640); err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		during []string // the record while each call was in flight
		accept atomic.Bool
	)
	controlServer(t, sock, func(method string) bool {
		b, _ := os.ReadFile(state)
		var st struct {
			Status string `json:"status"`
		}
		_ = json.Unmarshal(b, &st)
		mu.Lock()
		during = append(during, method+":"+st.Status)
		mu.Unlock()
		return accept.Load()
	})
	ctx := t.Context()

	steps := []struct {
		what   string
		call   func(context.Context, string) error
		accept bool
		want   string // the record after the call
	}{
		{"refused pause", e.Pause, false, "running"},
		{"pause", e.Pause, true, "paused"},
		{"second pause (already paused: no call)", e.Pause, true, "paused"},
		{"refused unpause", e.Unpause, false, "paused"},
		{"unpause", e.Unpause, true, "running"},
	}
	for _, st := range steps {
		accept.Store(st.accept)
		err := st.call(ctx, id)
		if st.accept && err != nil {
			t.Fatalf("%s: %v", st.what, err)
		}
		if !st.accept && err == nil {
			t.Fatalf("%s returned nil", st.what)
		}
		if got := status(); got != st.want {
			t.Errorf("after a %s the record says %q, want %s", st.what, got, st.want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	want := []string{
		"containerManager.Pause:paused", "containerManager.Pause:paused",
		"containerManager.Resume:paused", "containerManager.Resume:paused",
	}
	if len(during) != len(want) {
		t.Fatalf("calls %v, want %v", during, want)
	}
	for i := range want {
		if during[i] != want[i] {
			t.Errorf("call %d saw %s, want %s (all: %v)", i, during[i], want[i], during)
		}
	}
	if gvisor.RunscPauses(e) != 0 {
		t.Errorf("%d pauses ran runsc; the control socket answered every call", gvisor.RunscPauses(e))
	}
	if _, err := os.Stat(filepath.Join(root, ".status-"+id+".tmp")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a temporary status file was left: %v", err)
	}
}
