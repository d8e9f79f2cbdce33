package manager_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// short bounds every engine call so that a blocked one fails quickly.
var short = manager.EngineTimeouts{Start: 300 * time.Millisecond, Restore: 300 * time.Millisecond,
	Checkpoint: 300 * time.Millisecond, CheckpointPerGiB: time.Millisecond, Stop: 300 * time.Millisecond,
	Dial: 300 * time.Millisecond, List: 300 * time.Millisecond}

// within fails the test if f takes longer than d.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	start := time.Now()
	f()
	if el := time.Since(start); el > d {
		t.Fatalf("%s took %s, want at most %s", what, el, d)
	}
}

// TestEngineDeadlines: an engine call that hangs fails at its deadline with
// ErrEngineTimeout, releases the sandbox's lock, and leaves the sandbox in a
// truthful state: unchanged where the engine did nothing (resume, hibernate),
// error with the reason where its instance is lost (create).
func TestEngineDeadlines(t *testing.T) {
	ctx := context.Background()

	t.Run("Restore", func(t *testing.T) {
		h := newHost(t, hostOpts{timeouts: short})
		sb := h.create()
		h.writeFile(sb.ID, "/kept", "yes")
		if _, err := h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
			t.Fatal(err)
		}
		b := h.eng.Block(fake.Restore, "")
		var err error
		within(t, 5*time.Second, "a resume with a hung restore", func() { _, err = h.m.Resume(ctx, sb.ID) })
		if !errors.Is(err, manager.ErrEngineTimeout) || !strings.Contains(err.Error(), "restore") {
			t.Fatalf("resume with a hung restore: %v, want ErrEngineTimeout naming restore", err)
		}
		if rec := h.record(sb.ID); rec.State != sandbox.StateHibernated || rec.Instance != "" {
			t.Fatalf("after the timed-out resume: state %s, instance %q; want hibernated, none", rec.State, rec.Instance)
		}
		b.Release()
		if got := h.readFile(sb.ID, "/kept"); got != "yes" { // wakes it
			t.Fatalf("after a resume that works: /kept = %q", got)
		}
	})

	t.Run("Checkpoint", func(t *testing.T) {
		h := newHost(t, hostOpts{timeouts: short})
		sb := h.create()
		b := h.eng.Block(fake.Checkpoint, "")
		defer b.Release()
		var err error
		within(t, 5*time.Second, "a hibernate with a hung checkpoint", func() {
			_, err = h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{})
		})
		if !errors.Is(err, manager.ErrEngineTimeout) {
			t.Fatalf("hibernate with a hung checkpoint: %v, want ErrEngineTimeout", err)
		}
		// The checkpoint never started: the sandbox still runs.
		rec := h.record(sb.ID)
		if rec.State != sandbox.StateRunning || rec.PendingSnapshot != "" {
			t.Fatalf("after the timed-out hibernate: state %s, pending %q; want running, none", rec.State, rec.PendingSnapshot)
		}
		h.writeFile(sb.ID, "/after", "ok")
	})

	t.Run("Start", func(t *testing.T) {
		h := newHost(t, hostOpts{timeouts: short})
		b := h.eng.Block(fake.Start, "")
		defer b.Release()
		var sb sandbox.Sandbox
		var err error
		within(t, 5*time.Second, "a create with a hung start", func() {
			sb, err = h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
		})
		if !errors.Is(err, manager.ErrEngineTimeout) {
			t.Fatalf("create with a hung start: %v, want ErrEngineTimeout", err)
		}
		rec := h.record(sb.ID)
		if rec.State != sandbox.StateError || !strings.Contains(rec.Error, "no answer within") {
			t.Fatalf("after the timed-out create: state %s, error %q; want error saying the engine did not answer", rec.State, rec.Error)
		}
	})

	t.Run("Stop", func(t *testing.T) {
		h := newHost(t, hostOpts{timeouts: short})
		sb := h.create()
		b := h.eng.Block(fake.Stop, "")
		var err error
		within(t, 5*time.Second, "a delete with a hung stop", func() { err = h.m.Delete(ctx, sb.ID) })
		if !errors.Is(err, manager.ErrEngineTimeout) {
			t.Fatalf("delete with a hung stop: %v, want ErrEngineTimeout", err)
		}
		// The delete is recorded (the API no longer shows the sandbox) and a
		// later delete, once the engine answers, finishes it.
		if rec := h.record(sb.ID); !rec.Deleting {
			t.Fatalf("after the timed-out delete: deleting %v, want true", rec.Deleting)
		}
		b.Release()
		h.m.Wait()
		h.close()
		h2 := newHost(t, hostOpts{dir: h.dir, timeouts: short})
		if _, err := h2.db.GetSandbox(ctx, sb.ID); err == nil {
			t.Fatal("the next start did not finish the interrupted delete")
		}
	})
}

// TestSnapshotEngineVersion: a snapshot taken by another engine version is
// refused with ErrConflict and engine.ErrIncompatible, naming both versions,
// before the engine is asked to restore it; the sandbox stays hibernated and
// resumes once a host with the writer's version runs it. Fork goes through the
// same check.
func TestSnapshotEngineVersion(t *testing.T) {
	ctx := context.Background()
	old := newHost(t, hostOpts{version: "fake 1"})
	sb := old.create()
	old.writeFile(sb.ID, "/kept", "yes")
	hib, err := old.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	old.close()

	upgraded := newHost(t, hostOpts{dir: old.dir, version: "fake 2"})
	_, err = upgraded.m.Resume(ctx, sb.ID)
	want := "snapshot " + hib.Snapshot.ID + " was taken by fake 1, this host runs fake 2"
	if !errors.Is(err, sandbox.ErrConflict) || !errors.Is(err, engine.ErrIncompatible) || !strings.Contains(err.Error(), want) {
		t.Fatalf("resume of an older version's snapshot: %v; want a conflict saying %q", err, want)
	}
	if n := upgraded.eng.Calls(fake.Restore); n != 0 {
		t.Fatalf("the engine was asked to restore %d times", n)
	}
	if rec := upgraded.record(sb.ID); rec.State != sandbox.StateHibernated || rec.Error != "" || rec.SnapshotID != hib.Snapshot.ID {
		t.Fatalf("after the refusal: state %s, error %q, snapshot %s; want hibernated on %s", rec.State, rec.Error, rec.SnapshotID, hib.Snapshot.ID)
	}
	if _, err := upgraded.m.Fork(ctx, sb.ID, 1); !errors.Is(err, engine.ErrIncompatible) {
		t.Fatalf("fork of an older version's snapshot: %v, want ErrIncompatible", err)
	}
	// Calls that wake the sandbox are refused the same way.
	if _, _, err := upgraded.m.ReadFile(ctx, sb.ID, "/kept"); !errors.Is(err, engine.ErrIncompatible) {
		t.Fatalf("read from a sandbox whose snapshot is incompatible: %v", err)
	}
	upgraded.close()

	back := newHost(t, hostOpts{dir: old.dir, version: "fake 1"})
	if got := back.readFile(sb.ID, "/kept"); got != "yes" {
		t.Fatalf("resumed by the writer's version: /kept = %q", got)
	}
}

// TestInstanceExit: an instance that dies (the engine's Wait returns) puts its
// sandbox in state error saying what exited.
func TestInstanceExit(t *testing.T) {
	h := newHost(t, hostOpts{})
	sb := h.create()
	rec := h.record(sb.ID)
	h.eng.Kill(rec.Instance)
	deadline := time.Now().Add(5 * time.Second)
	for {
		rec = h.record(sb.ID)
		if rec.State == sandbox.StateError {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("state %s 5 s after the instance died; want error", rec.State)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(rec.Error, "the fake instance (killed) exited unexpectedly") {
		t.Fatalf("error %q does not say what exited", rec.Error)
	}
	if infos, _ := h.eng.List(context.Background()); len(infos) != 0 {
		t.Fatalf("the dead instance was not removed: %+v", infos)
	}
}
