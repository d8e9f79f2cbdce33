package manager

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// EngineTimeouts bound the engine calls the manager makes, most of them while
// it holds a sandbox's lock: a hung engine (runsc stuck on a sandbox) fails
// the call with ErrEngineTimeout instead of holding the sandbox for good. Zero
// fields take the defaults below.
type EngineTimeouts struct {
	// Start and Restore bound booting an instance (default 60 s each); the
	// wait for its guest agent is AgentTimeout's.
	Start, Restore time.Duration
	// Checkpoint is the base bound of a checkpoint (default 60 s), to which
	// CheckpointPerGiB (default 30 s) is added per GiB of the sandbox's memory
	// limit: the image is written at disk speed.
	Checkpoint, CheckpointPerGiB time.Duration
	// Stop bounds removing an instance (default 30 s); Dial one connection to
	// a port in it (default 10 s); List one listing of the engine's instances
	// (default 30 s).
	Stop, Dial, List time.Duration
}

func (t EngineTimeouts) withDefaults() EngineTimeouts {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&t.Start, 60*time.Second)
	def(&t.Restore, 60*time.Second)
	def(&t.Checkpoint, 60*time.Second)
	def(&t.CheckpointPerGiB, 30*time.Second)
	def(&t.Stop, 30*time.Second)
	def(&t.Dial, 10*time.Second)
	def(&t.List, 30*time.Second)
	return t
}

// ErrEngineTimeout is wrapped by the error of an engine call that did not
// return within its EngineTimeouts bound.
var ErrEngineTimeout = errors.New("engine call timed out")

// engineCalls is one engine with the manager's deadlines on every call (Wait
// excepted: it lasts as long as the instance). memMiB scales the checkpoint's.
type engineCalls struct {
	engine.Engine
	m      *Manager
	memMiB int
}

// eng returns the engine that runs s's instance (the one that started or
// restored it; the default engine for an instance this process has not seen).
func (m *Manager) eng(s *metadata.Sandbox) engineCalls {
	c := m.engOf(s.Instance)
	c.memMiB = s.MemoryMiB
	return c
}

// engOf returns the engine of instance (see eng).
func (m *Manager) engOf(instance string) engineCalls {
	m.mu.Lock()
	name := m.instEngine[instance]
	m.mu.Unlock()
	e, ok := m.cfg.Engines.Get(name)
	if !ok {
		e = m.cfg.Engines.Default()
	}
	return engineCalls{Engine: e, m: m}
}

// on returns engine e for launching s's instance, and records that e runs it.
func (m *Manager) on(e engine.Engine, s *metadata.Sandbox) engineCalls {
	m.setInstanceEngine(s.Instance, e.Name())
	return engineCalls{Engine: e, m: m, memMiB: s.MemoryMiB}
}

func (m *Manager) setInstanceEngine(instance, name string) {
	m.mu.Lock()
	m.instEngine[instance] = name
	m.mu.Unlock()
}

// bound runs f with a deadline of d; an error after the deadline passed wraps
// ErrEngineTimeout and says which call on which instance.
func (c engineCalls) bound(ctx context.Context, d time.Duration, what, id string, f func(context.Context) error) error {
	cctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	err := f(cctx)
	if err != nil && ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: engine %s: %s %s: no answer within %s: %v", ErrEngineTimeout, c.Name(), what, id, d, err)
	}
	return err
}

func (c engineCalls) timeouts() EngineTimeouts { return c.m.cfg.EngineTimeouts }

func (c engineCalls) Start(ctx context.Context, spec engine.Spec) error {
	return c.bound(ctx, c.timeouts().Start, "start", spec.ID, func(ctx context.Context) error { return c.Engine.Start(ctx, spec) })
}

func (c engineCalls) Restore(ctx context.Context, spec engine.Spec, dir string) error {
	return c.bound(ctx, c.timeouts().Restore, "restore", spec.ID, func(ctx context.Context) error { return c.Engine.Restore(ctx, spec, dir) })
}

func (c engineCalls) checkpointTimeout() time.Duration {
	t := c.timeouts()
	return t.Checkpoint + time.Duration(int64(t.CheckpointPerGiB)*int64(c.memMiB)/1024)
}

func (c engineCalls) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	return c.bound(ctx, c.checkpointTimeout(), "checkpoint", id, func(ctx context.Context) error {
		return c.Engine.Checkpoint(ctx, id, dir, leaveRunning)
	})
}

// checkpointExit is engine.ExitCheckpointer's CheckpointExit when the engine
// has it (ok false otherwise, nothing done).
func (c engineCalls) checkpointExit(ctx context.Context, id, dir string) (ok bool, err error) {
	xc, ok := c.Engine.(engine.ExitCheckpointer)
	if !ok {
		return false, nil
	}
	return true, c.bound(ctx, c.checkpointTimeout(), "checkpoint", id, func(ctx context.Context) error {
		return xc.CheckpointExit(ctx, id, dir)
	})
}

func (c engineCalls) Stop(ctx context.Context, id string) error {
	err := c.bound(ctx, c.timeouts().Stop, "stop", id, func(ctx context.Context) error { return c.Engine.Stop(ctx, id) })
	if err == nil {
		c.m.forgetInstance(id)
	}
	return err
}

// forgetInstance drops the record of instance's engine (it is gone).
func (m *Manager) forgetInstance(instance string) {
	m.mu.Lock()
	delete(m.instEngine, instance)
	m.mu.Unlock()
}

func (c engineCalls) Dial(ctx context.Context, id string, port int) (net.Conn, error) {
	var conn net.Conn
	err := c.bound(ctx, c.timeouts().Dial, "dial", id, func(ctx context.Context) (err error) {
		conn, err = c.Engine.Dial(ctx, id, port)
		return err
	})
	return conn, err
}

func (c engineCalls) List(ctx context.Context) ([]engine.Info, error) {
	var infos []engine.Info
	err := c.bound(ctx, c.timeouts().List, "list", "", func(ctx context.Context) (err error) {
		infos, err = c.Engine.List(ctx)
		return err
	})
	return infos, err
}

// restoreEngine returns the engine that restores snapshot id, written by the
// engine and version its manifest man records. A snapshot no engine of this
// host can restore (another engine, or a version the engine cannot load: a
// runsc upgrade) is a sandbox.Error of kind Conflict wrapping engine.ErrIncompatible, "snapshot
// <id> was taken by runsc <X>, this host runs runsc <Y> (…)", before anything
// changes. A filesystem-layer snapshot needs only an engine of its name (it is
// unpacked into a fresh boot).
func (m *Manager) restoreEngine(id string, man snapshot.Manifest) (engine.Engine, error) {
	if isFilesystemManifest(man) {
		if e, ok := m.cfg.Engines.Get(man.Engine); ok {
			return e, nil
		}
	}
	e, err := m.cfg.Engines.CheckRestore(man.Engine, man.EngineVersion)
	if err != nil {
		return nil, &sandbox.Error{Kind: sandbox.Conflict, Err: fmt.Errorf("snapshot %s was %w", id, err)}
	}
	return e, nil
}
