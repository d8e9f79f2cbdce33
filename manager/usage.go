package manager

import (
	"context"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Metering. A sandbox record carries its usage accrued up to UsageAt (RunningMS,
// SnapshotByteS); every state change first accrues the interval since UsageAt
// under the state and snapshot it had during that interval (setState and the
// hibernate path call accrue), so usage is exact at transitions and persisted
// with them. Reads add the interval since UsageAt without writing.
//
//   - running time accrues only in state running (not creating, hibernating,
//     resuming, hibernated, error);
//   - snapshot byte-seconds accrue, in any state, for the snapshot the sandbox
//     holds (SnapshotID: the one it resumes from, kept while it runs until the
//     next hibernate replaces it). A snapshot shared by clones of one fork is
//     metered to each sandbox that holds it.

// accrue adds the usage of [s.UsageAt, now) to s (not persisted: the caller
// writes s).
func (m *Manager) accrue(ctx context.Context, s *metadata.Sandbox, now time.Time) {
	run, byteS := m.usageAt(ctx, s, now)
	s.RunningMS, s.SnapshotByteS = run, byteS
	if now.After(s.UsageAt) {
		s.UsageAt = now
	}
}

// usageAt returns s's running milliseconds and snapshot byte-seconds as of now.
func (m *Manager) usageAt(ctx context.Context, s *metadata.Sandbox, now time.Time) (int64, float64) {
	run, byteS := s.RunningMS, s.SnapshotByteS
	if s.UsageAt.IsZero() || !now.After(s.UsageAt) {
		return run, byteS
	}
	dt := now.Sub(s.UsageAt)
	if s.State == sandbox.StateRunning {
		run += dt.Milliseconds()
	}
	if s.SnapshotID != "" {
		if snap, err := m.cfg.DB.GetSnapshot(ctx, s.SnapshotID); err == nil {
			byteS += float64(snap.Bytes) * dt.Seconds()
		}
	}
	return run, byteS
}

// Sample returns what running or paused sandbox id's instance uses now, as its
// engine meters it (fields the engine cannot meter stay 0). It wakes neither a
// paused nor a hibernated sandbox. Errors: sandbox.ErrNotFound;
// sandbox.ErrConflict for a sandbox that has no instance (hibernated, being
// created, hibernated or resumed, in error); the engine's metering errors.
func (m *Manager) Sample(ctx context.Context, id string) (sandbox.ResourceSample, error) {
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.ResourceSample{}, err
	}
	if (s.State != sandbox.StateRunning && s.State != sandbox.StatePaused) || s.Instance == "" {
		return sandbox.ResourceSample{}, sandboxConflict(id, "sandbox %s is in state %s; only a running or paused sandbox is metered", id, s.State)
	}
	out := sandbox.ResourceSample{At: time.Now().UTC(), State: s.State, MemoryLimitBytes: int64(s.MemoryMiB) << 20}
	e := m.eng(s).Engine
	if cm, ok := e.(engine.CPUMeter); ok {
		if out.CPUTime, err = cm.CPUTime(s.Instance); err != nil {
			return sandbox.ResourceSample{}, err
		}
	}
	if mm, ok := e.(engine.MemoryMeter); ok {
		used, limit, err := mm.Memory(s.Instance)
		if err != nil {
			return sandbox.ResourceSample{}, err
		}
		out.MemoryBytes = used
		if limit > 0 {
			out.MemoryLimitBytes = limit
		}
	}
	return out, nil
}
