package manager_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// TestRestoreTurns: with LimitsConfig.Restores 1, a resume waits, its
// sandbox still hibernated and its engine not yet asked, while another
// resume restores, and restores once that one has ended.
func TestRestoreTurns(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{limits: manager.LimitsConfig{Restores: 1}})
	a, b := h.prepare(fromHibernated), h.prepare(fromHibernated)
	next := func(id string) string { return fmt.Sprintf("%s-%08d", id, h.record(id).Seq+1) } // manager.instanceID
	held := h.eng.Block(fake.Restore, next(a))
	defer held.Release()
	heldB := h.eng.Block(fake.Restore, next(b))
	defer heldB.Release()

	resumed := make(chan error, 2)
	go func() { _, err := h.m.Resume(ctx, a); resumed <- err }()
	<-held.Reached()
	go func() { _, err := h.m.Resume(ctx, b); resumed <- err }()
	select {
	case <-heldB.Reached():
		t.Fatal("a second resume restored while the first held the only turn")
	case <-time.After(200 * time.Millisecond):
	}
	if st := h.record(b).State; st != sandbox.StateHibernated {
		t.Errorf("waiting sandbox in state %s, want hibernated", st)
	}
	held.Release()
	<-heldB.Reached()
	heldB.Release()
	for range 2 {
		if err := <-resumed; err != nil {
			t.Errorf("resume: %v", err)
		}
	}
	for _, id := range []string{a, b} {
		if st := h.record(id).State; st != sandbox.StateRunning {
			t.Errorf("%s in state %s after its turn, want running", id, st)
		}
	}
}
