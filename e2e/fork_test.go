package e2e

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestFork forks a running sandbox into two clones and checks that the clones run
// at once, are isolated from each other and from the source, carry their own
// generation and forked_from, continue the workload's counter from the snapshot's
// value independently, and that the source keeps running.
func TestFork(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	src := create(t, c, apiv1.CreateSandboxRequest{Env: map[string]string{"FORK_TEST": "1"}})
	if err := workload.Start(ctx, c, src.ID, 16); err != nil {
		t.Fatal(err)
	}
	const path = "/root/shared.txt"
	writeFile(t, c, src.ID, path, []byte("before fork\n"))
	before, err := workload.Get(ctx, c, src.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	srcInstances, _, srcPids := instancesOf(t, srv, src.ID)

	t0 := time.Now()
	clones, err := c.Fork(ctx, src.ID, 2)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	t.Logf("fork of a running sandbox into 2 clones took %v", time.Since(t0).Round(time.Millisecond))
	if len(clones) != 2 {
		t.Fatalf("fork answered %d sandboxes, want 2", len(clones))
	}
	a, b := clones[0], clones[1]
	srcNow := wantState(t, c, src.ID, apiv1.StateRunning)
	gens := map[int64]string{srcNow.Generation: src.ID}
	for _, cl := range clones {
		if cl.ID == src.ID || cl.ForkedFrom != src.ID {
			t.Errorf("clone %s: forked_from %q, want %q", cl.ID, cl.ForkedFrom, src.ID)
		}
		if cl.State != apiv1.StateRunning {
			t.Errorf("clone %s is %q, want running", cl.ID, cl.State)
		}
		if other, dup := gens[cl.Generation]; dup {
			t.Errorf("clone %s has generation %d, the same as %s", cl.ID, cl.Generation, other)
		}
		gens[cl.Generation] = cl.ID
		if cl.Env["FORK_TEST"] != "1" {
			t.Errorf("clone %s env %v, want the source's", cl.ID, cl.Env)
		}
		if r, _, _ := instancesOf(t, srv, cl.ID); len(r) != 1 {
			t.Errorf("clone %s: engine runs %v, want one instance", cl.ID, r)
		}
	}
	if a.ID == b.ID {
		t.Fatalf("both clones have id %s", a.ID)
	}
	if t.Failed() {
		t.FailNow()
	}

	// The source kept running: the same process, the same engine instance, and its
	// counter goes on from where it was.
	if r, _, pids := instancesOf(t, srv, src.ID); fmt.Sprint(r, pids) != fmt.Sprint(srcInstances, srcPids) {
		t.Errorf("source instances %v %v after fork, want %v %v (still the same)", r, pids, srcInstances, srcPids)
	}
	st, err := workload.Get(ctx, c, src.ID, "/count")
	if err != nil {
		t.Fatalf("source after fork: %v", err)
	}
	if st.Count != before.Count+1 || st.Pid != before.Pid {
		t.Errorf("source after fork: count %d pid %d, want count %d pid %d", st.Count, st.Pid, before.Count+1, before.Pid)
	}

	// Both clones at once: each continues from the snapshot's counter.
	type res struct {
		st  workload.State
		err error
	}
	results := make([]res, 2)
	var wg sync.WaitGroup
	for i, cl := range clones {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := workload.Get(ctx, c, cl.ID, "/checksum")
			results[i] = res{st, err}
		}()
	}
	wg.Wait()
	for i, r := range results {
		if r.err != nil {
			t.Fatalf("clone %s: %v", clones[i].ID, r.err)
		}
		if r.st.Count != before.Count+1 {
			t.Errorf("clone %s: first count %d, want %d (the snapshot's value + 1)", clones[i].ID, r.st.Count, before.Count+1)
		}
		if r.st.SHA256 != before.SHA256 {
			t.Errorf("clone %s: data checksum %s, want %s", clones[i].ID, r.st.SHA256, before.SHA256)
		}
	}
	// Independent counters: three more requests to A, none to B, then B.
	for i := 2; i <= 4; i++ {
		st, err := workload.Get(ctx, c, a.ID, "/count")
		if err != nil {
			t.Fatal(err)
		}
		if st.Count != before.Count+int64(i) {
			t.Errorf("clone %s: count %d, want %d", a.ID, st.Count, before.Count+int64(i))
		}
	}
	if st, err := workload.Get(ctx, c, b.ID, "/count"); err != nil {
		t.Fatal(err)
	} else if st.Count != before.Count+2 {
		t.Errorf("clone %s: count %d after 3 requests to the other clone, want %d", b.ID, st.Count, before.Count+2)
	}
	if st, err := workload.Get(ctx, c, src.ID, "/count"); err != nil {
		t.Fatal(err)
	} else if st.Count != before.Count+2 {
		t.Errorf("source: count %d after requests to its clones, want %d", st.Count, before.Count+2)
	}

	// Files: every clone sees the state at the fork, then only its own writes.
	for _, cl := range clones {
		if got := string(readFile(t, c, cl.ID, path)); got != "before fork\n" {
			t.Errorf("clone %s: %s is %q, want the content at the fork", cl.ID, path, got)
		}
	}
	all := []string{src.ID, a.ID, b.ID}
	for _, id := range all {
		writeFile(t, c, id, path, []byte("written in "+id+"\n"))
	}
	sh(t, c, a.ID, "echo only-in-a > /root/only-a.txt")
	for _, id := range all {
		want := "written in " + id + "\n"
		if got := string(readFile(t, c, id, path)); got != want {
			t.Errorf("%s: files API reads %q, want %q", id, got, want)
		}
		if got := sh(t, c, id, "cat "+path); got != want {
			t.Errorf("%s: cat reads %q, want %q", id, got, want)
		}
		out, _, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"cat", "/root/only-a.txt"}})
		if id == a.ID && (code != 0 || out != "only-in-a\n") {
			t.Errorf("%s: its own new file reads %q (exit %d)", id, out, code)
		}
		if id != a.ID && code == 0 {
			t.Errorf("%s sees /root/only-a.txt, written only in clone %s: %q", id, a.ID, out)
		}
	}

	// The clones' and the source's processes are distinct host processes.
	_, _, pa := instancesOf(t, srv, a.ID)
	_, _, pb := instancesOf(t, srv, b.ID)
	_, _, ps := instancesOf(t, srv, src.ID)
	if len(pa) != 1 || len(pb) != 1 || len(ps) != 1 || pa[0] == pb[0] || pa[0] == ps[0] || pb[0] == ps[0] {
		t.Errorf("sandbox pids: source %v, clones %v %v; want three distinct", ps, pa, pb)
	}

	// Deleting one clone leaves the other and the source untouched.
	if err := c.DeleteSandbox(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, srv, a.ID)
	for _, id := range []string{src.ID, b.ID} {
		if got := sh(t, c, id, "cat "+path); !strings.Contains(got, id) {
			t.Errorf("%s after deleting clone %s: %q", id, a.ID, got)
		}
	}
}

// TestForkWaitFirst forks a running sandbox into three clones with wait
// "first": the call answers once the first clone runs, the others may still
// be starting (state creating); a request to each of them waits for its
// start and then continues the workload's counter from the snapshot's value
// with the data intact; every clone has its own generation; the source can
// be hibernated and resumed while the others start, and a clone still
// starting can be deleted.
func TestForkWaitFirst(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	src := create(t, c, apiv1.CreateSandboxRequest{})
	if err := workload.Start(ctx, c, src.ID, 16); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c, src.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ForkWith(ctx, src.ID, apiv1.ForkRequest{Count: 2, Wait: "some"}); err == nil || !strings.Contains(err.Error(), `wait "some"`) {
		t.Fatalf("fork with wait \"some\": %v, want an invalid_argument naming it", err)
	}
	clones, err := c.ForkWith(ctx, src.ID, apiv1.ForkRequest{Count: 3, Wait: apiv1.ForkWaitFirst})
	if err != nil {
		t.Fatalf("fork wait first: %v", err)
	}
	if len(clones) != 3 {
		t.Fatalf("fork answered %d sandboxes, want 3", len(clones))
	}
	if clones[0].State != apiv1.StateRunning {
		t.Errorf("first clone %s is %q in the answer, want running", clones[0].ID, clones[0].State)
	}
	gens := map[int64]string{}
	for _, cl := range clones {
		t.Logf("clone %s in the answer: %s", cl.ID, cl.State)
		if cl.ForkedFrom != src.ID {
			t.Errorf("clone %s: forked_from %q, want %q", cl.ID, cl.ForkedFrom, src.ID)
		}
		if cl.State != apiv1.StateRunning && cl.State != apiv1.StateCreating {
			t.Errorf("clone %s is %q in the answer, want running or creating", cl.ID, cl.State)
		}
		if other, dup := gens[cl.Generation]; dup || cl.Generation == 0 {
			t.Errorf("clone %s has generation %d (as %q)", cl.ID, cl.Generation, other)
		}
		gens[cl.Generation] = cl.ID
	}
	// The source is free at once: a hibernate and a resume of it while its
	// clones may still start.
	if _, err := c.Hibernate(ctx, src.ID); err != nil {
		t.Fatalf("hibernate the source after the fork answered: %v", err)
	}
	// Requests to the clones, at once: each waits for its clone's start.
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, cl := range clones[:2] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := workload.Get(ctx, c, cl.ID, "/checksum")
			if err == nil && (st.Count != before.Count+1 || st.SHA256 != before.SHA256) {
				err = fmt.Errorf("count %d checksum %s, want %d %s (the snapshot's)", st.Count, st.SHA256, before.Count+1, before.SHA256)
			}
			errs[i] = err
		}()
	}
	// The third clone is deleted, whether it has started or not.
	if err := c.DeleteSandbox(ctx, clones[2].ID); err != nil {
		t.Errorf("delete clone %s: %v", clones[2].ID, err)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("clone %s: %v", clones[i].ID, err)
		}
	}
	assertGone(t, srv, clones[2].ID)
	for _, cl := range clones[:2] {
		wantState(t, c, cl.ID, apiv1.StateRunning)
	}
	if st, err := workload.Get(ctx, c, src.ID, "/count"); err != nil {
		t.Fatalf("source after resume: %v", err)
	} else if st.Count != before.Count+1 {
		t.Errorf("source: count %d after the fork and a hibernate, want %d", st.Count, before.Count+1)
	}
}
