package manager_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/local"
)

// TestReconcile: what a server start makes of each record a crash can leave —
// recorded state × its instance still running or gone × (hibernating) its
// snapshot committed in the store or not — and that no instance is left that
// no running sandbox owns.
func TestReconcile(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// crashIn turns a running sandbox (on host h, /kept written) into the
		// record and instance a crash left.
		crashIn   func(h *host, rec *metadata.Sandbox)
		state     sandbox.State
		errSubstr string // in the record's error, for state error
	}{
		{"running, instance alive", func(h *host, rec *metadata.Sandbox) {}, sandbox.StateRunning, ""},
		{"running, instance died", func(h *host, rec *metadata.Sandbox) { h.eng.Kill(rec.Instance) },
			sandbox.StateError, "lost on server restart"},
		{"hibernating, snapshot committed", func(h *host, rec *metadata.Sandbox) {
			// The crash came between the store's commit and the database's.
			hib, err := h.m.Hibernate(ctx, rec.ID, manager.HibernateOptions{})
			if err != nil {
				h.t.Fatal(err)
			}
			*rec = *h.record(rec.ID) // the hibernate advanced the row's version
			rec.State, rec.PendingSnapshot, rec.SnapshotID = sandbox.StateHibernating, hib.Snapshot.ID, ""
			h.put(rec)
			if err := h.db.DeleteSnapshot(ctx, hib.Snapshot.ID); err != nil {
				h.t.Fatal(err)
			}
		}, sandbox.StateHibernated, ""},
		{"hibernating, not committed, instance alive", func(h *host, rec *metadata.Sandbox) {
			rec.State, rec.PendingSnapshot = sandbox.StateHibernating, "snap-neverwritten"
			h.put(rec)
		}, sandbox.StateRunning, ""},
		{"hibernating, not committed, instance died", func(h *host, rec *metadata.Sandbox) {
			rec.State, rec.PendingSnapshot = sandbox.StateHibernating, "snap-neverwritten"
			h.put(rec)
			h.eng.Kill(rec.Instance)
		}, sandbox.StateError, "hibernate interrupted"},
		{"resuming, instance alive", func(h *host, rec *metadata.Sandbox) {
			hibernateAndRestart(h, rec)
		}, sandbox.StateHibernated, ""},
		{"resuming, instance died", func(h *host, rec *metadata.Sandbox) {
			hibernateAndRestart(h, rec)
			h.eng.Kill(rec.Instance)
		}, sandbox.StateHibernated, ""},
		{"creating, instance alive", func(h *host, rec *metadata.Sandbox) {
			rec.State = sandbox.StateCreating
			h.put(rec)
		}, sandbox.StateError, "create interrupted"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHost(t, hostOpts{})
			sb := h.create()
			h.writeFile(sb.ID, "/kept", "yes")
			rec := h.record(sb.ID)
			c.crashIn(h, rec)
			h.crash()
			h2 := newHost(t, hostOpts{dir: h.dir, eng: h.eng})
			got := h2.record(sb.ID)
			if got.State != c.state || (c.errSubstr != "" && !strings.Contains(got.Error, c.errSubstr)) {
				t.Fatalf("after reconcile: state %s (error %q), want %s (error with %q)", got.State, got.Error, c.state, c.errSubstr)
			}
			infos, _ := h2.eng.List(ctx)
			for _, i := range infos {
				if got.State != sandbox.StateRunning || i.ID != got.Instance {
					t.Fatalf("instance %+v left; the sandbox is %s on %q", i, got.State, got.Instance)
				}
			}
			if got.State == sandbox.StateRunning && len(infos) != 1 {
				t.Fatalf("running sandbox, instances %+v", infos)
			}
			if got.State == sandbox.StateRunning || got.State == sandbox.StateHibernated {
				if v := h2.readFile(sb.ID, "/kept"); v != "yes" {
					t.Fatalf("/kept = %q after reconcile", v)
				}
			}
		})
	}
}

// hibernateAndRestart leaves rec as a resume a crash interrupted: hibernated,
// then marked resuming on a new instance that the engine restored.
func hibernateAndRestart(h *host, rec *metadata.Sandbox) {
	ctx := context.Background()
	if _, err := h.m.Hibernate(ctx, rec.ID, manager.HibernateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.m.Resume(ctx, rec.ID); err != nil {
		h.t.Fatal(err)
	}
	*rec = *h.record(rec.ID)
	rec.State = sandbox.StateResuming
	h.put(rec)
}

func (h *host) put(rec *metadata.Sandbox) {
	h.t.Helper()
	if err := h.db.UpdateSandbox(context.Background(), rec); err != nil {
		h.t.Fatal(err)
	}
}

// TestReconcileKeepsRecentUnrecordedSnapshots: on a shared database a start-up
// deletes a committed snapshot that no record knows only once it is older
// than an hour; a younger one may be another node's commit whose record is
// being written.
func TestReconcileKeepsRecentUnrecordedSnapshots(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	store, err := local.New(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	for id, at := range map[string]time.Time{"snap-recent00000": time.Now(), "snap-old00000000": time.Now().Add(-2 * time.Hour)} {
		d, err := store.Stage(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "pages.img"), []byte("pages"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Commit(ctx, id, snapshot.Manifest{ID: id, SandboxID: "sbx-elsewhere0", Engine: "fake", CreatedAt: at}); err != nil {
			t.Fatal(err)
		}
	}
	newHost(t, hostOpts{dir: dir, node: "a"})
	ids, err := store.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 || ids[0] != "snap-recent00000" {
		t.Fatalf("after reconcile the store holds %v, want only the recent snapshot", ids)
	}
}
