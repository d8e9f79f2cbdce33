package fake_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/enginetest"
	"github.com/torpor/torpor/engine/fake"
)

func newEngine(t *testing.T, version string) *fake.Engine {
	t.Helper()
	e, err := fake.New(fake.Config{Dir: t.TempDir(), Version: version})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestConformance(t *testing.T) {
	enginetest.Run(t, enginetest.Setup{Engine: newEngine(t, ""),
		Spec: engine.Spec{RootFS: "/nonexistent.erofs", GuestDir: "/nonexistent", MemoryMiB: 64, CPUs: 1}})
}

// TestHooks: Fail and Block act on the method and instance they name only; a
// blocked call returns its context's error and starts nothing.
func TestHooks(t *testing.T) {
	ctx := context.Background()
	e := newEngine(t, "")
	boom := errors.New("boom")
	undo := e.Fail(fake.Start, "i-1", boom)
	if err := e.Start(ctx, engine.Spec{ID: "i-1"}); !errors.Is(err, boom) {
		t.Fatalf("Start with a Fail hook: %v", err)
	}
	if err := e.Start(ctx, engine.Spec{ID: "i-2"}); err != nil {
		t.Fatalf("Start of another instance: %v", err)
	}
	undo()
	if err := e.Start(ctx, engine.Spec{ID: "i-1"}); err != nil {
		t.Fatalf("Start after undo: %v", err)
	}
	b := e.Block(fake.Stop, "i-1")
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := e.Stop(cctx, "i-1"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked Stop: %v, want the context's error", err)
	}
	select {
	case <-b.Reached():
	default:
		t.Fatal("Reached not closed after a call blocked")
	}
	if infos, _ := e.List(ctx); len(infos) != 2 {
		t.Fatalf("a blocked Stop removed something: %+v", infos)
	}
	done := make(chan error, 1)
	go func() { done <- e.Stop(ctx, "i-1") }()
	time.Sleep(20 * time.Millisecond)
	b.Release()
	if err := <-done; err != nil {
		t.Fatalf("Stop after Release: %v", err)
	}
	if e.Calls(fake.Stop) != 2 {
		t.Fatalf("Calls(Stop) = %d, want 2", e.Calls(fake.Stop))
	}
}

// TestKill: a killed instance stops answering, Wait returns, and it is listed
// as not running until Stop.
func TestKill(t *testing.T) {
	ctx := context.Background()
	e := newEngine(t, "")
	if err := e.Start(ctx, engine.Spec{ID: "k-1"}); err != nil {
		t.Fatal(err)
	}
	done := make(chan engine.ExitStatus, 1)
	go func() { st, _ := e.Wait(ctx, "k-1"); done <- st }()
	e.Kill("k-1")
	select {
	case st := <-done:
		if st.What == "" {
			t.Fatal("empty exit status")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Wait did not return after Kill")
	}
	if _, err := e.Dial(ctx, "k-1", engine.AgentPort); !errors.Is(err, engine.ErrNotRunning) {
		t.Fatalf("Dial after Kill: %v", err)
	}
	infos, _ := e.List(ctx)
	if len(infos) != 1 || infos[0].Running {
		t.Fatalf("List after Kill: %+v", infos)
	}
}

// TestRestoreRefusesOtherVersion: like runsc, the fake restores only its own
// version's checkpoints.
func TestRestoreRefusesOtherVersion(t *testing.T) {
	ctx := context.Background()
	old, cur := newEngine(t, "fake 1"), newEngine(t, "fake 2")
	if err := old.Start(ctx, engine.Spec{ID: "v-1"}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "ckpt")
	os.Mkdir(dir, 0o700)
	if err := old.Checkpoint(ctx, "v-1", dir, false); err != nil {
		t.Fatal(err)
	}
	if err := cur.Restore(ctx, engine.Spec{ID: "v-2"}, dir); err == nil {
		t.Fatal("a fake 2 engine restored a fake 1 checkpoint")
	}
	if err := old.Restore(ctx, engine.Spec{ID: "v-2"}, dir); err != nil {
		t.Fatalf("restore by the writer's version: %v", err)
	}
	old.Stop(ctx, "v-2")
}
