package e2e

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/watchdog"
	"github.com/torpor/torpor/workload"
)

// TestClusterWatchdog: the server of node cl-c, which owns a running
// sandbox (hibernated once, resumed on cl-c), is killed with SIGKILL, its
// host alive. Its watchdog stops the sandbox's runsc instance (no runsc
// container under cl-c's root, no process under its bundle) before the
// other nodes declare cl-c lost (checked at every poll); the others then put
// the sandbox in error, and resumed through cl-a it runs once, on another
// node, continuing from its snapshot. Then cl-c, serving again, owns a new
// sandbox; its server is killed and at once started again: the new server
// heartbeats in time, the old watchdog leaves the instance to it (its log
// says so), and the sandbox keeps running on cl-c, reattached, the same
// process answering. Last, cl-c's server is stopped (SIGTERM) with that
// sandbox running and not started again: the watchdog stops the instance
// before cl-c is declared lost. With its watchdog killed too, a server
// started again after the self-fence time stops the instance itself before
// it reconciles.
func TestClusterWatchdog(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	a, c := cl.nodes["cl-a"], cl.nodes["cl-c"]
	var ids []string
	t.Cleanup(func() {
		for _, id := range ids {
			a.c.DeleteSandbox(context.Background(), id)
		}
	})

	// A running sandbox of cl-c with a snapshot.
	sb := create(t, c.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id := sb.ID
	ids = append(ids, id)
	if err := workload.Start(ctx, c.c, id, 16); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c.c, id, "/count")
	if err != nil {
		t.Fatal(err)
	}
	hibernate(t, c.c, id)
	if r, err := c.c.Resume(ctx, id); err != nil || r.Node != c.name {
		t.Fatalf("resume through %s: node %q %v; want %s (the snapshot's node, with room)", c.name, r.Node, err, c.name)
	}
	if n := runscSandboxesOf(t, c.dir, id); n != 1 {
		t.Fatalf("%s runs %d instances of %s; want 1", c.name, n, id)
	}
	if len(instanceProcs(c.dir, id)) == 0 {
		t.Fatalf("no process of %s's instance under %s's bundles", id, c.name)
	}

	// cl-c's server killed: its instance is gone before cl-c is lost.
	c.proc.cmd.Process.Kill()
	<-c.proc.done
	c.proc.done = nil
	killed := time.Now()
	gone := func() bool { return runscSandboxesOf(t, c.dir, id) == 0 && len(instanceProcs(c.dir, id)) == 0 }
	stopped, lost := stoppedBeforeLost(t, ctx, a, c, id, killed, gone)
	t.Logf("server killed: its watchdog stopped the instance %v after the kill; %s declared lost %v after it (self-fence time %v, lease %v)",
		stopped.Sub(killed).Round(100*time.Millisecond), c.name, lost.Sub(killed).Round(100*time.Millisecond), node.SelfFenceAfter, node.LeaseTime)
	wlog, _ := os.ReadFile(filepath.Join(c.dir, watchdog.LogFile))
	if !strings.Contains(string(wlog), "the server is gone: stopped its instances") || !strings.Contains(string(wlog), id) {
		t.Errorf("%s's watchdog log does not say it stopped %s's instance:\n%s", c.name, id, wlog)
	}

	// The others fence it; resumed elsewhere it runs once.
	for s := get(t, a.c, id); s.State != apiv1.StateError; s = get(t, a.c, id) {
		if time.Since(killed) > node.LeaseTime+4*node.HeartbeatInterval {
			t.Fatalf("%v after the kill %s is %s on %q", time.Since(killed).Round(time.Second), id, s.State, s.Node)
		}
		time.Sleep(250 * time.Millisecond)
	}
	back, err := a.c.Resume(ctx, id)
	if err != nil || back.Node == "" || back.Node == c.name {
		t.Fatalf("resume through cl-a after the kill: node %q %v; want another node than %s", back.Node, err, c.name)
	}
	copies := 0
	for _, n := range cl.order {
		copies += runscSandboxesOf(t, n.dir, id)
	}
	if copies != 1 || len(instanceProcs(c.dir, id)) != 0 {
		t.Errorf("after the resume on %s: %d runsc instances of %s on the nodes (want 1), processes under %s's bundles %v",
			back.Node, copies, id, c.name, instanceProcs(c.dir, id))
	}
	cnt, err := workload.Get(ctx, a.c, id, "/count")
	if err != nil || cnt.Pid != before.Pid || cnt.Count != before.Count+1 {
		t.Fatalf("resumed on %s: %+v %v; want pid %d count %d (the snapshot's, plus this request)", back.Node, cnt, err, before.Pid, before.Count+1)
	}

	// Killed and started again at once: the sandbox stays, reattached.
	cl.start(c)
	waitNodes(t, a.c, func(ns []apiv1.Node) bool { return stateOf(ns, c.name) == "active" })
	never := 0 // no idle pause or hibernate while the test waits
	sb2 := create(t, c.c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never, PauseAfterS: &never})
	ids = append(ids, sb2.ID)
	if sb2.Node != c.name {
		t.Fatalf("created through %s: node %q", c.name, sb2.Node)
	}
	if err := workload.Start(ctx, c.c, sb2.ID, 16); err != nil {
		t.Fatal(err)
	}
	before2, err := workload.Get(ctx, c.c, sb2.ID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	procs := instanceProcs(c.dir, sb2.ID)
	// Killed just after a heartbeat, the restart has the whole self-fence
	// time (less a second) to register: a loaded host's start-up fits.
	waitNodes(t, a.c, func(ns []apiv1.Node) bool {
		for _, n := range ns {
			if n.Name == c.name {
				return time.Since(n.HeartbeatAt) < time.Second
			}
		}
		return false
	})
	c.proc.cmd.Process.Kill()
	<-c.proc.done
	c.proc.done = nil
	killed = time.Now()
	cl.start(c)
	restarted := time.Now()
	t.Logf("%s's server killed and started again: serving %v after the kill", c.name, restarted.Sub(killed).Round(100*time.Millisecond))
	// The old watchdog's time passes: it leaves the instance to the new
	// server.
	logPath := filepath.Join(c.dir, watchdog.LogFile)
	for {
		wlog, _ = os.ReadFile(logPath)
		if strings.Count(string(wlog), "a new server heartbeats for this data directory") >= 1 {
			break
		}
		if time.Since(killed) > node.LeaseTime+4*node.HeartbeatInterval {
			t.Fatalf("%v after the kill and restart, %s's watchdog log does not say it left the instances to the new server:\n%s",
				time.Since(killed).Round(time.Second), c.name, wlog)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if strings.Count(string(wlog), "the server is gone: stopped its instances") != 1 {
		t.Errorf("%s's watchdogs stopped instances again after the quick restart:\n%s", c.name, wlog)
	}
	// Past the self-fence time and the lease of the last heartbeat before
	// the kill: the instance runs, the same processes, reattached.
	time.Sleep(time.Until(killed.Add(node.LeaseTime)))
	if got := instanceProcs(c.dir, sb2.ID); len(got) == 0 || len(procs) == 0 || got[0] != procs[0] {
		t.Errorf("after the quick restart the instance's processes are %v; before the kill %v", got, procs)
	}
	s := get(t, a.c, sb2.ID)
	if s.State != apiv1.StateRunning || s.Node != c.name {
		t.Fatalf("after the quick restart %s is %s on %q (%s); want running on %s", sb2.ID, s.State, s.Node, s.Error, c.name)
	}
	cnt, err = workload.Get(ctx, a.c, sb2.ID, "/count")
	if err != nil || cnt.Pid != before2.Pid || cnt.Count != before2.Count+1 {
		t.Fatalf("after the quick restart: %+v %v; want pid %d count %d (the same process, continuing)", cnt, err, before2.Pid, before2.Count+1)
	}
	if ns, err := a.c.ListNodes(ctx); err != nil || stateOf(ns, c.name) != "active" {
		t.Errorf("after the quick restart %s is %q (%v); want active", c.name, stateOf(ns, c.name), err)
	}
	if log, _ := os.ReadFile(c.log); !strings.Contains(string(log), "reconcile: reattached") {
		t.Errorf("%s's log does not say it reattached %s", c.name, sb2.ID)
	}

	// Stopped (SIGTERM) with the sandbox running and not started again:
	// the watchdog stops the instance before cl-c is lost, too.
	c.proc.stop(t)
	stoppedAt := time.Now()
	stopped, lost = stoppedBeforeLost(t, ctx, a, c, sb2.ID, stoppedAt, func() bool {
		return runscSandboxesOf(t, c.dir, sb2.ID) == 0 && len(instanceProcs(c.dir, sb2.ID)) == 0
	})
	t.Logf("server stopped (SIGTERM): its watchdog stopped the instance %v after the stop; %s declared lost %v after it",
		stopped.Sub(stoppedAt).Round(100*time.Millisecond), c.name, lost.Sub(stoppedAt).Round(100*time.Millisecond))

	// No watchdog (killed first), the server killed and started again after
	// the self-fence time: the new server stops the instance it finds
	// before it reconciles, and the sandbox is in error.
	cl.start(c)
	sb3 := create(t, c.c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never, PauseAfterS: &never})
	ids = append(ids, sb3.ID)
	if n := runscSandboxesOf(t, c.dir, sb3.ID); n != 1 {
		t.Fatalf("%s runs %d instances of %s; want 1", c.name, n, sb3.ID)
	}
	logb, _ := os.ReadFile(c.log)
	m := regexp.MustCompile(`watchdog started.* watchdog_pid=(\d+)`).FindAllSubmatch(logb, -1)
	if len(m) == 0 {
		t.Fatalf("%s's log names no watchdog pid", c.name)
	}
	wpid, _ := strconv.Atoi(string(m[len(m)-1][1]))
	if err := syscall.Kill(wpid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill %s's watchdog %d: %v", c.name, wpid, err)
	}
	waitDead(t, wpid)
	c.proc.cmd.Process.Kill()
	<-c.proc.done
	c.proc.done = nil
	killed = time.Now()
	time.Sleep(node.SelfFenceAfter + time.Second)
	if n := runscSandboxesOf(t, c.dir, sb3.ID); n != 1 {
		t.Fatalf("with no watchdog %s's instance of %s is gone already (%d left)", c.name, sb3.ID, n)
	}
	cl.start(c)
	if n := runscSandboxesOf(t, c.dir, sb3.ID); n != 0 || len(instanceProcs(c.dir, sb3.ID)) != 0 {
		t.Errorf("the late server runs %d instances of %s: %v", n, sb3.ID, instanceProcs(c.dir, sb3.ID))
	}
	if log, _ := os.ReadFile(c.log); !strings.Contains(string(log), "registered later than the self-fence time") || !strings.Contains(string(log), sb3.ID) {
		t.Errorf("%s's log does not say the late server stopped %s's instance", c.name, sb3.ID)
	}
	if s := get(t, c.c, sb3.ID); s.State != apiv1.StateError {
		t.Errorf("after the late restart %s is %s on %q; want error", sb3.ID, s.State, s.Node)
	}
	t.Logf("no watchdog: the server started again %v after the kill stopped the instance before reconciling", time.Since(killed).Round(100*time.Millisecond))
}

// stoppedBeforeLost polls every 250 ms, from since until node n is
// declared lost (as observer's node list says), whether n's instance of
// sandbox id is gone, and returns when it was first seen gone and when n
// was first seen lost. It fails the test if n is declared lost while the
// instance still runs (split brain), or if n is not lost within the lease
// time and four heartbeats.
func stoppedBeforeLost(t *testing.T, ctx context.Context, observer, n *clusterNode, id string, since time.Time, gone func() bool) (stopped, lost time.Time) {
	t.Helper()
	for lost.IsZero() {
		if time.Since(since) > node.LeaseTime+4*node.HeartbeatInterval {
			t.Fatalf("%v after %v: instance stopped at %v, %s not declared lost", time.Since(since).Round(time.Second), since, stopped, n.name)
		}
		if stopped.IsZero() && gone() {
			stopped = time.Now()
		}
		if ns, err := observer.c.ListNodes(ctx); err == nil && stateOf(ns, n.name) == "lost" {
			lost = time.Now()
			if stopped.IsZero() {
				if !gone() {
					t.Fatalf("%s declared lost %v after %v while its instance of %s still runs (split brain): %v",
						n.name, lost.Sub(since).Round(time.Second), since, id, instanceProcs(n.dir, id))
				}
				stopped = lost
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	return stopped, lost
}

// instanceProcs lists the live host processes (sandbox, gofer) of sandbox
// id's runsc instances under data directory dir's engine (their command
// lines name its bundle), as "pid: cmdline".
func instanceProcs(dir, id string) []string {
	return hostProcs(filepath.Join(dir, "gvisor", "bundles", id+"-"))
}
