package e2e

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestServerRestart restarts the server (same data directory) with sandboxes in
// three situations: hibernated (resumes afterwards, its process continues),
// running (reattached: reported running and exec works) and running but with its
// runsc sandbox process killed while the server was down (reported error, and
// nothing of it is left on the host). After each restart the list must report
// only true states.
func TestServerRestart(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)

	hib := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if err := workload.Start(ctx, c, hib.ID, 8); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c, hib.ID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	hibernate(t, c, hib.ID)

	live := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	writeFile(t, c, live.ID, "/root/before-restart.txt", []byte("written before the restart\n"))
	bgPid, err := c.ExecBackground(ctx, live.ID, apiv1.ExecRequest{Cmd: []string{"sleep", "3600"}})
	if err != nil {
		t.Fatal(err)
	}
	_, _, livePids := instancesOf(t, srv, live.ID)

	t0 := time.Now()
	srv.Restart(t)
	t.Logf("restart with one hibernated and one running sandbox took %v", time.Since(t0).Round(time.Millisecond))
	c = srv.Client
	checkListTrue(t, srv)

	// The hibernated one resumes on the next request, its process continuing.
	wantState(t, c, hib.ID, apiv1.StateHibernated)
	st, err := workload.Get(ctx, c, hib.ID, "/count")
	if err != nil {
		t.Fatalf("GET /count after restart: %v", err)
	}
	if st.Count != before.Count+1 || st.Pid != before.Pid {
		t.Errorf("after restart and resume: count %d pid %d, want count %d pid %d", st.Count, st.Pid, before.Count+1, before.Pid)
	}
	wantState(t, c, hib.ID, apiv1.StateRunning)

	// The running one was reattached: same engine process, exec works, its files
	// and background process are there.
	wantState(t, c, live.ID, apiv1.StateRunning)
	if _, _, pids := instancesOf(t, srv, live.ID); fmt.Sprint(pids) != fmt.Sprint(livePids) {
		t.Errorf("running sandbox's engine pids %v after restart, want %v (the same process)", pids, livePids)
	}
	if got := sh(t, c, live.ID, "cat /root/before-restart.txt"); got != "written before the restart\n" {
		t.Errorf("file after restart: %q", got)
	}
	sh(t, c, live.ID, fmt.Sprintf("kill -0 %d", bgPid))
	checkListTrue(t, srv)

	// A sandbox whose runsc process dies while the server is down.
	doomed := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	killWhileStopped(t, srv, doomed.ID)
	c = srv.Client

	d := get(t, c, doomed.ID)
	if d.State != apiv1.StateError || d.Error == "" {
		t.Errorf("sandbox whose process died: state %q error %q, want error with a reason", d.State, d.Error)
	} else {
		t.Logf("reported: state %s, error %q", d.State, d.Error)
	}
	assertGone(t, srv, doomed.ID)
	// The others are unharmed.
	wantState(t, c, live.ID, apiv1.StateRunning)
	sh(t, c, live.ID, "true")
	wantState(t, c, hib.ID, apiv1.StateRunning)
	if st2, err := workload.Get(ctx, c, hib.ID, "/count"); err != nil || st2.Count != st.Count+1 {
		t.Errorf("workload after second restart: %+v %v, want count %d", st2, err, st.Count+1)
	}
	checkListTrue(t, srv)

	// The sandbox in state error can still be deleted, and then nothing is left.
	if err := c.DeleteSandbox(ctx, doomed.ID); err != nil {
		t.Errorf("delete the sandbox in state error: %v", err)
	}
	assertGone(t, srv, doomed.ID)
}

// checkListTrue compares every sandbox the API lists with the host: running means
// exactly one running engine instance whose agent answers an exec; hibernated and
// error mean no instance and no process.
func checkListTrue(t *testing.T, srv *servertest.Server) {
	t.Helper()
	for _, sb := range mustList(t, srv.Client) {
		running, all, _ := instancesOf(t, srv, sb.ID)
		switch sb.State {
		case apiv1.StateRunning:
			if len(running) != 1 {
				t.Errorf("list says %s is running, engine runs %v", sb.ID, running)
				continue
			}
			out, _, code, err := srv.Client.ExecCollect(ctxFor(t, time.Minute), sb.ID, apiv1.ExecRequest{Cmd: []string{"echo", "ok"}})
			if err != nil || code != 0 || string(out) != "ok\n" {
				t.Errorf("list says %s is running, but exec gives %q exit %d err %v", sb.ID, out, code, err)
			}
		case apiv1.StateHibernated, apiv1.StateError:
			if len(all) > 0 {
				t.Errorf("list says %s is %s, engine has %v (running %v)", sb.ID, sb.State, all, running)
			}
			if p := hostProcs(sb.ID); len(p) > 0 {
				t.Errorf("list says %s is %s, host processes: %s", sb.ID, sb.State, strings.Join(p, "; "))
			}
		default:
			t.Errorf("list shows %s in transitional state %q with no call in flight", sb.ID, sb.State)
		}
	}
}

// waitDead waits until pid is gone or a zombie.
func waitDead(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s := procState(fmt.Sprint(pid))
		if s == 0 || s == 'Z' {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d still alive (state %c)", pid, s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A sandbox whose process dies (here: killed, as the host's OOM killer would)
// is reported error; an explicit resume recovers it from its last snapshot —
// the same process, with the state it had at that hibernate — while exec is
// refused naming the reason. One that never hibernated has nothing to recover
// and is refused with 409.
func TestResumeRecoversErrorSandbox(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	waitError := func(id string) apiv1.Sandbox {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			sb := get(t, c, id)
			if sb.State == apiv1.StateError {
				return sb
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s is %s 30 s after its process was killed, want error", id, sb.State)
			}
		}
	}
	kill := func(id string) {
		t.Helper()
		_, _, pids := instancesOf(t, srv, id)
		if len(pids) != 1 {
			t.Fatalf("engine pids of %s: %v, want one", id, pids)
		}
		if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		waitDead(t, pids[0])
	}

	sb := create(t, c, apiv1.CreateSandboxRequest{})
	if err := workload.Start(ctx, c, sb.ID, 8); err != nil {
		t.Fatal(err)
	}
	atHibernate, err := workload.Get(ctx, c, sb.ID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	hibernate(t, c, sb.ID)
	if _, err := workload.Get(ctx, c, sb.ID, "/count"); err != nil { // resumes it
		t.Fatal(err)
	}
	kill(sb.ID)
	e := waitError(sb.ID)
	res := rawCall(t, "POST", srv.URL+"/v1/sandboxes/"+sb.ID+"/exec", "application/json", []byte(`{"cmd":["true"]}`))
	if res.Status != 409 || !strings.Contains(res.Err.Message, e.Error) {
		t.Errorf("exec in state error: HTTP %d %q, want 409 naming the reason %q", res.Status, res.Err.Message, e.Error)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume of the sandbox in state error: %v", err)
	}
	if got := get(t, c, sb.ID); got.State != apiv1.StateRunning || got.Error != "" {
		t.Fatalf("after the recovering resume: state %s, error %q", got.State, got.Error)
	}
	after, err := workload.Get(ctx, c, sb.ID, "/count")
	if err != nil || after.Pid != atHibernate.Pid || after.Count != atHibernate.Count+1 {
		t.Fatalf("after recovery: %+v %v; want pid %d, count %d (the snapshot's state, one request later)", after, err, atHibernate.Pid, atHibernate.Count+1)
	}

	never := create(t, c, apiv1.CreateSandboxRequest{})
	kill(never.ID)
	waitError(never.ID)
	if _, err := c.Resume(ctx, never.ID); err == nil || !strings.Contains(err.Error(), "no snapshot") {
		t.Errorf("resume of a sandbox in state error without a snapshot: %v, want a conflict saying it has no snapshot", err)
	}
	for _, id := range []string{sb.ID, never.ID} {
		if err := c.DeleteSandbox(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
		assertGone(t, srv, id)
	}
}

// TestForkCloneLostRecoversAsClone: a fork clone whose runsc sandbox dies while
// the server is down (before it ever hibernated) is reported error; resuming it
// restores its source's snapshot, so the guest must be told it is a fork
// (forked: true), as at the clone's creation. A new-user trial found such a
// clone told forked:false after a crash interrupted its creation, keeping the
// source's fork-unsafe secrets. Once the clone hibernates itself, its resumes
// are ordinary again (forked: false).
func TestForkCloneLostRecoversAsClone(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	src := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	clones, err := c.Fork(ctx, src.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	cl := clones[0]
	killWhileStopped(t, srv, cl.ID)
	c = srv.Client
	wantState(t, c, cl.ID, apiv1.StateError)

	got, err := c.Resume(ctx, cl.ID)
	if err != nil {
		t.Fatalf("resume the lost clone: %v", err)
	}
	if got.LastResume == nil || !got.LastResume.Forked {
		t.Errorf("lost clone resumed from its source's snapshot: last_resume %+v, want forked true", got.LastResume)
	}
	if out := sh(t, c, cl.ID, "cat /run/torpor/resume.json"); !strings.Contains(out, `"forked":true`) {
		t.Errorf("lost clone's resume.json: %s, want forked true", out)
	}

	hibernate(t, c, cl.ID)
	got, err = c.Resume(ctx, cl.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.LastResume == nil || got.LastResume.Forked {
		t.Errorf("clone resumed from its own snapshot: last_resume %+v, want forked false", got.LastResume)
	}
}

// killWhileStopped stops the server, kills sandbox id's runsc sandbox process
// (its one engine instance) and starts the server again on the same data.
func killWhileStopped(t *testing.T, srv *servertest.Server, id string) {
	t.Helper()
	_, _, pids := instancesOf(t, srv, id)
	if len(pids) != 1 || pids[0] <= 0 {
		t.Fatalf("engine pids of %s: %v, want one", id, pids)
	}
	srv.Stop()
	if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
		t.Fatalf("kill runsc sandbox process %d: %v", pids[0], err)
	}
	waitDead(t, pids[0])
	t.Logf("killed %s's runsc sandbox process %d while the server was stopped", id, pids[0])
	srv.Restart(t)
}
