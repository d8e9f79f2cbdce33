package manager_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// TestForkFirst: a fork with ForkOptions.First answers once its first clone
// runs, while the others' restores are still held in the engine (state
// creating); a call about a clone still starting waits for its start and
// then succeeds; a call about the source does not wait for the clones; a
// clone whose restore fails after the answer is left in state error; Wait
// returns once every clone has started.
func TestForkFirst(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	src := h.prepare(fromRunning)
	ids := []string{manager.NewSandboxID(), manager.NewSandboxID(), manager.NewSandboxID()}
	inst := func(id string) string { return id + "-00000001" } // the first instance of a sandbox (manager.instanceID)
	held := h.eng.Block(fake.Restore, inst(ids[1]))
	defer held.Release()
	undo := h.eng.Fail(fake.Restore, inst(ids[2]), errors.New("restore refused by the test"))
	defer undo()

	clones, err := h.m.Fork(ctx, src, 3, manager.ForkOptions{IDs: ids, First: true})
	if err != nil || len(clones) != 3 {
		t.Fatalf("fork first: %v %v", clones, err)
	}
	if clones[0].State != sandbox.StateRunning {
		t.Errorf("first clone answered in state %s, want running", clones[0].State)
	}
	<-held.Reached()
	if clones[1].State != sandbox.StateCreating {
		t.Errorf("held clone answered in state %s, want creating", clones[1].State)
	}
	if rec := h.record(ids[1]); rec.State != sandbox.StateCreating {
		t.Errorf("held clone's record in state %s, want creating", rec.State)
	}

	// The source is free while the clones start: a hibernate of it completes.
	if _, err := h.m.Hibernate(ctx, src, manager.HibernateOptions{}); err != nil {
		t.Fatalf("hibernate of the source while its clones start: %v", err)
	}

	// An exec in the held clone waits for its start, then runs.
	done := make(chan error, 1)
	go func() { done <- execTrue(ctx, h.m, ids[1]) }()
	select {
	case err := <-done:
		t.Fatalf("exec in a clone still starting answered before its start: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	held.Release()
	if err := <-done; err != nil {
		t.Fatalf("exec in the held clone after its start: %v", err)
	}
	h.m.Wait()
	if rec := h.record(ids[1]); rec.State != sandbox.StateRunning {
		t.Errorf("held clone in state %s after Wait, want running", rec.State)
	}
	if rec := h.record(ids[2]); rec.State != sandbox.StateError || rec.Error == "" {
		t.Errorf("failed clone in state %s (%q), want error with its cause", rec.State, rec.Error)
	}
	if err := execTrue(ctx, h.m, ids[0]); err != nil {
		t.Errorf("exec in the first clone: %v", err)
	}
}

// TestForkFirstAllFail: a fork with First whose first clone fails to start
// waits for every clone and answers with the error, as a fork without it.
func TestForkFirstAllFail(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	src := h.prepare(fromRunning)
	undo := h.eng.Fail(fake.Restore, "", errors.New("restore refused by the test"))
	clones, err := h.m.Fork(ctx, src, 2, manager.ForkOptions{First: true})
	undo()
	if err == nil {
		t.Fatalf("fork first with every restore failing: %v, want an error", clones)
	}
	for _, c := range clones {
		if c.State != sandbox.StateError {
			t.Errorf("clone %s in state %s, want error", c.ID, c.State)
		}
		if !strings.Contains(err.Error(), c.ID) {
			t.Errorf("the fork's error does not name clone %s: %v", c.ID, err)
		}
	}
}

// TestForkFirstFirstFails: when a fork with First loses its first clone, it
// answers once another runs, the first in state error with its cause.
func TestForkFirstFirstFails(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	src := h.prepare(fromRunning)
	ids := []string{manager.NewSandboxID(), manager.NewSandboxID(), manager.NewSandboxID()}
	undo := h.eng.Fail(fake.Restore, ids[0]+"-00000001", errors.New("restore refused by the test"))
	defer undo()
	clones, err := h.m.Fork(ctx, src, 3, manager.ForkOptions{IDs: ids, First: true})
	if err != nil || len(clones) != 3 {
		t.Fatalf("fork first whose first clone fails: %v %v, want an answer with the others", clones, err)
	}
	if clones[0].State != sandbox.StateError || clones[0].Error == "" {
		t.Errorf("failed first clone answered in state %s (%q), want error with its cause", clones[0].State, clones[0].Error)
	}
	running := 0
	for _, c := range clones[1:] {
		if c.State == sandbox.StateRunning {
			running++
		}
	}
	if running == 0 {
		t.Errorf("answer %+v: no clone running", clones)
	}
	h.m.Wait()
	for _, id := range ids[1:] {
		if err := execTrue(ctx, h.m, id); err != nil {
			t.Errorf("exec in clone %s: %v", id, err)
		}
	}
}

// TestForkPartialFailure: a fork (without First) whose clone fails answers
// an error naming the failed clone and every clone, with their views.
func TestForkPartialFailure(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	src := h.prepare(fromRunning)
	ids := []string{manager.NewSandboxID(), manager.NewSandboxID()}
	undo := h.eng.Fail(fake.Restore, ids[1]+"-00000001", errors.New("restore refused by the test"))
	defer undo()
	clones, err := h.m.Fork(ctx, src, 2, manager.ForkOptions{IDs: ids})
	if err == nil || !strings.Contains(err.Error(), "1 of 2 clones failed to start ("+ids[1]+";") || !strings.Contains(err.Error(), ids[0]) {
		t.Fatalf("fork with a failing clone: %v, want an error naming both clones", err)
	}
	if len(clones) != 2 || clones[0].State != sandbox.StateRunning || clones[1].State != sandbox.StateError {
		t.Errorf("clones %+v, want the first running and the second in error", clones)
	}
}

// execTrue runs `true` in sandbox id and returns an error unless it exits 0.
func execTrue(ctx context.Context, m *manager.Manager, id string) error {
	st, err := m.Exec(ctx, id, sandbox.ExecRequest{Cmd: []string{"true"}})
	if err != nil {
		return err
	}
	defer st.Close()
	for {
		ev, err := st.Next()
		if err != nil {
			return err
		}
		if ev.ExitCode != nil {
			if *ev.ExitCode != 0 {
				return errors.New("exit " + ev.Error)
			}
			return nil
		}
	}
}
