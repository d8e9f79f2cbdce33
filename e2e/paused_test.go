package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// The paused standby tier (docs/lifecycle.md): real sandboxes.

// waitPaused waits until sandbox id is paused with the pause's snapshot
// recorded (one other than notSnap) and returns it.
func waitPaused(t *testing.T, c *client.Client, id, notSnap string, within time.Duration) apiv1.Sandbox {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		sb := get(t, c, id)
		if sb.State == apiv1.StatePaused && sb.Snapshot != nil && sb.Snapshot.ID != notSnap {
			return sb
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is %s (snapshot %v) after %v; want paused with a new snapshot", id, sb.State, sb.Snapshot, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pause pauses sandbox id through the API and returns it.
func pause(t *testing.T, c *client.Client, id string) apiv1.Sandbox {
	t.Helper()
	t0 := time.Now()
	r, err := c.Pause(ctxFor(t, 2*time.Minute), id)
	if err != nil {
		t.Fatalf("pause %s: %v", id, err)
	}
	if r.State != apiv1.StatePaused || r.Snapshot == nil {
		t.Fatalf("pause %s: state %s snapshot %v; want paused with its snapshot", id, r.State, r.Snapshot)
	}
	t.Logf("paused %s in %v (snapshot %s, %d bytes)", id, time.Since(t0).Round(time.Millisecond), r.Snapshot.ID, r.Snapshot.Bytes)
	return r.Sandbox
}

// checkWorkload asks the workload for /count and /checksum and checks that it
// continued: count previous+1 (then +1 again for the checksum), the same pid,
// the data's checksum unchanged. It updates *count.
func checkWorkload(t *testing.T, ctx context.Context, c *client.Client, id, stage string, first workload.State, count *int64) time.Duration {
	t.Helper()
	t0 := time.Now()
	st, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		t.Fatalf("%s: GET /count: %v", stage, err)
	}
	took := time.Since(t0)
	cs, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatalf("%s: GET /checksum: %v", stage, err)
	}
	if st.Count != *count+1 || st.Pid != first.Pid || cs.Count != st.Count+1 {
		t.Fatalf("%s: count %d then %d, pid %d; want %d then %d, pid %d", stage, st.Count, cs.Count, st.Pid, *count+1, *count+2, first.Pid)
	}
	if cs.SHA256 != first.SHA256 || cs.Bytes != first.Bytes {
		t.Fatalf("%s: data checksum %s (%d bytes), want %s (%d bytes)", stage, cs.SHA256, cs.Bytes, first.SHA256, first.Bytes)
	}
	*count = cs.Count
	return took
}

// TestPausedTierIdle: an idle sandbox goes running -> paused (pause_after_s)
// -> hibernated (idle_timeout_s) by itself; a request at each stage is
// answered by the same process with its 64 MiB buffer intact. The unpause
// keeps instance and generation and tells the guest (event unpaused); the
// demotion takes no new snapshot and leaves no engine instance.
func TestPausedTierIdle(t *testing.T) {
	srv := start(t, servertest.Options{Lifecycle: true, LifecycleInterval: 200 * time.Millisecond})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: lcInt(8), PauseAfterS: lcInt(2)})
	if sb.PauseAfterS != 2 || sb.IdleTimeoutS != 8 {
		t.Fatalf("created with pause_after_s %d idle_timeout_s %d", sb.PauseAfterS, sb.IdleTimeoutS)
	}
	if err := workload.Start(ctx, c, sb.ID, 64); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count := first.Count
	// Running: answered as it is.
	checkWorkload(t, ctx, c, sb.ID, "running", first, &count)
	running := get(t, c, sb.ID)
	runInst, _, _ := instancesOf(t, srv, sb.ID)

	// Paused after 2 idle seconds.
	last := time.Now()
	p := waitPaused(t, c, sb.ID, "", 30*time.Second)
	if idle := time.Since(last); idle < 2*time.Second {
		t.Fatalf("paused %v after the last call; pause_after_s is 2", idle)
	}
	if p.Generation != running.Generation {
		t.Fatalf("pause changed the generation: %d -> %d", running.Generation, p.Generation)
	}
	if inst, _, _ := instancesOf(t, srv, sb.ID); len(inst) != 1 || inst[0] != runInst[0] {
		t.Fatalf("paused on instances %v, want the running one %v", inst, runInst)
	}
	took := checkWorkload(t, ctx, c, sb.ID, "paused", first, &count)
	t.Logf("paused -> first answer in %v", took.Round(100*time.Microsecond))
	u := get(t, c, sb.ID)
	if u.State != apiv1.StateRunning || u.Generation != running.Generation || u.LastResume == nil || u.LastResume.Event != "unpaused" {
		t.Fatalf("after the request: state %s generation %d (was %d) last resume %+v; want running, same generation, event unpaused",
			u.State, u.Generation, running.Generation, u.LastResume)
	}
	if inst, _, _ := instancesOf(t, srv, sb.ID); len(inst) != 1 || inst[0] != runInst[0] {
		t.Fatalf("unpaused on instances %v, want the same one %v", inst, runInst)
	}
	if ev := sh(t, c, sb.ID, "cat /run/torpor/resume.json"); !bytes.Contains([]byte(ev), []byte(`"kind":"unpaused"`)) {
		t.Fatalf("the guest's last resume event: %s; want kind unpaused", ev)
	}

	// Paused again, then hibernated at 8 idle seconds: the pause's snapshot,
	// no instance left.
	last = time.Now()
	p = waitPaused(t, c, sb.ID, p.Snapshot.ID, 30*time.Second)
	h := lcWaitState(t, c, sb.ID, apiv1.StateHibernated, 60*time.Second)
	if idle := h.Sub(last); idle < 8*time.Second {
		t.Fatalf("hibernated %v after the last call; idle_timeout_s is 8", idle)
	}
	hib := get(t, c, sb.ID)
	if hib.Snapshot == nil || hib.Snapshot.ID != p.Snapshot.ID {
		t.Fatalf("hibernated on snapshot %v, want the pause's %s", hib.Snapshot, p.Snapshot.ID)
	}
	assertGone(t, srv, sb.ID)
	checkWorkload(t, ctx, c, sb.ID, "hibernated", first, &count)
	if r := get(t, c, sb.ID); r.State != apiv1.StateRunning || r.Generation == running.Generation {
		t.Fatalf("after the resume: state %s generation %d; want running with a new generation", r.State, r.Generation)
	}
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}

// TestPausedStandbyBudget: with a standby budget of 600 MiB, three paused
// 256 MiB sandboxes are one too many: the one paused first is hibernated,
// the others stay paused, and every file written before its pause is there.
func TestPausedStandbyBudget(t *testing.T) {
	srv := start(t, servertest.Options{Lifecycle: true, LifecycleInterval: 200 * time.Millisecond, StandbyMemoryMiB: 600})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	var ids []string
	for i := 0; i < 3; i++ {
		sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: lcInt(0)})
		writeFile(t, c, sb.ID, "/root/acked.txt", []byte(sb.ID))
		ids = append(ids, sb.ID)
	}
	for _, id := range ids {
		pause(t, c, id)
	}
	lcWaitState(t, c, ids[0], apiv1.StateHibernated, 30*time.Second)
	assertGone(t, srv, ids[0])
	time.Sleep(time.Second) // several checks: nothing more is demoted
	for _, id := range ids[1:] {
		if st := get(t, c, id).State; st != apiv1.StatePaused {
			t.Fatalf("%s is %s; the two paused last fit the budget", id, st)
		}
	}
	if n := metric(t, srv, `torpor_paused_demotions_total{cause="standby_budget"}`); n != 1 {
		t.Errorf("standby-budget demotions: %v, want 1", n)
	}
	for _, id := range ids {
		if got := string(readFile(t, c, id, "/root/acked.txt")); got != id {
			t.Fatalf("%s: /root/acked.txt = %q after its pause (and demotion)", id, got)
		}
	}
	for _, id := range ids {
		if err := c.DeleteSandbox(ctx, id); err != nil {
			t.Fatal(err)
		}
		assertGone(t, srv, id)
	}
}

// TestPausedServerCrash: the server stops without any teardown (as a kill -9
// leaves it) while two sandboxes are paused; one sandbox's runsc process is
// killed too (its host memory lost, as in a host crash). After the restart the
// first is paused on its live instance, the second hibernated on its pause's
// snapshot; both answer with their processes and buffers intact, and nothing
// is orphaned.
func TestPausedServerCrash(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	type box struct {
		id    string
		first workload.State
		count int64
	}
	var boxes []*box
	for i := 0; i < 2; i++ {
		sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: lcInt(0)})
		if err := workload.Start(ctx, c, sb.ID, 16); err != nil {
			t.Fatal(err)
		}
		first, err := workload.Get(ctx, c, sb.ID, "/checksum")
		if err != nil {
			t.Fatal(err)
		}
		boxes = append(boxes, &box{id: sb.ID, first: first, count: first.Count})
		pause(t, c, sb.ID)
	}
	liveInst, _, _ := instancesOf(t, srv, boxes[0].id)
	_, _, pids := instancesOf(t, srv, boxes[1].id)
	if len(pids) != 1 {
		t.Fatalf("engine pids of %s: %v", boxes[1].id, pids)
	}
	srv.Stop()
	if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitDead(t, pids[0])
	srv.Restart(t)
	c = srv.Client

	if sb := get(t, c, boxes[0].id); sb.State != apiv1.StatePaused {
		t.Fatalf("after restart: %s (instance alive) is %s, want paused", boxes[0].id, sb.State)
	}
	if inst, _, _ := instancesOf(t, srv, boxes[0].id); len(inst) != 1 || inst[0] != liveInst[0] {
		t.Fatalf("after restart: %s on instances %v, want its paused one %v", boxes[0].id, inst, liveInst)
	}
	if sb := get(t, c, boxes[1].id); sb.State != apiv1.StateHibernated {
		t.Fatalf("after restart: %s (process killed) is %s, want hibernated on its pause's snapshot", boxes[1].id, sb.State)
	}
	assertGone(t, srv, boxes[1].id)
	for _, b := range boxes {
		checkWorkload(t, ctx, c, b.id, "after restart", b.first, &b.count)
	}
	checkListTrue(t, srv)
	for _, b := range boxes {
		if err := c.DeleteSandbox(ctx, b.id); err != nil {
			t.Fatal(err)
		}
		assertGone(t, srv, b.id)
	}
}

// TestPausedUsesNoCPU: a sandbox whose process spins uses (almost) no CPU
// while paused, as GET /v1/sandboxes/{id}/metrics reads it from its cgroup
// (checked against the engine's own meter), and spins again once a request
// has unpaused it; its memory stays held (logged: what the paused tier
// costs). Hibernated, it has no metrics (409) and no host process.
func TestPausedUsesNoCPU(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: lcInt(0)})
	if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "while :; do :; done"}}); err != nil {
		t.Fatal(err)
	}
	inst, _, _ := instancesOf(t, srv, sb.ID)
	if len(inst) != 1 {
		t.Fatalf("instances of %s: %v", sb.ID, inst)
	}
	meter, ok := srv.Engine.(engine.CPUMeter)
	if _, okm := srv.Engine.(engine.MemoryMeter); !ok || !okm {
		t.Skip("the engine meters no CPU or memory")
	}
	sample := func(want string) apiv1.SandboxMetrics {
		t.Helper()
		m, err := c.SandboxMetrics(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if m.State != want || m.MemoryBytes <= 0 || m.MemoryLimitBytes != 256<<20 {
			t.Fatalf("metrics %+v, want state %s, memory held, limit 256 MiB", m, want)
		}
		return m
	}
	cpuOver := func(d time.Duration, state string) (time.Duration, apiv1.SandboxMetrics) {
		t.Helper()
		a := sample(state)
		time.Sleep(d)
		b := sample(state)
		return time.Duration((b.CPUTimeS - a.CPUTimeS) * float64(time.Second)), b
	}
	running, runM := cpuOver(time.Second, "running")
	if eng, err := meter.CPUTime(inst[0]); err != nil || eng < time.Duration(runM.CPUTimeS*float64(time.Second)) {
		t.Fatalf("the engine meters %v (%v) after the API said %.3f s", eng, err, runM.CPUTimeS)
	}
	pause(t, c, sb.ID)
	time.Sleep(200 * time.Millisecond) // the pause's snapshot writes are done
	paused, pausedM := cpuOver(2*time.Second, "paused")
	t.Logf("CPU: %v in 1 s running, %v in 2 s paused; memory held: %.1f MiB running, %.1f MiB paused",
		running, paused, float64(runM.MemoryBytes)/(1<<20), float64(pausedM.MemoryBytes)/(1<<20))
	// The machine is shared: the spinner gets what the others leave it, but
	// far more than a paused sandbox's few milliseconds.
	if running < 100*time.Millisecond {
		t.Fatalf("the spinning sandbox used only %v of CPU in 1 s running: the check below would prove nothing", running)
	}
	if paused > 50*time.Millisecond {
		t.Fatalf("a paused sandbox used %v of CPU in 2 s", paused)
	}
	sh(t, c, sb.ID, "true") // unpauses it
	again, _ := cpuOver(2*time.Second, "running")
	t.Logf("after the unpause: %v in 2 s", again)
	if again < 100*time.Millisecond {
		t.Fatalf("after the unpause the spinning process used %v of CPU in 2 s", again)
	}
	if len(hostProcs(sb.ID)) == 0 {
		t.Fatal("no host process names the running sandbox: the check after its hibernate would prove nothing")
	}
	hibernate(t, c, sb.ID)
	if _, err := c.SandboxMetrics(ctx, sb.ID); !client.IsConflict(err) {
		t.Errorf("metrics of a hibernated sandbox: %v, want 409", err)
	}
	srv.Manager.Wait()
	if procs := hostProcs(sb.ID); len(procs) > 0 {
		t.Errorf("host processes of a hibernated sandbox: %v", procs)
	}
	if _, err := c.SandboxMetrics(ctx, "sb-nonexistent"); !client.IsNotFound(err) {
		t.Errorf("metrics of an unknown sandbox: %v, want 404", err)
	}
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, srv, sb.ID)
}

// TestPauseWaitsForRequests: a pause waits for a proxied request in flight
// (which would otherwise hang in the paused sandbox until the next request)
// and pauses once it has been answered; a request that outlasts the drain
// makes the pause refuse (409) and leaves the sandbox running.
func TestPauseWaitsForRequests(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: lcInt(0)})
	server := `import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(float(self.path.strip("/")))
        self.send_response(200); self.end_headers(); self.wfile.write(b"slept")
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
`
	writeFile(t, c, sb.ID, "/root/slow.py", []byte(server))
	if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"python3", "/root/slow.py"}}); err != nil {
		t.Fatal(err)
	}
	slow := func(seconds string) <-chan error {
		done := make(chan error, 1)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.PortURL(sb.ID, 8000, "/"+seconds), nil)
			c.Authorize(req)
			resp, err := c.HTTP.Do(req)
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || string(b) != "slept" {
					err = fmt.Errorf("HTTP %d %q", resp.StatusCode, b)
				}
			}
			done <- err
		}()
		return done
	}
	deadline := time.Now().Add(30 * time.Second)
	for <-slow("0") != nil {
		if time.Now().After(deadline) {
			t.Fatal("the slow server did not answer")
		}
		time.Sleep(100 * time.Millisecond)
	}

	// A request of 2 s in flight: the pause answers after it.
	inFlight := slow("2")
	time.Sleep(300 * time.Millisecond)
	t0 := time.Now()
	p := pause(t, c, sb.ID)
	select {
	case err := <-inFlight:
		if err != nil {
			t.Fatalf("the request in flight during the pause: %v", err)
		}
	default:
		t.Fatalf("the pause answered (state %s) after %v with the request still in flight", p.State, time.Since(t0))
	}
	t.Logf("pause answered %v after it was called, once the request in flight was answered", time.Since(t0))
	sh(t, c, sb.ID, "true") // unpauses it

	// A request longer than the drain: the pause is refused, the sandbox runs.
	long := slow(fmt.Sprint(manager.PauseDrain.Seconds() + 5))
	time.Sleep(300 * time.Millisecond)
	if _, err := c.Pause(ctx, sb.ID); !client.IsConflict(err) {
		t.Fatalf("pause with a request open past the drain: %v, want 409", err)
	}
	wantState(t, c, sb.ID, apiv1.StateRunning)
	if err := <-long; err != nil {
		t.Fatalf("the long request: %v", err)
	}
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}
