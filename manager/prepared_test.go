package manager_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// preparingEngine is the fake engine with prepared instances holding mem
// bytes (engine.RestorePreparer).
type preparingEngine struct {
	*fake.Engine
	mem       atomic.Int64
	discarded atomic.Int32
}

func (p *preparingEngine) Prepared() (int, int64) { return 1, p.mem.Load() }

func (p *preparingEngine) DiscardPrepared(context.Context) error {
	p.discarded.Add(1)
	p.mem.Store(0)
	return nil
}

// TestAdmissionCountsPrepared: the memory the engine's prepared instances
// hold counts against the host's, rounded up to whole MiB; DiscardPrepared
// reaches the engine and frees it.
func TestAdmissionCountsPrepared(t *testing.T) {
	ctx := context.Background()
	var pe *preparingEngine
	h := newHost(t, hostOpts{
		limits: manager.LimitsConfig{HostMemoryBytes: 100 << 20, RetryAfter: 7 * time.Second},
		wrap: func(e *fake.Engine) engine.Engine {
			pe = &preparingEngine{Engine: e}
			return pe
		},
	})
	pe.mem.Store(36<<20 + 1) // 37 MiB rounded up: 64 + 37 > 100
	_, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	wantRefused(t, "create beside 37 MiB of prepared instances", err)
	pe.mem.Store(36 << 20) // 64 + 36 = 100
	h.create()
	pe.mem.Store(1 << 20)
	_, err = h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	wantRefused(t, "second create", err)
	h.m.DiscardPrepared(ctx)
	if n := pe.discarded.Load(); n != 1 {
		t.Errorf("DiscardPrepared reached the engine %d times, want 1", n)
	}
}
