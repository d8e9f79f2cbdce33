package manager_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/local"
)

// lockFails is a store whose commits fail as a chunked store's do when the
// database holding the collection lock does not answer, while fail is set.
type lockFails struct {
	snapshot.Store
	fail *atomic.Bool
}

func (l lockFails) Commit(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	if l.fail.Load() {
		return m, fmt.Errorf("snapshot %s: commit: collection lock: %w: connection refused", id, snapshot.ErrLockUnavailable)
	}
	return l.Store.Commit(ctx, id, m)
}

// lockFailsStore is a hostOpts.store: a plain-file store in the host's
// directory whose commits fail while fail is set.
func lockFailsStore(fail *atomic.Bool) func(t *testing.T, dir string) snapshot.Store {
	return func(t *testing.T, dir string) snapshot.Store {
		st, err := local.New(filepath.Join(dir, "snapshots"))
		if err != nil {
			t.Fatal(err)
		}
		return lockFails{Store: st, fail: fail}
	}
}

// strandOne starts nodes A (its commits failing while fail is set) and B,
// and hibernates through A, with fail set, a sandbox created on A with file
// /tmp/f "kept"; it returns the hibernate's error.
func strandOne(t *testing.T, fail *atomic.Bool) (a, b *host, sb sandbox.Sandbox, err error) {
	a = newHost(t, hostOpts{node: "node-a", store: lockFailsStore(fail)})
	b = newHost(t, hostOpts{node: "node-b", peer: a})
	sb = a.create()
	a.writeFile(sb.ID, "/tmp/f", "kept")
	fail.Store(true)
	_, err = a.m.Hibernate(context.Background(), sb.ID, manager.HibernateOptions{})
	return a, b, sb, err
}

// StagedDir is the wrapped store's (the note of a hibernate goes beside it).
func (l lockFails) StagedDir(id string) string {
	return l.Store.(interface{ StagedDir(string) string }).StagedDir(id)
}

// TestStrandedHibernate: node A's hibernate checkpoints the sandbox but its
// commit cannot take the collection lock. The hibernate answers Unavailable
// (a StrandedError with a Retry-After) and keeps the checkpoint; node B
// declares A lost and fences the sandbox (error, no owner); once commits
// work again A commits the kept checkpoint and records the sandbox
// hibernated on it, and B resumes it with its file. A second sandbox whose
// stranded hibernate was overtaken (fenced, then resumed by B from its
// earlier snapshot) is left as B resumed it and the checkpoint is dropped.
func TestStrandedHibernate(t *testing.T) {
	ctx := context.Background()
	var fail atomic.Bool
	a, b, sb, err := strandOne(t, &fail)
	var se *manager.StrandedError
	if sandbox.KindOf(err) != sandbox.Unavailable || !errors.As(err, &se) || manager.RetryAfterSeconds(err) <= 0 {
		t.Fatalf("hibernate without the lock: %v (kind %v), want Unavailable with a StrandedError", err, sandbox.KindOf(err))
	}
	if r := a.record(sb.ID); r.State != sandbox.StateHibernating || r.PendingSnapshot != se.Snapshot || r.Owner != "node-a" {
		t.Fatalf("after the stranded hibernate: state %s pending %q owner %q", r.State, r.PendingSnapshot, r.Owner)
	}
	if ok, err := b.m.Fence(ctx, sb.ID, "node-a", "node node-a lost"); !ok || err != nil {
		t.Fatalf("fence: %v %v", ok, err)
	}
	if left := a.m.FinishStranded(ctx); left != 1 {
		t.Fatalf("%d stranded hibernates left while commits fail, want 1", left)
	}
	fail.Store(false)
	if left := a.m.FinishStranded(ctx); left != 0 {
		t.Fatalf("%d stranded hibernates left once commits work, want 0", left)
	}
	r := a.record(sb.ID)
	if r.State != sandbox.StateHibernated || r.SnapshotID != se.Snapshot || r.Owner != "" || r.Error != "" || r.SnapshotNode != "node-a" {
		t.Fatalf("after the stranded hibernate was recorded: state %s snapshot %s (want %s) owner %q error %q snapshot node %q",
			r.State, r.SnapshotID, se.Snapshot, r.Owner, r.Error, r.SnapshotNode)
	}
	if res, err := b.m.Resume(ctx, sb.ID); err != nil || res.Node != "node-b" {
		t.Fatalf("resume through node B: %v %+v", err, res)
	}
	if got := b.readFile(sb.ID, "/tmp/f"); got != "kept" {
		t.Errorf("file after the resume: %q", got)
	}

	// Overtaken: fenced and resumed elsewhere before A could record it.
	sb2 := a.create()
	a.writeFile(sb2.ID, "/tmp/f", "first")
	first, err := a.m.Hibernate(ctx, sb2.ID, manager.HibernateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.m.Resume(ctx, sb2.ID); err != nil {
		t.Fatal(err)
	}
	a.writeFile(sb2.ID, "/tmp/f", "second")
	fail.Store(true)
	if _, err := a.m.Hibernate(ctx, sb2.ID, manager.HibernateOptions{}); !errors.As(err, &se) {
		t.Fatalf("second hibernate without the lock: %v", err)
	}
	if ok, err := b.m.Fence(ctx, sb2.ID, "node-a", "node node-a lost"); !ok || err != nil {
		t.Fatalf("fence: %v %v", ok, err)
	}
	if _, err := b.m.Resume(ctx, sb2.ID); err != nil {
		t.Fatalf("resume through node B from the first snapshot: %v", err)
	}
	fail.Store(false)
	if left := a.m.FinishStranded(ctx); left != 0 {
		t.Fatalf("%d stranded hibernates left, want the overtaken one dropped", left)
	}
	if r := b.record(sb2.ID); r.State != sandbox.StateRunning || r.Owner != "node-b" || r.SnapshotID != first.Snapshot.ID {
		t.Fatalf("the overtaken sandbox: state %s owner %q snapshot %s, want running on node-b from %s", r.State, r.Owner, r.SnapshotID, first.Snapshot.ID)
	}
	if got := b.readFile(sb2.ID, "/tmp/f"); got != "first" {
		t.Errorf("the overtaken sandbox's file: %q, want its first snapshot's", got)
	}
}

// TestStrandedHibernateAfterRestart: node A's hibernate is stranded (its
// commit cannot take the collection lock) and A's server is killed before
// it could commit it; node B fences the sandbox (error, no owner). A's next
// start commits the kept checkpoint and records the sandbox hibernated on
// it, and B resumes it with its file. Before, the start removed the staged
// checkpoint and the sandbox stayed in error ("it had no snapshot").
func TestStrandedHibernateAfterRestart(t *testing.T) {
	ctx := context.Background()
	var fail atomic.Bool
	a, b, sb, err := strandOne(t, &fail)
	var se *manager.StrandedError
	if !errors.As(err, &se) {
		t.Fatalf("hibernate without the lock: %v", err)
	}
	a.crash()
	if ok, err := b.m.Fence(ctx, sb.ID, "node-a", "node node-a lost"); !ok || err != nil {
		t.Fatalf("fence: %v %v", ok, err)
	}
	fail.Store(false)
	a2 := newHost(t, hostOpts{node: "node-a", dir: a.dir, eng: a.eng, store: lockFailsStore(&fail)})
	r := a2.record(sb.ID)
	if r.State != sandbox.StateHibernated || r.SnapshotID != se.Snapshot || r.Owner != "" || r.Error != "" {
		t.Fatalf("after node A's restart: state %s snapshot %s (want %s) owner %q error %q", r.State, r.SnapshotID, se.Snapshot, r.Owner, r.Error)
	}
	if _, err := b.m.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume through node B: %v", err)
	}
	if got := b.readFile(sb.ID, "/tmp/f"); got != "kept" {
		t.Errorf("file after the resume: %q", got)
	}
}
