package manager

import (
	"context"
	"time"

	"github.com/torpor/torpor/engine"
)

// Prepared instances (engine.RestorePreparer) are the engines' own: a resume
// uses one when its engine has one of the right shape, without the manager
// asking. The manager only counts the memory they hold in admission control
// (preparedMiB) and removes them on shutdown (DiscardPrepared); those a
// crashed server left are orphaned instances to Reconcile.

// discardPreparedTimeout bounds DiscardPrepared (each prepared gVisor
// container takes ~50–150 ms to remove).
const discardPreparedTimeout = time.Minute

// DiscardPrepared removes every engine's prepared instances and stops their
// preparation; the server calls it on shutdown. Errors are logged.
func (m *Manager) DiscardPrepared(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, discardPreparedTimeout)
	defer cancel()
	for _, e := range m.cfg.Engines.All() {
		if p, ok := e.(engine.RestorePreparer); ok {
			if err := p.DiscardPrepared(ctx); err != nil {
				m.log.Warn("discard prepared instances", "engine", e.Name(), "err", err)
			}
		}
	}
}

// preparedMiB is the host memory, in MiB rounded up, that the engines'
// prepared instances hold now.
func (m *Manager) preparedMiB() int64 {
	var b int64
	for _, e := range m.cfg.Engines.All() {
		if p, ok := e.(engine.RestorePreparer); ok {
			_, n := p.Prepared()
			b += n
		}
	}
	return (b + 1<<20 - 1) >> 20
}
