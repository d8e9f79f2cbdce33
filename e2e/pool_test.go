package e2e

// Warm pools (docs/lifecycle.md#warm-pools) in real sandboxes: a create of
// a pooled image and a fork of a sandbox hibernated on a template snapshot
// take restored-and-paused clones, which are clones in every sense of the
// resume contract; concurrent creates never share one; size 0 is as without
// pools; a kill -9 of the server with a full pool leaves nothing behind the
// restart and the pool refills.

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
)

// waitPool waits until the pool of template kind and name has ready clones
// ready and returns it.
func waitPool(t *testing.T, c *client.Client, kind, name string, ready int) apiv1.Pool {
	t.Helper()
	deadline := time.Now().Add(4 * time.Minute)
	var last apiv1.Pool
	for {
		pools, err := c.ListPools(ctxFor(t, time.Minute))
		if err != nil {
			t.Fatalf("list pools: %v", err)
		}
		last = apiv1.Pool{}
		for _, p := range pools {
			if p.Template == kind && p.Name == name {
				last = p
			}
		}
		if last.Ready == ready {
			return last
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s %s: %+v, want %d ready", kind, name, last, ready)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// endPools sets every pool of c's server to size 0 when the test ends
// (before the server stops: the shared data directory's next server would
// fill a pool left behind).
func endPools(t *testing.T, c *client.Client) {
	t.Cleanup(func() {
		ctx := context.Background()
		pools, _ := c.ListPools(ctx)
		for _, p := range pools {
			var err error
			if p.Template == "image" {
				_, err = c.SetImagePool(ctx, p.Name, 0)
			} else {
				_, err = c.SetSnapshotPool(ctx, p.Name, 0)
			}
			if err != nil {
				t.Logf("cleanup: pool %s %s: %v", p.Template, p.Name, err)
			}
		}
	})
}

// runscInstances returns the engine instances of the shared data directory
// that have runsc processes on the host.
func runscInstances() map[string]bool {
	out := map[string]bool{}
	for _, p := range hostProcs(filepath.Join(dataDir, "gvisor", "root")) {
		if !strings.Contains(p, "runsc") {
			continue
		}
		for _, f := range strings.Fields(p) {
			if m := instanceRE.FindStringSubmatch(filepath.Base(f)); m != nil && m[0] == filepath.Base(f) {
				out[m[0]] = true
			}
		}
	}
	return out
}

// keys returns m's keys, sorted.
func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// TestPoolCreate: a create of an image with a pool of 2 takes a ready clone
// (no sandbox is listed before); its first exec answers; it is a clone in
// the resume contract's sense (told forked, its own generation in
// /run/torpor/generation, reseeded: different random draws); two concurrent
// creates get two different clones; the pool refills after being drained;
// size 0 gives creates as without a pool and stops the ready clones.
func TestPoolCreate(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	endPools(t, c)
	ctx := ctxFor(t, 10*time.Minute)
	if _, err := c.SetImagePool(ctx, "base", 17); err == nil || !strings.Contains(err.Error(), "size 17") {
		t.Fatalf("size 17: %v, want invalid_argument", err)
	}
	if _, err := c.SetImagePool(ctx, "no-such-image", 1); err == nil {
		t.Fatal("a pool of an unknown image was set")
	}
	before := runscInstances()
	t0 := time.Now()
	p, err := c.SetImagePool(ctx, "base", 2)
	if err != nil || p.Size != 2 || p.Template != "image" || p.Name != "base" {
		t.Fatalf("set pool: %+v %v", p, err)
	}
	p = waitPool(t, c, "image", "base", 2)
	t.Logf("pool of 2 ready in %v (template snapshot %s, %d MiB each)", time.Since(t0).Round(time.Millisecond), p.SnapshotID, p.MemoryMiB)
	if all, err := c.ListSandboxes(ctx); err != nil || len(all) != 0 {
		t.Fatalf("sandboxes listed with a full pool: %+v %v", all, err)
	}
	pooled := map[string]bool{}
	for id := range runscInstances() {
		if !before[id] {
			pooled[id] = true
		}
	}
	if len(pooled) != 2 {
		t.Fatalf("runsc instances of a pool of 2: %v", keys(pooled))
	}

	// Two creates at once: two clones, each answering its first exec.
	var wg sync.WaitGroup
	sbs := make([]apiv1.Sandbox, 2)
	lat := make([]time.Duration, 2)
	errs := make([]error, 2)
	for i := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			if sbs[i], errs[i] = c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{}); errs[i] != nil {
				return
			}
			_, _, code, err := c.ExecCollect(ctx, sbs[i].ID, apiv1.ExecRequest{Cmd: []string{"true"}})
			if err == nil && code != 0 {
				err = os.ErrInvalid
			}
			errs[i], lat[i] = err, time.Since(t0)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("pooled create %d: %v", i, err)
		}
	}
	t.Logf("two concurrent pooled creates -> first exec: %v, %v", lat[0].Round(time.Microsecond), lat[1].Round(time.Microsecond))
	a, b := sbs[0], sbs[1]
	if a.ID == b.ID || a.Generation == b.Generation {
		t.Fatalf("two creates: %s gen %d, %s gen %d", a.ID, a.Generation, b.ID, b.Generation)
	}
	if n := metric(t, srv, "torpor_pool_clones_taken_total"); n != 2 {
		t.Errorf("torpor_pool_clones_taken_total %v after two pooled creates, want 2", n)
	}
	draws := map[string]bool{}
	for _, sb := range sbs {
		wantContract(t, sb, "resume", true)
		if sb.ForkedFrom != "" || sb.Image != "base" || sb.State != apiv1.StateRunning {
			t.Errorf("pooled create %s: forked_from %q image %q state %s", sb.ID, sb.ForkedFrom, sb.Image, sb.State)
		}
		if g := genFile(t, c, sb.ID); g != sb.Generation {
			t.Errorf("%s: /run/torpor/generation %d, API generation %d", sb.ID, g, sb.Generation)
		}
		draws[sh(t, c, sb.ID, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; python3 -c 'import random; print(random.getrandbits(64))'")] = true
		if _, _, _, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"true"}}); err != nil {
			t.Fatal(err)
		}
	}
	if len(draws) != 2 {
		t.Errorf("two pooled creates drew the same random values: %v", keys(draws))
	}
	now := runscInstances()
	for id := range pooled {
		if !now[id] {
			t.Errorf("ready clone instance %s was not taken (it no longer runs)", id)
		}
	}
	// Drained: it refills to 2 while the two sandboxes run.
	waitPool(t, c, "image", "base", 2)
	if n := len(runscInstances()) - len(before); n != 4 {
		t.Errorf("%d runsc instances with 2 sandboxes and a full pool of 2, want 4", n)
	}
	// Files and hibernate/resume of a pooled sandbox work as any other's.
	writeFile(t, c, a.ID, "/root/x", []byte("pooled\n"))
	hibernate(t, c, a.ID)
	r := resumeSandbox(t, c, a.ID)
	wantContract(t, r, "resume", false) // from its own snapshot now
	if got := string(readFile(t, c, a.ID, "/root/x")); got != "pooled\n" {
		t.Errorf("file after hibernate/resume of a pooled sandbox: %q", got)
	}

	// A create with another spec does not take a clone.
	other := create(t, c, apiv1.CreateSandboxRequest{Env: map[string]string{"K": "v"}})
	wantContract(t, other, "start", false)
	if p := waitPool(t, c, "image", "base", 2); p.Ready != 2 {
		t.Fatal("unreachable")
	}

	// Size 0: the ready clones are stopped, creates start as without pools.
	inPool := map[string]bool{}
	for id := range runscInstances() {
		owned := false
		for _, sb := range []apiv1.Sandbox{a, b, other} {
			owned = owned || strings.HasPrefix(id, sb.ID+"-")
		}
		if !before[id] && !owned && !pooled[id] {
			inPool[id] = true
		}
	}
	if len(inPool) != 2 {
		t.Fatalf("ready clones before size 0: %v, want 2", keys(inPool))
	}
	if _, err := c.SetImagePool(ctx, "base", 0); err != nil {
		t.Fatal(err)
	}
	if pools, _ := c.ListPools(ctx); len(pools) != 0 {
		t.Errorf("pools after size 0: %+v", pools)
	}
	left := runscInstances()
	for id := range inPool {
		if left[id] {
			t.Errorf("ready clone %s still runs after size 0", id)
		}
		if ns := netnsOf(id[:strings.LastIndexByte(id, '-')]); len(ns) > 0 {
			t.Errorf("network namespaces of ready clone %s left: %v", id, ns)
		}
	}
	plain := create(t, c, apiv1.CreateSandboxRequest{})
	wantContract(t, plain, "start", false)
	for _, sb := range []apiv1.Sandbox{a, b, other, plain} {
		if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	srv.Manager.Wait()
	if n := len(runscInstances()) - len(before); n != 0 {
		t.Errorf("%d runsc instances left after deleting every sandbox with no pool: %v", n, keys(runscInstances()))
	}
}

// TestPoolFork: a fork of a sandbox hibernated on a template snapshot with a
// pool takes ready clones, and they are clones as a fork's are: each told
// forked with its own generation before its first request, its Go SDK
// program's registered random source reseeded (different draws), its
// fork-unsafe secret wiped and its pending intent set aside
// (e2e/testdata/goagent, as TestSDKGoInSandbox).
func TestPoolFork(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	endPools(t, c)
	ctx := ctxFor(t, 10*time.Minute)
	src := hzCreate(t, c)
	const port = 8103
	if st := hzStartGoAgent(t, c, src.ID, port); st.Secret != "s3cret" || len(st.Pending) != 1 {
		t.Fatalf("goagent initial state %+v", st)
	}
	hib := hzHibernate(t, c, src.ID)
	snap := hib.Snapshot.ID
	before := runscInstances()
	if _, err := c.SetSnapshotPool(ctx, snap, 2); err != nil {
		t.Fatal(err)
	}
	waitPool(t, c, "snapshot", snap, 2)
	var pooled []string
	for id := range runscInstances() {
		if !before[id] {
			pooled = append(pooled, id)
		}
	}
	if len(pooled) != 2 {
		t.Fatalf("runsc instances of a pool of 2: %v", pooled)
	}
	t0 := time.Now()
	clones, err := c.Fork(ctx, src.ID, 2)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	t.Logf("pooled fork of 2 answered in %v", time.Since(t0).Round(time.Microsecond))
	now := runscInstances()
	gens := map[int64]bool{src.Generation: true}
	for _, cl := range clones {
		wantContract(t, cl, "resume", true)
		if gens[cl.Generation] || cl.ForkedFrom != src.ID {
			t.Errorf("clone %s: generation %d (taken), forked_from %q", cl.ID, cl.Generation, cl.ForkedFrom)
		}
		gens[cl.Generation] = true
		if own, _, _ := instancesOf(t, srv, cl.ID); len(own) != 0 {
			t.Errorf("clone %s was restored (instances %v), not taken from the pool", cl.ID, own)
		}
	}
	hzCheckGoClones(t, c, clones, port)
	for _, id := range pooled {
		if !now[id] {
			t.Errorf("ready clone %s no longer runs after the fork: not taken", id)
		}
	}
	// The source resumes as before: not forked, its secret kept.
	resumed := hzResume(t, c, src.ID)
	rs, err := hzGoState(ctx, c, src.ID, port)
	if err != nil {
		t.Fatal(err)
	}
	if rs.HookForked || rs.Secret != "s3cret" || rs.HookGeneration != resumed.Generation {
		t.Errorf("source after resume: %+v", rs)
	}
	waitPool(t, c, "snapshot", snap, 2)
	// With the clones gone and the source hibernated again, nothing resumes
	// from the template snapshot; its pool keeps it.
	for _, cl := range clones {
		if err := c.DeleteSandbox(ctx, cl.ID); err != nil {
			t.Fatal(err)
		}
	}
	hzHibernate(t, c, src.ID)
	if err := c.DeleteSnapshot(ctx, snap); err == nil || !strings.Contains(err.Error(), "warm pool") {
		t.Fatalf("delete of a template snapshot: %v, want a conflict naming its pool", err)
	}
	if _, err := c.SetSnapshotPool(ctx, snap, 0); err != nil {
		t.Fatal(err)
	}
}

// TestPoolServerKill: kill -9 of the server with a full pool; the restart
// stops the old ready clones (no record owns them: nothing of them is left,
// no process, no network namespace), lists no sandbox, and refills the pool.
func TestPoolServerKill(t *testing.T) {
	// Without prepared containers, which a killed server leaves too (their
	// reconcile is TestPreparedCrash's): the pool's clones are then all the
	// instances there are, each under its own id.
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--prepared-containers", "0"}}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	before := runscInstances()
	p.start()
	defer p.stop()
	c := p.client()
	endPools(t, c)
	ctx := ctxFor(t, 10*time.Minute)
	if _, err := c.SetImagePool(ctx, "base", 2); err != nil {
		t.Fatal(err)
	}
	waitPool(t, c, "image", "base", 2)
	old := map[string]bool{}
	for id := range runscInstances() {
		if !before[id] {
			old[id] = true
		}
	}
	if len(old) != 2 {
		for id := range old {
			t.Logf("%s: %v", id, hostProcs(id))
		}
		t.Fatalf("runsc instances of a full pool of 2: %v", keys(old))
	}
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	p.waitKilled()
	if n := len(runscInstances()) - len(before); n != 2 {
		t.Fatalf("after kill -9: %d runsc instances, want the pool's 2 still running", n)
	}
	p.start()
	pool := waitPool(t, c, "image", "base", 2)
	if all, err := c.ListSandboxes(ctx); err != nil || len(all) != 0 {
		t.Fatalf("sandboxes after the restart: %+v %v", all, err)
	}
	after := runscInstances()
	fresh := 0
	for id := range after {
		if before[id] {
			continue
		}
		if old[id] {
			t.Errorf("ready clone %s of the killed server still runs", id)
			continue
		}
		fresh++
	}
	if fresh != 2 {
		t.Errorf("after the restart %d new runsc instances, want the refilled pool's 2: %v", fresh, keys(after))
	}
	for id := range old {
		if ns := netnsOf(id[:strings.LastIndexByte(id, '-')]); len(ns) > 0 {
			t.Errorf("network namespaces of the old ready clone %s left: %v", id, ns)
		}
		if procs := hostProcs(id); len(procs) > 0 {
			t.Errorf("processes of the old ready clone %s left: %v", id, procs)
		}
	}
	t.Logf("after kill -9 and restart: pool %+v", pool)
	// The refilled pool serves a create.
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	wantContract(t, sb, "resume", true)
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SetImagePool(ctx, "base", 0); err != nil {
		t.Fatal(err)
	}
	p.stop()
	deadline := time.Now().Add(30 * time.Second)
	for len(runscInstances()) > len(before) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if n := len(runscInstances()) - len(before); n != 0 {
		t.Errorf("%d runsc instances left after the pool ended and the server stopped", n)
	}
}
