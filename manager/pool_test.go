package manager_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// runPools runs h's pool refill loop until the test ends.
func (h *host) runPools() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.m.RunPools(ctx)
	}()
	h.t.Cleanup(func() { cancel(); <-done })
}

// waitReady waits until the pool of kind and name has n clones ready.
func (h *host) waitReady(kind, name string, n int) {
	h.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for h.m.PoolReady(kind, name) != n {
		if time.Now().After(deadline) {
			p, _ := h.m.GetPool(context.Background(), kind, name)
			h.t.Fatalf("pool %s %s: %d ready, want %d (%+v)", kind, name, h.m.PoolReady(kind, name), n, p)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// instances is the number of instances the fake engine runs.
func (h *host) instances() int {
	infos, _ := h.eng.List(context.Background())
	return len(infos)
}

// running reports whether the fake engine runs instance id.
func (h *host) running(id string) bool {
	infos, _ := h.eng.List(context.Background())
	for _, i := range infos {
		if i.ID == id && i.Running {
			return true
		}
	}
	return false
}

// TestPoolImageCreate: a create of an image with a pool takes a ready clone
// (no start, no restore), told it is forked with a new generation; clones are
// not listed until taken; the pool refills; two concurrent creates get
// different clones; a create with another spec starts as without a pool.
func TestPoolImageCreate(t *testing.T) {
	h := newHost(t, hostOpts{})
	h.runPools()
	ctx := context.Background()
	if _, err := h.m.SetImagePool(ctx, "tiny", manager.MaxPoolSize+1); err == nil {
		t.Fatal("a pool size over the maximum was accepted")
	}
	if _, err := h.m.SetImagePool(ctx, "no-such-image", 1); err == nil {
		t.Fatal("a pool of an unknown image was accepted")
	}
	if _, err := h.m.SetImagePool(ctx, "tiny", 2); err != nil {
		t.Fatal(err)
	}
	h.waitReady("image", "tiny", 2)
	if all, _ := h.m.List(ctx); len(all) != 0 {
		t.Fatalf("ready clones listed: %+v", all)
	}
	starts, restores := h.eng.Calls(fake.Start), h.eng.Calls(fake.Restore)
	var wg sync.WaitGroup
	got := make([]sandbox.Sandbox, 2)
	errs := make([]error, 2)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = h.m.Create(ctx, sandbox.Spec{Image: "tiny"})
		}()
	}
	wg.Wait()
	insts := map[string]bool{}
	for i, sb := range got {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		rec := h.record(sb.ID)
		if sb.State != sandbox.StateRunning || sb.LastResume == nil || !sb.LastResume.Forked || !sb.LastResume.OK || sb.LastResume.Generation != sb.Generation {
			t.Fatalf("pooled create %d: state %s, last resume %+v; want running, told forked at generation %d", i, sb.State, sb.LastResume, sb.Generation)
		}
		if h.eng.Paused(rec.Instance) {
			t.Fatalf("pooled create %d: its instance is paused", i)
		}
		insts[rec.Instance] = true
	}
	if len(insts) != 2 || got[0].Generation == got[1].Generation {
		t.Fatalf("two creates got instances %v, generations %d %d: want two clones", insts, got[0].Generation, got[1].Generation)
	}
	if n := h.eng.Calls(fake.Start); n != starts {
		t.Fatalf("pooled creates started %d instances", n-starts)
	}
	if h.eng.Calls(fake.Restore) != restores {
		// The refill may already have restored: the creates themselves
		// must not have, which the instances show.
		for id := range insts {
			if !h.running(id) {
				t.Fatalf("instance %s of a pooled create does not run", id)
			}
		}
	}
	h.writeFile(got[0].ID, "/x", "1")
	if h.readFile(got[0].ID, "/x") != "1" {
		t.Fatal("file round trip in a pooled create")
	}
	h.waitReady("image", "tiny", 2)
	if all, _ := h.m.List(ctx); len(all) != 2 {
		t.Fatalf("after the refill %d sandboxes listed, want 2", len(all))
	}
	// Another spec: started as without a pool.
	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", Env: map[string]string{"A": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.LastResume == nil || sb.LastResume.Event != "start" || h.m.PoolReady("image", "tiny") != 2 {
		t.Fatalf("create with env: last resume %+v, %d ready; want a start and the pool untouched", sb.LastResume, h.m.PoolReady("image", "tiny"))
	}
	// Size 0 ends the pool: its clones are stopped, creates start.
	before := h.instances()
	if _, err := h.m.SetImagePool(ctx, "tiny", 0); err != nil {
		t.Fatal(err)
	}
	if n := h.instances(); n != before-2 || h.m.PoolReady("image", "tiny") != 0 {
		t.Fatalf("after size 0: %d instances (had %d), %d ready", n, before, h.m.PoolReady("image", "tiny"))
	}
	if pools, _ := h.m.ListPools(ctx); len(pools) != 0 {
		t.Fatalf("pools after size 0: %+v", pools)
	}
	sb, err = h.m.Create(ctx, sandbox.Spec{Image: "tiny"})
	if err != nil || sb.LastResume == nil || sb.LastResume.Event != "start" {
		t.Fatalf("create without a pool: %+v %v", sb.LastResume, err)
	}
}

// TestPoolSnapshotFork: a fork of a sandbox hibernated on a template snapshot
// takes ready clones (a fork of more than the pool has restores the rest);
// the template snapshot is not deleted while its pool exists.
func TestPoolSnapshotFork(t *testing.T) {
	h := newHost(t, hostOpts{})
	h.runPools()
	ctx := context.Background()
	src := h.create()
	h.writeFile(src.ID, "/state", "from the source")
	hib, err := h.m.Hibernate(ctx, src.ID, manager.HibernateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	snap := hib.Snapshot.ID
	if _, err := h.m.SetSnapshotPool(ctx, snap, 1); err != nil {
		t.Fatal(err)
	}
	h.waitReady("snapshot", snap, 1)
	if err := h.m.DeleteSnapshot(ctx, snap); err == nil {
		t.Fatal("the template snapshot of a pool was deleted")
	}
	restores := h.eng.Calls(fake.Restore)
	clones, err := h.m.Fork(ctx, src.ID, 2)
	if err != nil {
		t.Fatal(err)
	}
	if n := h.eng.Calls(fake.Restore) - restores; n < 1 || n > 2 {
		t.Fatalf("a fork of 2 with 1 ready clone restored %d times, want 1 (+1 refill)", n)
	}
	for _, c := range clones {
		if c.ForkedFrom != src.ID || c.LastResume == nil || !c.LastResume.Forked || c.Generation == src.Generation {
			t.Fatalf("clone %+v: want forked from %s, told forked, own generation", c, src.ID)
		}
		if got := h.readFile(c.ID, "/state"); got != "from the source" {
			t.Fatalf("clone's file: %q", got)
		}
	}
	if clones[0].Generation == clones[1].Generation {
		t.Fatal("clones share a generation")
	}
	h.waitReady("snapshot", snap, 1)
	// The source resumes, hibernates again: its old snapshot stays (the pool's).
	if _, err := h.m.Resume(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Hibernate(ctx, src.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.GetSnapshot(ctx, snap); err != nil {
		t.Fatalf("template snapshot after its sandbox hibernated again: %v", err)
	}
}

// TestPoolCrash: a crashed server's ready clones are stopped by the next
// start (no record owns them) and the pool refills.
func TestPoolCrash(t *testing.T) {
	h := newHost(t, hostOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.m.RunPools(ctx) }()
	if _, err := h.m.SetImagePool(context.Background(), "tiny", 2); err != nil {
		t.Fatal(err)
	}
	h.waitReady("image", "tiny", 2)
	old := map[string]bool{}
	infos, _ := h.eng.List(context.Background())
	for _, i := range infos {
		old[i.ID] = true
	}
	if len(old) != 2 {
		t.Fatalf("%d instances with a full pool of 2", len(old))
	}
	h.crash() // the instances keep running
	// The crashed server's loop ends only after the restart (a graceful
	// stop would stop its clones itself).
	t.Cleanup(func() { cancel(); <-done })
	h2 := newHost(t, hostOpts{dir: h.dir, eng: h.eng})
	for id := range old {
		if h2.running(id) {
			t.Fatalf("instance %s of a ready clone runs after the restart's reconcile", id)
		}
	}
	h2.runPools()
	h2.waitReady("image", "tiny", 2)
	if all, _ := h2.m.List(context.Background()); len(all) != 0 {
		t.Fatalf("sandboxes after the restart: %+v", all)
	}
}

// TestPoolStandbyBudget: ready clones count against the standby budget with
// the paused sandboxes: a pool fills only as far as the budget allows, and
// when a paused sandbox needs the room a ready clone is stopped (the paused
// sandbox is not demoted).
func TestPoolStandbyBudget(t *testing.T) {
	budget := 2*manager.DefaultMemoryMiB + 32 // two clones, then 32 MiB to spare
	h := newHost(t, hostOpts{lifecycle: manager.LifecycleConfig{StandbyMemoryMiB: budget, CheckInterval: 20 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.m.RunLifecycle(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	h.runPools()
	sb := h.create() // 64 MiB, before the pool: never idle long enough to pause by itself here
	if _, err := h.m.SetImagePool(context.Background(), "tiny", 3); err != nil {
		t.Fatal(err)
	}
	h.waitReady("image", "tiny", 2)
	time.Sleep(200 * time.Millisecond)
	if n := h.m.PoolReady("image", "tiny"); n != 2 {
		t.Fatalf("%d clones ready with a budget for 2", n)
	}
	h.pause(sb.ID)
	h.waitReady("image", "tiny", 1)
	time.Sleep(200 * time.Millisecond)
	if rec := h.record(sb.ID); rec.State != sandbox.StatePaused {
		t.Fatalf("the paused sandbox is %s: demoted instead of a ready clone", rec.State)
	}
	if n := h.m.PoolReady("image", "tiny"); n != 1 {
		t.Fatalf("%d clones ready with a paused sandbox in the budget, want 1", n)
	}
	if p, _ := h.m.GetPool(context.Background(), "image", "tiny"); p.Size != 3 || p.Ready != 1 {
		t.Fatalf("pool %+v", p)
	}
}

// TestPoolKeptSnapshotStart: a start from a kept snapshot with a pool (E2B's
// create from a snapshot template) takes a ready clone: not restored, told
// forked, the snapshot's state; a start with other env is restored.
func TestPoolKeptSnapshotStart(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	h.runPools()
	src := h.create()
	h.writeFile(src.ID, "/state", "kept")
	kept, err := h.m.KeepSnapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.m.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.SetSnapshotPool(ctx, kept.ID, 1); err != nil {
		t.Fatal(err)
	}
	h.waitReady("snapshot", kept.ID, 1)
	restores := h.eng.Calls(fake.Restore)
	sb, err := h.m.StartFromSnapshot(ctx, kept.ID, sandbox.Spec{Metadata: map[string]string{"k": "v"}})
	if err != nil {
		t.Fatal(err)
	}
	if h.eng.Calls(fake.Restore) != restores {
		t.Fatal("a start from a pooled snapshot restored")
	}
	if sb.LastResume == nil || !sb.LastResume.Forked || sb.Metadata["k"] != "v" || h.readFile(sb.ID, "/state") != "kept" {
		t.Fatalf("pooled start: %+v", sb)
	}
	other, err := h.m.StartFromSnapshot(ctx, kept.ID, sandbox.Spec{Env: map[string]string{"X": "1"}})
	if err != nil || other.LastResume == nil || !other.LastResume.Forked {
		t.Fatalf("start with env: %+v %v", other, err)
	}
	if inst := h.record(other.ID).Instance; !strings.HasPrefix(inst, other.ID+"-") {
		t.Fatalf("a start with another env runs on %s: a ready clone, not its own restore", inst)
	}
	if inst := h.record(sb.ID).Instance; strings.HasPrefix(inst, sb.ID+"-") {
		t.Fatalf("the pooled start runs on %s, its own restore", inst)
	}
}
