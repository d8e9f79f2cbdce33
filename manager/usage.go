package manager

import (
	"context"
	"time"

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
