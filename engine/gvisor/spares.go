package gvisor

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/sandboxnet"
)

// Spare network pairs take the network namespaces off a start's and a
// restore's path.
//
// Every instance runs in a pair of network namespaces of its own
// (sandboxnet). Making one (sandboxnet.Create: two namespaces, a veth pair,
// addresses and routes, three ip(8) runs) is tens of milliseconds of a
// create or a resume; a pair made ahead of time is the same for every
// instance (the addresses and MACs are fixed), so with Config.SpareNetworks >
// 0 the engine keeps that many made under names of its own and gives one to
// an instance by renaming it (sandboxnet.Rename: two bind mounts). Each one
// taken is made again spareRefillDelay (2 s) later, one at a time, off the
// started instance's first requests.
//
// A spare's names are sandboxnet.For(scope, "spare-<token>-<seq>"), the token
// the engine's own: List leaves this engine's spares out (no instance owns
// them), so a new engine's List names those a crashed one left, and the
// server's reconcile removes them like any orphaned instance's remains.
// DiscardPrepared and Close remove the engine's own.
//
// What one costs while it waits: two network namespaces and a veth pair; no
// process, no memory charged to a sandbox.

// sparePrefix starts every spare pair's id.
const sparePrefix = "spare-"

// spareRefillDelay is how long after a spare is taken the engine starts making
// the next: making a pair costs CPU (ip(8) runs) that on a two-core host
// competes with the instance's start, its resume contract and its first
// requests; 0.3 s later landed among them and made the resume benchmark
// slower (docs/benchmarks/2026-12-04-spare-networks.md).
const spareRefillDelay = 2 * time.Second

// sparePool is the engine's spare network pairs.
type sparePool struct {
	mu    sync.Mutex
	ready []string // spare ids, ready to be renamed
	// making says a refill runs; seq numbers the spares.
	making bool
	seq    int
	closed bool
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// taken counts the pairs given to instances.
	taken int64
}

func (e *Engine) initSpares() {
	p := &e.spares
	p.ctx, p.cancel = context.WithCancel(context.Background())
	e.fillSpares(0)
}

// isSpare reports whether id names one of this engine's spare pairs (made or
// being made).
func (e *Engine) isSpare(id string) bool {
	return strings.HasPrefix(id, sparePrefix+e.prep.token+"-")
}

// networkFor gives instance id its pair of network namespaces: a spare one
// renamed to id's names if one is ready, else a new one (sandboxnet.Create).
// Errors: sandboxnet.Create's.
func (e *Engine) networkFor(ctx context.Context, id string) error {
	target := e.pair(id)
	p := &e.spares
	p.mu.Lock()
	var spare string
	if n := len(p.ready); n > 0 && !p.closed {
		spare, p.ready = p.ready[n-1], p.ready[:n-1]
	}
	p.mu.Unlock()
	if spare != "" {
		_ = sandboxnet.Delete(ctx, target) // a leftover of id's, as Create removes
		if err := sandboxnet.Rename(e.pair(spare), target); err == nil {
			p.mu.Lock()
			p.taken++
			p.mu.Unlock()
			e.fillSpares(spareRefillDelay)
			return nil
		}
		_ = sandboxnet.Delete(ctx, e.pair(spare))
		e.fillSpares(spareRefillDelay)
	}
	return sandboxnet.Create(ctx, target)
}

// fillSpares makes spare pairs, after delay, until Config.SpareNetworks are
// ready; one refill runs at a time.
func (e *Engine) fillSpares(delay time.Duration) {
	p := &e.spares
	p.mu.Lock()
	defer p.mu.Unlock()
	if e.cfg.SpareNetworks <= 0 || p.closed || p.making || len(p.ready) >= e.cfg.SpareNetworks {
		return
	}
	p.making = true
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		select {
		case <-time.After(delay):
		case <-p.ctx.Done():
		}
		for {
			p.mu.Lock()
			if p.closed || len(p.ready) >= e.cfg.SpareNetworks {
				p.making = false
				p.mu.Unlock()
				return
			}
			p.seq++
			id := fmt.Sprintf("%s%s-%06d", sparePrefix, e.prep.token, p.seq%1000000)
			p.mu.Unlock()
			err := sandboxnet.Create(p.ctx, e.pair(id))
			p.mu.Lock()
			if err != nil || p.closed {
				p.making = false
				p.mu.Unlock()
				_ = sandboxnet.Delete(context.Background(), e.pair(id))
				return // the next take tries again
			}
			p.ready = append(p.ready, id)
			p.mu.Unlock()
		}
	}()
}

// discardSpares ends the refill and removes the ready spare pairs; none is
// made or given afterwards. Errors: sandboxnet.Delete's.
func (e *Engine) discardSpares(ctx context.Context) error {
	p := &e.spares
	p.mu.Lock()
	p.closed = true
	ids := p.ready
	p.ready = nil
	p.mu.Unlock()
	if p.cancel != nil {
		p.cancel()
	}
	p.wg.Wait()
	var errs []string
	for _, id := range ids {
		if err := sandboxnet.Delete(ctx, e.pair(id)); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("gvisor: spare networks: %s", strings.Join(errs, "; "))
	}
	return nil
}

// SpareNetworks returns how many spare network pairs are ready and how many
// the engine has given to instances since it started.
func (e *Engine) SpareNetworks() (ready int, taken int64) {
	e.spares.mu.Lock()
	defer e.spares.mu.Unlock()
	return len(e.spares.ready), e.spares.taken
}
