// Package enginetest is the conformance suite every engine.Engine implementation
// runs (gVisor today, a microVM engine later): start, the guest agent answering,
// checkpoint and restore with state continuing, one checkpoint restored twice as
// independent clones, checkpoint that leaves the instance running, a
// CheckpointExit image restored while its instance is torn down (for an
// engine.ExitCheckpointer), stop and list.
package enginetest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// Instance ids in the suite all have one length: runsc resolves a container id
// by prefix, so an id that is a prefix of another is ambiguous to it.

// Setup gives the suite an engine and a template spec (RootFS, GuestDir with the
// agent, limits); the suite sets Spec.ID itself.
type Setup struct {
	Engine engine.Engine
	Spec   engine.Spec
	// AfterCheckpointExit, if set, is called with the instance's id right
	// after a CheckpointExit (engine.ExitCheckpointer), before its Stop: an
	// engine's own checks of the exited instance.
	AfterCheckpointExit func(t *testing.T, id string)
}

func agent(e engine.Engine, id string) *agentclient.Client {
	return agentclient.New(func(ctx context.Context) (net.Conn, error) {
		return e.Dial(ctx, id, engine.AgentPort)
	})
}

func run(t *testing.T, c *agentclient.Client, cmd ...string) string {
	t.Helper()
	out, errb, code, err := c.Run(context.Background(), proto.ExecRequest{Cmd: cmd})
	if err != nil || code != 0 {
		t.Fatalf("%v: exit %d, err %v, stderr %s", cmd, code, err, errb)
	}
	return strings.TrimSpace(string(out))
}

// Run runs the suite.
func Run(t *testing.T, s Setup) {
	ctx := context.Background()
	e := s.Engine
	prefix := "conf-" + strings.ToLower(strings.ReplaceAll(time.Now().Format("150405.000"), ".", "")) + "-"
	var started []string
	var mu sync.Mutex
	start := func(t *testing.T, name string, dir string) *agentclient.Client {
		t.Helper()
		sp := s.Spec
		sp.ID = prefix + name
		mu.Lock()
		started = append(started, sp.ID)
		mu.Unlock()
		var err error
		if dir == "" {
			err = e.Start(ctx, sp)
		} else {
			err = e.Restore(ctx, sp, dir)
		}
		if err != nil {
			t.Fatalf("launch %s: %v", sp.ID, err)
		}
		c := agent(e, sp.ID)
		if err := c.WaitReady(ctx, 30*time.Second); err != nil {
			t.Fatalf("agent of %s: %v", sp.ID, err)
		}
		return c
	}
	t.Cleanup(func() {
		for _, id := range started {
			if err := e.Stop(ctx, id); err != nil {
				t.Errorf("cleanup stop %s: %v", id, err)
			}
		}
		infos, _ := e.List(ctx)
		for _, i := range infos {
			if strings.HasPrefix(i.ID, prefix) {
				t.Errorf("instance %s still listed after Stop: %+v", i.ID, i)
			}
		}
	})

	t.Run("StartExecStop", func(t *testing.T) {
		c := start(t, "a0", "")
		if got := run(t, c, "sh", "-c", "echo hello"); got != "hello" {
			t.Fatalf("echo: %q", got)
		}
		infos, err := e.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, i := range infos {
			found = found || (i.ID == prefix+"a0" && i.Running)
		}
		if !found {
			t.Fatalf("List does not show %sa0 running: %+v", prefix, infos)
		}
		if err := e.Stop(ctx, prefix+"a0"); err != nil {
			t.Fatal(err)
		}
		if err := e.Stop(ctx, prefix+"a0"); err != nil {
			t.Fatalf("second Stop: %v", err)
		}
		if _, err := e.Dial(ctx, prefix+"a0", engine.AgentPort); !errors.Is(err, engine.ErrNotRunning) {
			t.Fatalf("Dial after Stop: %v, want ErrNotRunning", err)
		}
	})

	t.Run("CheckpointRestoreClones", func(t *testing.T) {
		c := start(t, "b0", "")
		// State in memory (a sleeping process), and in the writable layer.
		run(t, c, "sh", "-c", "echo before > /root/state && sleep 1000 >/dev/null 2>&1 &")
		pid := run(t, c, "sh", "-c", "pgrep -x sleep || ps -eo pid,comm | awk '$2==\"sleep\"{print $1}'")
		dir := filepath.Join(t.TempDir(), "ckpt")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := e.Checkpoint(ctx, prefix+"b0", dir, false); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Dial(ctx, prefix+"b0", engine.AgentPort); err == nil {
			t.Fatal("instance still answers after Checkpoint without leaveRunning")
		}
		var wg sync.WaitGroup
		clients := make([]*agentclient.Client, 2)
		for i, n := range []string{"b1", "b2"} {
			wg.Add(1)
			go func() { defer wg.Done(); clients[i] = start(t, n, dir) }()
		}
		wg.Wait()
		for i, c := range clients {
			if c == nil {
				t.FailNow()
			}
			if got := run(t, c, "cat", "/root/state"); got != "before" {
				t.Fatalf("clone %d: file = %q", i, got)
			}
			if got := run(t, c, "sh", "-c", "pgrep -x sleep || ps -eo pid,comm | awk '$2==\"sleep\"{print $1}'"); got != pid {
				t.Fatalf("clone %d: sleeping process %q, want %q", i, got, pid)
			}
			run(t, c, "sh", "-c", "echo clone"+string(rune('0'+i))+" > /root/state")
		}
		for i, c := range clients {
			if got := run(t, c, "cat", "/root/state"); got != "clone"+string(rune('0'+i)) {
				t.Fatalf("clone %d sees %q: clones are not independent", i, got)
			}
		}
	})

	t.Run("CheckpointLeaveRunning", func(t *testing.T) {
		c := start(t, "c0", "")
		run(t, c, "sh", "-c", "echo one > /root/x")
		dir := filepath.Join(t.TempDir(), "ckpt")
		os.Mkdir(dir, 0o700)
		if err := e.Checkpoint(ctx, prefix+"c0", dir, true); err != nil {
			t.Fatal(err)
		}
		if got := run(t, c, "cat", "/root/x"); got != "one" {
			t.Fatalf("after leave-running checkpoint: %q", got)
		}
		c2 := start(t, "c1", dir)
		run(t, c, "sh", "-c", "echo two > /root/x")
		if got := run(t, c2, "cat", "/root/x"); got != "one" {
			t.Fatalf("clone sees the source's later write: %q", got)
		}
	})

	if xc, ok := e.(engine.ExitCheckpointer); ok {
		t.Run("CheckpointExitThenStop", func(t *testing.T) {
			c := start(t, "e0", "")
			run(t, c, "sh", "-c", "echo kept > /root/x && sleep 1000 >/dev/null 2>&1 &")
			dir := filepath.Join(t.TempDir(), "ckpt")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := xc.CheckpointExit(ctx, prefix+"e0", dir); err != nil {
				t.Fatal(err)
			}
			if s.AfterCheckpointExit != nil {
				s.AfterCheckpointExit(t, prefix+"e0")
			}
			// The image is complete before the teardown: restore it while the
			// exited instance is still being removed.
			var wg sync.WaitGroup
			var stopErr error
			wg.Add(1)
			go func() { defer wg.Done(); stopErr = e.Stop(ctx, prefix+"e0") }()
			c1 := start(t, "e1", dir)
			wg.Wait()
			if stopErr != nil {
				t.Fatalf("Stop after CheckpointExit: %v", stopErr)
			}
			if _, err := e.Dial(ctx, prefix+"e0", engine.AgentPort); !errors.Is(err, engine.ErrNotRunning) {
				t.Fatalf("Dial after CheckpointExit and Stop: %v, want ErrNotRunning", err)
			}
			infos, err := e.List(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, i := range infos {
				if i.ID == prefix+"e0" {
					t.Fatalf("%se0 still listed after Stop: %+v", prefix, i)
				}
			}
			if got := run(t, c1, "cat", "/root/x"); got != "kept" {
				t.Fatalf("restored from a CheckpointExit image: /root/x = %q", got)
			}
			run(t, c1, "sh", "-c", "pgrep -x sleep || ps -eo comm | grep -qx sleep")
		})
	}

	// Stop while another goroutine lists instances (the manager's watchers do):
	// nothing of the stopped instances may be listed afterwards. With runsc, a
	// list racing a delete re-created the container's lock file, which stayed
	// for good.
	t.Run("StopWhileListing", func(t *testing.T) {
		const n = 4
		var ids []string
		for i := 0; i < n; i++ {
			start(t, fmt.Sprintf("l%d", i), "")
			ids = append(ids, fmt.Sprintf("%sl%d", prefix, i))
		}
		done := make(chan struct{})
		var lists sync.WaitGroup
		for w := 0; w < 2; w++ {
			lists.Add(1)
			go func() {
				defer lists.Done()
				for {
					select {
					case <-done:
						return
					default:
					}
					_, _ = e.List(ctx)
				}
			}()
		}
		var stops sync.WaitGroup
		for _, id := range ids {
			stops.Add(1)
			go func(id string) {
				defer stops.Done()
				if err := e.Stop(ctx, id); err != nil {
					t.Errorf("Stop %s: %v", id, err)
				}
			}(id)
		}
		stops.Wait()
		close(done)
		lists.Wait()
		infos, err := e.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range infos {
			for _, id := range ids {
				if i.ID == id {
					t.Errorf("%s still listed after Stop (while listing): %+v", id, i)
				}
			}
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		sp := s.Spec
		sp.ID = "Bad/ID"
		if err := e.Start(ctx, sp); err == nil {
			t.Fatal("Start with an invalid id succeeded")
		}
		sp.ID = prefix + "d0"
		if err := e.Restore(ctx, sp, "relative/dir"); err == nil {
			t.Fatal("Restore from a relative dir succeeded")
		}
		if err := e.Restore(ctx, sp, t.TempDir()); err == nil {
			t.Fatal("Restore from an empty dir succeeded")
		}
		if err := e.Stop(ctx, prefix+"zz"); err != nil {
			t.Fatalf("Stop of an unknown instance: %v", err)
		}
	})
}
