package manager_test

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// TestKeptSnapshots: a kept snapshot of a running sandbox (which goes on
// running) starts new sandboxes with the state it had, outlives its sandbox's
// hibernates and deletion, is found by name, and goes once it is no longer
// kept and no sandbox resumes from it.
func TestKeptSnapshots(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	src, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, Env: map[string]string{"A": "src"},
		Metadata: map[string]string{"owner": "me"}})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(src.Metadata, map[string]string{"owner": "me"}) || !src.ResumeOnRequest {
		t.Errorf("created: metadata %v, resume on request %v", src.Metadata, src.ResumeOnRequest)
	}
	h.writeFile(src.ID, "/state", "before")
	kept, err := h.m.KeepSnapshot(ctx, src.ID, "saved")
	if err != nil {
		t.Fatal(err)
	}
	if kept.Name != "saved" || kept.SandboxID != src.ID {
		t.Errorf("kept %+v", kept)
	}
	if sb, _ := h.m.Get(ctx, src.ID); sb.State != sandbox.StateRunning {
		t.Errorf("source after the snapshot: %s, want running", sb.State)
	}
	if _, err := h.m.KeepSnapshot(ctx, src.ID, "saved"); !errors.Is(err, sandbox.ErrConflict) {
		t.Errorf("a second snapshot named saved: %v, want conflict", err)
	}
	h.writeFile(src.ID, "/state", "after")
	// The source hibernates (a new snapshot) and is deleted: the kept one stays.
	if _, err := h.m.Hibernate(ctx, src.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.m.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	byName, err := h.m.GetKeptSnapshot(ctx, "saved")
	if err != nil || byName.ID != kept.ID {
		t.Fatalf("by name after the source's delete: %+v %v", byName, err)
	}
	clone, err := h.m.StartFromSnapshot(ctx, kept.ID, sandbox.Spec{Env: map[string]string{"B": "clone"},
		Metadata: map[string]string{"owner": "clone"}, TimeoutS: 60, OnTimeout: sandbox.OnTimeoutDelete})
	if err != nil {
		t.Fatal(err)
	}
	if got := h.readFile(clone.ID, "/state"); got != "before" {
		t.Errorf("clone's /state = %q, want the snapshot's \"before\"", got)
	}
	if clone.ForkedFrom != src.ID || clone.TimeoutS != 60 || clone.OnTimeout != sandbox.OnTimeoutDelete ||
		!reflect.DeepEqual(clone.Env, map[string]string{"A": "src", "B": "clone"}) || clone.Metadata["owner"] != "clone" {
		t.Errorf("clone %+v", clone)
	}
	if _, err := h.m.StartFromSnapshot(ctx, kept.ID, sandbox.Spec{Image: "tiny"}); !errors.Is(err, sandbox.ErrInvalidArgument) {
		t.Errorf("start from a snapshot naming an image: %v", err)
	}
	if _, err := h.m.StartFromSnapshot(ctx, "snap-none", sandbox.Spec{}); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("start from an unknown snapshot: %v", err)
	}
	if list, err := h.m.ListKeptSnapshots(ctx); err != nil || len(list) != 1 || list[0].ID != kept.ID {
		t.Errorf("kept list %+v %v", list, err)
	}
	// No longer kept: it stays while the clone resumes from it, then goes.
	if err := h.m.DeleteKeptSnapshot(ctx, kept.ID); err != nil {
		t.Fatal(err)
	}
	if err := h.m.DeleteKeptSnapshot(ctx, kept.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	if _, err := h.m.GetSnapshot(ctx, kept.ID); err != nil {
		t.Errorf("snapshot gone while the clone resumes from it: %v", err)
	}
	if err := h.m.Delete(ctx, clone.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.GetSnapshot(ctx, kept.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("snapshot after its last user's delete: %v, want not found", err)
	}
}

// TestResumeOnRequest: a sandbox created not to resume on request refuses
// requests while hibernated, until an explicit resume.
func TestResumeOnRequest(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	no := false
	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, ResumeOnRequest: &no})
	if err != nil {
		t.Fatal(err)
	}
	h.writeFile(sb.ID, "/f", "x")
	if _, err := h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.m.ReadFile(ctx, sb.ID, "/f"); !errors.Is(err, sandbox.ErrConflict) {
		t.Errorf("read of a hibernated sandbox that does not resume on request: %v, want conflict", err)
	}
	if got, _ := h.m.Get(ctx, sb.ID); got.State != sandbox.StateHibernated {
		t.Errorf("state after the refused read: %s", got.State)
	}
	if _, err := h.m.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if got := h.readFile(sb.ID, "/f"); got != "x" {
		t.Errorf("/f = %q after the resume", got)
	}
}
