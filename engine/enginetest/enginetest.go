// Package enginetest is the conformance suite every engine.Engine implementation
// runs (gVisor and the in-memory engine/fake today, a microVM engine later):
// start, the guest agent answering, checkpoint and restore with the writable
// layer continuing (and, for engines that keep processes, a process too), one
// checkpoint restored twice as independent clones, checkpoint that leaves the
// instance running, a CheckpointExit image restored while its instance is torn
// down (for an engine.ExitCheckpointer), pause, a checkpoint of the paused
// instance restored and unpause (for an engine.Pauser), Wait, stop and list.
package enginetest

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	// KeepsProcesses says that a restored instance continues the processes of
	// its checkpoint (a sleeping process is there with its pid): true for a
	// real engine, whose checkpoint is the whole sandbox; false for
	// engine/fake, whose agent runs commands on the host.
	KeepsProcesses bool
	// KillProcesses, if set, kills instance id's processes from outside the
	// engine, as the host's OOM killer or an operator's kill does; the suite
	// then checks that Unpause of such a paused instance says
	// engine.ErrNotRunning (the manager falls back to the pause's snapshot).
	KillProcesses func(t *testing.T, id string)
}

func agent(e engine.Engine, id string) *agentclient.Client {
	return agentclient.New(func(ctx context.Context) (net.Conn, error) {
		return e.Dial(ctx, id, engine.AgentPort)
	})
}

// writeFile writes content to path in the instance's writable layer (the
// agent's files API).
func writeFile(t *testing.T, c *agentclient.Client, path, content string) {
	t.Helper()
	if err := c.WriteFile(context.Background(), path, strings.NewReader(content), int64(len(content))); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// readFile returns the content of path in the instance (the agent's files API).
func readFile(t *testing.T, c *agentclient.Client, path string) string {
	t.Helper()
	r, _, err := c.ReadFile(context.Background(), path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return string(b)
}

// sleepPid is the command that prints the pid of the instance's sleep process.
var sleepPid = []string{"sh", "-c", "pgrep -x sleep || ps -eo pid,comm | awk '$2==\"sleep\"{print $1}'"}

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
		// State in the writable layer and, for an engine that keeps them, in
		// memory (a sleeping process).
		writeFile(t, c, "/root/state", "before")
		pid := ""
		if s.KeepsProcesses {
			run(t, c, "sh", "-c", "sleep 1000 >/dev/null 2>&1 &")
			pid = run(t, c, sleepPid...)
		}
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
			if got := readFile(t, c, "/root/state"); got != "before" {
				t.Fatalf("clone %d: file = %q", i, got)
			}
			if s.KeepsProcesses {
				if got := run(t, c, sleepPid...); got != pid {
					t.Fatalf("clone %d: sleeping process %q, want %q", i, got, pid)
				}
			}
			writeFile(t, c, "/root/state", "clone"+string(rune('0'+i)))
		}
		for i, c := range clients {
			if got := readFile(t, c, "/root/state"); got != "clone"+string(rune('0'+i)) {
				t.Fatalf("clone %d sees %q: clones are not independent", i, got)
			}
		}
	})

	t.Run("CheckpointLeaveRunning", func(t *testing.T) {
		c := start(t, "c0", "")
		writeFile(t, c, "/root/x", "one")
		dir := filepath.Join(t.TempDir(), "ckpt")
		os.Mkdir(dir, 0o700)
		if err := e.Checkpoint(ctx, prefix+"c0", dir, true); err != nil {
			t.Fatal(err)
		}
		if got := readFile(t, c, "/root/x"); got != "one" {
			t.Fatalf("after leave-running checkpoint: %q", got)
		}
		c2 := start(t, "c1", dir)
		writeFile(t, c, "/root/x", "two")
		if got := readFile(t, c2, "/root/x"); got != "one" {
			t.Fatalf("clone sees the source's later write: %q", got)
		}
	})

	if xc, ok := e.(engine.ExitCheckpointer); ok {
		t.Run("CheckpointExitThenStop", func(t *testing.T) {
			c := start(t, "e0", "")
			writeFile(t, c, "/root/x", "kept")
			if s.KeepsProcesses {
				run(t, c, "sh", "-c", "sleep 1000 >/dev/null 2>&1 &")
			}
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
			if got := readFile(t, c1, "/root/x"); got != "kept" {
				t.Fatalf("restored from a CheckpointExit image: /root/x = %q", got)
			}
			if s.KeepsProcesses {
				run(t, c1, "sh", "-c", "pgrep -x sleep || ps -eo comm | grep -qx sleep")
			}
		})
	}

	if pe, ok := e.(engine.Pauser); ok {
		t.Run("PauseCheckpointUnpause", func(t *testing.T) { runPause(t, s, e, pe, start, prefix) })
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

	// Wait follows an instance until it exits, whoever ends it: here Stop.
	t.Run("WaitUntilStop", func(t *testing.T) {
		start(t, "w0", "")
		id := prefix + "w0"
		type result struct {
			st  engine.ExitStatus
			err error
		}
		done := make(chan result, 1)
		go func() {
			st, err := e.Wait(ctx, id)
			done <- result{st, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("Wait returned while the instance runs: %+v, %v", r.st, r.err)
		case <-time.After(200 * time.Millisecond):
		}
		if err := e.Stop(ctx, id); err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-done:
			if r.err != nil || r.st.What == "" {
				t.Fatalf("Wait after Stop: %+v, %v; want an exit status naming what exited", r.st, r.err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Wait did not return within 30 s of Stop")
		}
		if _, err := e.Wait(ctx, id); !errors.Is(err, engine.ErrNotRunning) {
			t.Fatalf("Wait on a stopped instance: %v, want ErrNotRunning", err)
		}
		wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		start(t, "w1", "")
		if _, err := e.Wait(wctx, prefix+"w1"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait with an ended context on a running instance: %v, want context.DeadlineExceeded", err)
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

// counter is a background process that writes an increasing count to
// /root/n every 50 ms.
var counter = []string{"sh", "-c", "(i=0; while :; do i=$((i+1)); echo $i > /root/n.tmp; mv /root/n.tmp /root/n; sleep 0.05; done) >/dev/null 2>&1 &"}

// count reads the counter (0 before its first write).
func count(t *testing.T, c *agentclient.Client) int {
	t.Helper()
	r, _, err := c.ReadFile(context.Background(), "/root/n")
	if err != nil {
		return 0
	}
	defer r.Close()
	n := 0
	fmt.Fscan(r, &n)
	return n
}

// listed returns instance id's Info from List.
func listed(t *testing.T, e engine.Engine, id string) engine.Info {
	t.Helper()
	infos, err := e.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range infos {
		if i.ID == id {
			return i
		}
	}
	t.Fatalf("%s not listed: %+v", id, infos)
	return engine.Info{}
}

// runPause: a paused instance is listed running and paused, runs nothing
// while paused (for an engine that keeps processes), can be checkpointed with
// leaveRunning into an image that restores running, stays paused through that
// checkpoint, and continues after Unpause with its files and processes.
func runPause(t *testing.T, s Setup, e engine.Engine, pe engine.Pauser, start func(*testing.T, string, string) *agentclient.Client, prefix string) {
	ctx := context.Background()
	id := prefix + "p0"
	c := start(t, "p0", "")
	writeFile(t, c, "/root/x", "paused")
	if s.KeepsProcesses {
		run(t, c, counter...)
		deadline := time.Now().Add(10 * time.Second)
		for count(t, c) < 2 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if err := pe.Pause(ctx, prefix+"zz"); !errors.Is(err, engine.ErrNotRunning) {
		t.Fatalf("Pause of an unknown instance: %v, want ErrNotRunning", err)
	}
	before := 0
	if s.KeepsProcesses {
		before = count(t, c)
	}
	c.CloseIdleConnections()
	if err := pe.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	if err := pe.Pause(ctx, id); err != nil {
		t.Fatalf("second Pause: %v", err)
	}
	if i := listed(t, e, id); !i.Running || !i.Paused {
		t.Fatalf("paused instance listed %+v, want Running and Paused", i)
	}
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := e.Checkpoint(ctx, id, dir, true); err != nil {
		t.Fatalf("Checkpoint of a paused instance: %v", err)
	}
	if i := listed(t, e, id); !i.Running || !i.Paused {
		t.Fatalf("after a leave-running checkpoint the paused instance is listed %+v, want still paused", i)
	}
	clone := start(t, "p1", dir)
	if got := readFile(t, clone, "/root/x"); got != "paused" {
		t.Fatalf("restored from a paused checkpoint: /root/x = %q", got)
	}
	if s.KeepsProcesses {
		n1 := count(t, clone)
		time.Sleep(300 * time.Millisecond)
		if n2 := count(t, clone); n2 <= n1 {
			t.Fatalf("restored from a paused checkpoint: the counter does not run (%d then %d)", n1, n2)
		}
	}
	time.Sleep(300 * time.Millisecond)
	pausedFor := time.Since(paused)
	if err := pe.Unpause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := pe.Unpause(ctx, id); err != nil {
		t.Fatalf("second Unpause: %v", err)
	}
	if i := listed(t, e, id); !i.Running || i.Paused {
		t.Fatalf("unpaused instance listed %+v, want Running, not Paused", i)
	}
	if got := readFile(t, c, "/root/x"); got != "paused" {
		t.Fatalf("after Unpause: /root/x = %q", got)
	}
	if s.KeepsProcesses {
		after := count(t, c)
		// At 20 counts a second, a counter that ran while paused would have
		// gone on by pausedFor/50ms.
		if ran := after - before; ran > int(pausedFor/(50*time.Millisecond))/2 {
			t.Fatalf("the counter went from %d to %d while paused for %v: the processes were not stopped", before, after, pausedFor)
		}
		time.Sleep(300 * time.Millisecond)
		if n := count(t, c); n <= after {
			t.Fatalf("after Unpause the counter does not run (%d then %d)", after, n)
		}
	}
	// A paused instance is stopped like a running one.
	if err := pe.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := e.Stop(ctx, id); err != nil {
		t.Fatalf("Stop of a paused instance: %v", err)
	}
	infos, err := e.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range infos {
		if i.ID == id {
			t.Fatalf("paused instance still listed after Stop: %+v", i)
		}
	}
	if err := pe.Unpause(ctx, id); !errors.Is(err, engine.ErrNotRunning) {
		t.Fatalf("Unpause of a stopped instance: %v, want ErrNotRunning", err)
	}
	if s.KillProcesses == nil {
		return
	}
	// A paused instance killed from outside the engine.
	killed := prefix + "p2"
	start(t, "p2", "")
	if err := pe.Pause(ctx, killed); err != nil {
		t.Fatal(err)
	}
	s.KillProcesses(t, killed)
	if err := pe.Unpause(ctx, killed); !errors.Is(err, engine.ErrNotRunning) {
		t.Fatalf("Unpause of a paused instance whose processes were killed: %v, want ErrNotRunning", err)
	}
	if err := e.Stop(ctx, killed); err != nil {
		t.Fatalf("Stop of a killed paused instance: %v", err)
	}
}
