package manager_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// TestOwnership: two nodes on one database. A sandbox is its creator's;
// hibernated it is nobody's; the node that resumes it owns it, and the
// other node's calls are told whose it is. Fenced off a lost owner it is
// in state error (its state_changed_at the fence's) with no owner, the lost node's writes fail with
// metadata.ErrFenced, and the other node resumes it from its snapshot.
func TestOwnership(t *testing.T) {
	ctx := context.Background()
	a := newHost(t, hostOpts{node: "node-a"})
	b := newHost(t, hostOpts{node: "node-b", peer: a})
	sb := a.create()
	if sb.Node != "node-a" || a.record(sb.ID).LeaseToken != 1 {
		t.Fatalf("created: node %q token %d", sb.Node, a.record(sb.ID).LeaseToken)
	}
	a.writeFile(sb.ID, "/tmp/f", "before")
	if _, _, err := b.m.ReadFile(ctx, sb.ID, "/tmp/f"); manager.OwnerOf(err) != "node-a" || sandbox.KindOf(err) != sandbox.Conflict {
		t.Fatalf("read through the other node: %v, want owned by node-a", err)
	}
	if _, err := b.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); manager.OwnerOf(err) != "node-a" {
		t.Fatalf("hibernate through the other node: %v", err)
	}
	hib, err := a.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{})
	if err != nil || hib.Node != "" {
		t.Fatalf("hibernate: %v, node %q", err, hib.Node)
	}
	if r := a.record(sb.ID); r.Owner != "" || r.SnapshotNode != "node-a" {
		t.Fatalf("hibernated record: owner %q snapshot node %q", r.Owner, r.SnapshotNode)
	}
	res, err := b.m.Resume(ctx, sb.ID)
	if err != nil || res.Node != "node-b" || res.State != sandbox.StateRunning {
		t.Fatalf("resume on node-b: %v, %+v", err, res)
	}
	if got := b.readFile(sb.ID, "/tmp/f"); got != "before" {
		t.Errorf("file after the move: %q", got)
	}
	if _, err := a.m.Exec(ctx, sb.ID, sandbox.ExecRequest{Cmd: []string{"true"}}); manager.OwnerOf(err) != "node-b" {
		t.Fatalf("exec on the old node: %v, want owned by node-b", err)
	}
	token := a.record(sb.ID).LeaseToken

	// node-b is lost: node-a fences it.
	stale := b.record(sb.ID)
	ok, err := a.m.Fence(ctx, sb.ID, "node-b", "node node-b lost")
	if err != nil || !ok {
		t.Fatalf("fence: %v %v", ok, err)
	}
	r := a.record(sb.ID)
	if !r.StateChangedAt.After(stale.StateChangedAt) {
		t.Errorf("fenced record: state_changed_at %v, not after the resume's %v", r.StateChangedAt, stale.StateChangedAt)
	}
	if r.State != sandbox.StateError || r.Owner != "" || r.LeaseToken != token+1 || !strings.Contains(r.Error, "node node-b lost") ||
		!strings.Contains(r.Error, hib.Snapshot.ID) {
		t.Fatalf("fenced record: state %s owner %q token %d (was %d) error %q", r.State, r.Owner, r.LeaseToken, token, r.Error)
	}
	if again, err := b.m.Fence(ctx, sb.ID, "node-b", "x"); again || err != nil {
		t.Errorf("a second fence: %v %v, want nothing done", again, err)
	}
	stale.Version = r.Version
	stale.State = sandbox.StateHibernated
	if err := a.db.UpdateSandbox(ctx, stale); !errors.Is(err, metadata.ErrFenced) {
		t.Fatalf("the lost node's write: %v, want ErrFenced", err)
	}
	back, err := a.m.Resume(ctx, sb.ID)
	if err != nil || back.Node != "node-a" || back.State != sandbox.StateRunning {
		t.Fatalf("resume of the fenced sandbox on node-a: %v %+v", err, back)
	}
	if got := a.readFile(sb.ID, "/tmp/f"); got != "before" {
		t.Errorf("file after resume from the last snapshot: %q", got)
	}
}

// TestConcurrentResumeTwoNodes: two nodes resume one hibernated sandbox at
// once: exactly one resumes it, the other is told it is the winner's.
func TestConcurrentResumeTwoNodes(t *testing.T) {
	ctx := context.Background()
	a := newHost(t, hostOpts{node: "node-a"})
	b := newHost(t, hostOpts{node: "node-b", peer: a})
	sb := a.create()
	if _, err := a.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	gen := a.record(sb.ID).Generation
	errs := make(chan error, 2)
	for _, h := range []*host{a, b} {
		go func() { _, err := h.m.Resume(ctx, sb.ID); errs <- err }()
	}
	var won, told int
	for range 2 {
		err := <-errs
		switch {
		case err == nil:
			won++
		case manager.OwnerOf(err) != "":
			told++
		default:
			t.Errorf("resume: %v", err)
		}
	}
	r := a.record(sb.ID)
	if r.State != sandbox.StateRunning || r.Generation != gen+1 {
		t.Errorf("after both: state %s generation %d, want running %d (one resume)", r.State, r.Generation, gen+1)
	}
	// Both may succeed only if the second ran after the first finished on
	// the same node, which two nodes cannot: the loser is told.
	if won != 1 || told != 1 {
		t.Errorf("%d resumed, %d told the owner; want 1 and 1", won, told)
	}
	instances := 0
	for _, h := range []*host{a, b} {
		infos, _ := h.eng.List(ctx)
		instances += len(infos)
	}
	if instances != 1 {
		t.Errorf("%d instances on the two nodes, want 1", instances)
	}
}

// TestFenceFinishesCommittedHibernate: a lost node whose hibernate had
// committed its snapshot (but not its record) loses nothing: the fence
// finishes the hibernate on that snapshot.
func TestFenceFinishesCommittedHibernate(t *testing.T) {
	ctx := context.Background()
	a := newHost(t, hostOpts{node: "node-a"})
	b := newHost(t, hostOpts{node: "node-b", peer: a})
	sb := a.create()
	hib, err := a.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.m.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	// node-b's record as a crash in its next hibernate leaves it: the
	// snapshot committed in the store, the record still hibernating.
	r := b.record(sb.ID)
	r.State, r.PendingSnapshot, r.SnapshotID = sandbox.StateHibernating, hib.Snapshot.ID, "snap-older"
	if err := b.db.UpdateSandbox(ctx, r); err != nil {
		t.Fatal(err)
	}
	if err := a.db.DeleteSnapshot(ctx, hib.Snapshot.ID); err != nil { // its record was never written
		t.Fatal(err)
	}
	if ok, err := a.m.Fence(ctx, sb.ID, "node-b", "node node-b lost"); !ok || err != nil {
		t.Fatalf("fence: %v %v", ok, err)
	}
	got := a.record(sb.ID)
	if got.State != sandbox.StateHibernated || got.SnapshotID != hib.Snapshot.ID || got.Owner != "" || got.Error != "" ||
		got.LeaseToken != r.LeaseToken+1 {
		t.Fatalf("after the fence: state %s snapshot %s owner %q error %q token %d (was %d)",
			got.State, got.SnapshotID, got.Owner, got.Error, got.LeaseToken, r.LeaseToken)
	}
	if _, err := a.db.GetSnapshot(ctx, hib.Snapshot.ID); err != nil {
		t.Errorf("the finished hibernate's snapshot record: %v", err)
	}
	if res, err := a.m.Resume(ctx, sb.ID); err != nil || res.Node != "node-a" {
		t.Fatalf("resume after the fence: %v %+v", err, res)
	}
}

// TestStopInstancesReleaseOwned: a node that fences itself stops every
// instance on its host without the database; back on it, ReleaseOwned puts
// its sandboxes in state error with no owner and a new lease token (a
// hibernated one stays as it is), and the other node resumes them from their
// snapshots.
func TestStopInstancesReleaseOwned(t *testing.T) {
	ctx := context.Background()
	a := newHost(t, hostOpts{node: "node-a"})
	b := newHost(t, hostOpts{node: "node-b", peer: a})
	run, hib := a.create(), a.create()
	a.writeFile(run.ID, "/tmp/f", "snapshotted")
	if _, err := a.m.Hibernate(ctx, run.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.m.Resume(ctx, run.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := a.m.Hibernate(ctx, hib.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	token := a.record(run.ID).LeaseToken
	if got := a.m.StopInstances(ctx); !slices.Contains(got, run.ID) {
		t.Fatalf("stopped %v; want %s among them", got, run.ID)
	}
	if infos, _ := a.eng.List(ctx); len(infos) != 0 {
		t.Fatalf("%d instances left after StopInstances", len(infos))
	}
	if err := a.m.ReleaseOwned(ctx, "node node-a fenced itself"); err != nil {
		t.Fatal(err)
	}
	r := a.record(run.ID)
	if r.State != sandbox.StateError || r.Owner != "" || r.LeaseToken != token+1 || !strings.Contains(r.Error, "node node-a fenced itself") ||
		!strings.Contains(r.Error, r.SnapshotID) {
		t.Fatalf("released: state %s owner %q token %d (was %d) error %q", r.State, r.Owner, r.LeaseToken, token, r.Error)
	}
	if h := a.record(hib.ID); h.State != sandbox.StateHibernated || h.Owner != "" {
		t.Errorf("the hibernated sandbox after the release: %s owner %q", h.State, h.Owner)
	}
	back, err := b.m.Resume(ctx, run.ID)
	if err != nil || back.Node != "node-b" {
		t.Fatalf("resume on node-b: %v %+v", err, back)
	}
	if got := b.readFile(run.ID, "/tmp/f"); got != "snapshotted" {
		t.Errorf("file after the resume elsewhere: %q", got)
	}
}
