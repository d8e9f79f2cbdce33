package manager

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// The paused tier (docs/lifecycle.md).
//
// A running sandbox of hibernation mode memory whose engine is an
// engine.Pauser can be paused: its processes stop, its memory stays on the
// host, it uses no CPU, and the next request continues it in milliseconds
// (unpause: the same instance and generation; the guest is told by a resume
// event of kind "unpaused", which checks the wall clock and drops the SDKs'
// registered connections as a resume does).
//
//	running --pause--> paused --unpause (a request, resume)--> running
//	paused --demote (idle_timeout_s, the standby budget, hibernate)--> hibernated
//
// Crash safety. A pause is acknowledged only once a committed snapshot of the
// paused state exists: the engine pauses the instance, then checkpoints it with
// leaveRunning (it stays paused) into a new snapshot, which becomes the
// sandbox's SnapshotID. Demotion to hibernated is then only stopping the
// instance: nothing is captured on the way. After a host crash (the instance
// gone) Reconcile hibernates a paused sandbox on that snapshot, so the next
// request resumes it with everything it had when it paused; after a crash of
// the server alone the instance is still there, paused, and is reattached.
//
// The record's StateChangedAt is when the pause's snapshot was recorded; the
// standby budget demotes the sandboxes paused longest first.

// DefaultPauseAfterS is the pause_after_s of a sandbox that does not choose
// one, when its idle timeout is longer (else 0: it is hibernated without a
// pause first).
const DefaultPauseAfterS = 5

// pausable says whether s can be paused: mode memory on an engine.Pauser.
func (m *Manager) pausable(s *metadata.Sandbox) (engine.Pauser, error) {
	if s.HibernationMode != "" && s.HibernationMode != sandbox.ModeMemory {
		return nil, sandboxConflict(s.ID, "sandbox %s has hibernation mode %s; only a sandbox of mode memory can be paused", s.ID, s.HibernationMode)
	}
	p, ok := m.eng(s).Engine.(engine.Pauser)
	if !ok {
		return nil, sandboxConflict(s.ID, "sandbox %s runs on engine %s, which cannot pause", s.ID, m.eng(s).Name())
	}
	return p, nil
}

// canPause reports whether s's engine can pause (the idle loop does not try
// otherwise).
func (m *Manager) canPause(s *metadata.Sandbox) bool {
	_, ok := m.eng(s).Engine.(engine.Pauser)
	return ok
}

// pauseWindow is when an idle sandbox is paused: after pause_after_s idle
// seconds, when that comes before its idle timeout (0: never).
func pauseWindow(p sandbox.Policy) time.Duration {
	if p.PauseAfterS <= 0 || (p.HibernationMode != "" && p.HibernationMode != sandbox.ModeMemory) {
		return 0
	}
	if p.IdleTimeoutS > 0 && p.PauseAfterS >= p.IdleTimeoutS {
		return 0
	}
	return time.Duration(p.PauseAfterS) * time.Second
}

// PauseDrain is how long a pause waits for requests in flight to end: as long
// as a hibernate's drain (HibernateDrain).
const PauseDrain = HibernateDrain

// Pause pauses a running sandbox (POST /v1/sandboxes/{id}/pause): it returns
// once the instance is paused and a committed snapshot of the paused state is
// recorded. A paused sandbox is returned as it is (unchanged true). Errors:
// sandbox.ErrNotFound; sandbox.ErrConflict for a sandbox that is not running,
// not of mode memory, on an engine that cannot pause, or with requests still
// in flight after PauseDrain.
func (m *Manager) Pause(ctx context.Context, id string) (sb sandbox.Sandbox, unchanged bool, err error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	switch s.State {
	case sandbox.StatePaused:
		return m.view(ctx, s), true, nil
	case sandbox.StateRunning:
	default:
		return sandbox.Sandbox{}, false, sandboxConflict(id, "sandbox %s is in state %s; only a running sandbox can be paused", id, s.State)
	}
	ctx = context.WithoutCancel(ctx)
	if err := m.pauseLocked(ctx, s); err != nil {
		return m.view(ctx, s), false, err
	}
	return m.view(ctx, s), false, nil
}

// pauseLocked pauses running sandbox s and records a committed snapshot of its
// paused state. The state paused is persisted before the engine acts (a crash
// then finds the record paused and Reconcile settles it); on failure the
// instance is unpaused and s is running again. The caller holds s's lock.
//
// A pause first waits up to PauseDrain for proxied connections and exec
// streams in flight; if some are still open it is refused
// (sandbox.ErrConflict) and s keeps running.
func (m *Manager) pauseLocked(ctx context.Context, s *metadata.Sandbox) error {
	p, err := m.pausable(s)
	if err != nil {
		return err
	}
	// Requests in flight would hang in the paused sandbox until something
	// unpaused it (gVisor's netstack keeps their connections but no task
	// answers): wait for them as a hibernate does (the lock keeps new ones
	// out), and refuse the pause if some are still open at the end.
	if conns, execs := m.drain(s.ID, PauseDrain); conns+execs > 0 {
		return sandboxConflict(s.ID, "sandbox %s still has %d proxied connections and %d exec streams open after %s; not paused (they would hang until the next request): pause it when they are done, or hibernate it",
			s.ID, conns, execs, PauseDrain)
	}
	start := time.Now()
	if err := m.setState(ctx, s, sandbox.StatePaused); err != nil {
		return err
	}
	back := func(cause error) error {
		uctx, cancel := context.WithTimeout(ctx, m.cfg.EngineTimeouts.Stop)
		uerr := p.Unpause(uctx, s.Instance)
		cancel()
		if uerr != nil {
			m.dropLive(s.ID)
			_ = m.eng(s).Stop(ctx, s.Instance)
			m.fail(ctx, s, fmt.Errorf("%v; unpausing after it failed: %v", cause, uerr))
			return cause
		}
		_ = m.setState(ctx, s, sandbox.StateRunning)
		return cause
	}
	if err := m.eng(s).bound(ctx, m.cfg.EngineTimeouts.Stop, "pause", s.Instance, func(ctx context.Context) error {
		return p.Pause(ctx, s.Instance)
	}); err != nil {
		return back(fmt.Errorf("pause %s: %w", s.ID, err))
	}
	tPaused := time.Now()
	if _, err := m.snapshotLocked(ctx, s, true, m.cfg.AsyncUpload); err != nil {
		return back(fmt.Errorf("pause %s: snapshot of the paused state: %w", s.ID, err))
	}
	m.cfg.Metrics.pauses.Inc()
	m.log.Info("paused", "sandbox", s.ID, "pause_ms", tPaused.Sub(start).Milliseconds(),
		"total_ms", time.Since(start).Milliseconds(), "snapshot", s.SnapshotID)
	return nil
}

// unpauseLocked continues paused sandbox s: the engine unpauses its instance,
// the guest agent runs the resume contract as an unpause (same generation),
// and s is recorded running. An instance that is gone (the host's OOM killer,
// a kill) is demoted to hibernated on the pause's snapshot and resumed from it.
// The caller holds s's lock.
func (m *Manager) unpauseLocked(ctx context.Context, s *metadata.Sandbox) error {
	start := time.Now()
	p, ok := m.eng(s).Engine.(engine.Pauser)
	if !ok {
		return fmt.Errorf("unpause %s: engine %s cannot pause", s.ID, m.eng(s).Name())
	}
	err := m.eng(s).bound(ctx, m.cfg.EngineTimeouts.Stop, "unpause", s.Instance, func(ctx context.Context) error {
		return p.Unpause(ctx, s.Instance)
	})
	if errors.Is(err, engine.ErrNotRunning) {
		m.log.Warn("unpause: the paused instance is gone; resuming from the pause's snapshot", "sandbox", s.ID, "instance", s.Instance)
		if err := m.demoteLocked(ctx, s, "exited"); err != nil {
			return err
		}
		return m.resumeLocked(ctx, s)
	}
	if err != nil {
		return fmt.Errorf("unpause %s: %w", s.ID, err)
	}
	launched := time.Now()
	s.LastResume = m.contract(ctx, s, contractCall{gen: s.Generation, unpaused: true, snapshotID: s.SnapshotID}, launched)
	tRecord := time.Now()
	if err := m.setState(ctx, s, sandbox.StateRunning); err != nil {
		return err
	}
	m.touch(s.ID)
	m.cfg.Metrics.unpause.Observe(time.Since(start).Seconds())
	m.log.Info("unpaused", "sandbox", s.ID, "unpause_ms", msf(launched.Sub(start)), "contract_ms", msf(tRecord.Sub(launched)),
		"record_ms", msf(time.Since(tRecord)), "total_ms", msf(time.Since(start)), "window_ms", s.LastResume.WindowMS)
	return nil
}

// demoteLocked hibernates paused sandbox s on the snapshot its pause recorded:
// the instance is stopped (its memory freed) and s is hibernated. cause names
// why, for the metrics and the log. The caller holds s's lock.
func (m *Manager) demoteLocked(ctx context.Context, s *metadata.Sandbox, cause string) error {
	if s.SnapshotID == "" {
		return fmt.Errorf("demote %s: no snapshot of its paused state", s.ID)
	}
	m.dropLive(s.ID)
	inst := s.Instance
	if inst != "" {
		if err := m.eng(s).Stop(ctx, inst); err != nil {
			return fmt.Errorf("demote %s: %w", s.ID, err)
		}
	}
	now := time.Now().UTC()
	s.Instance = ""
	s.LastHibernateAt = &now
	if err := m.setState(ctx, s, sandbox.StateHibernated); err != nil {
		return err
	}
	m.cfg.Metrics.demotions.WithLabelValues(cause).Inc()
	m.log.Info("paused sandbox hibernated", "sandbox", s.ID, "cause", cause, "snapshot", s.SnapshotID, "instance", inst)
	return nil
}

// demote demotes sandbox id if it is still paused and, with idle set, still
// idle for its idle timeout.
func (m *Manager) demote(ctx context.Context, id, cause string, idle bool) error {
	return m.inState(ctx, id, sandbox.StatePaused, func(ctx context.Context, s *metadata.Sandbox) error {
		if idle && (s.IdleTimeoutS <= 0 || !m.stillIdle(id, s.Instance, time.Duration(s.IdleTimeoutS)*time.Second)) {
			return nil
		}
		return m.demoteLocked(ctx, s, cause)
	})
}

// pauseIdle pauses sandbox id if it is still running and idle for its pause
// window.
func (m *Manager) pauseIdle(ctx context.Context, id string) error {
	return m.inState(ctx, id, sandbox.StateRunning, func(ctx context.Context, s *metadata.Sandbox) error {
		w := pauseWindow(s.Policy)
		if w <= 0 || !m.stillIdle(id, s.Instance, w) {
			return nil
		}
		m.log.Info("idle: pausing", "sandbox", id, "pause_after_s", s.PauseAfterS, "idle_timeout_s", s.IdleTimeoutS)
		return m.pauseLocked(ctx, s)
	})
}

// inState takes sandbox id's lock and, if the sandbox is (still) in state st,
// calls f with it and a context that is not cancelled (the engine's work must
// finish). A sandbox gone or in another state is left alone (nil).
func (m *Manager) inState(ctx context.Context, id string, st sandbox.State, f func(context.Context, *metadata.Sandbox) error) error {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return nil
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil || s.State != st {
		return nil
	}
	return f(context.WithoutCancel(ctx), s)
}

// overBudget returns the paused sandboxes to demote so that the memory limits
// of those left paused add up to at most budgetMiB: the ones paused longest
// first (least recently used). budgetMiB 0 means no budget.
func overBudget(paused []*metadata.Sandbox, budgetMiB int) []string {
	if budgetMiB <= 0 {
		return nil
	}
	total := 0
	for _, s := range paused {
		total += s.MemoryMiB
	}
	sorted := append([]*metadata.Sandbox(nil), paused...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].StateChangedAt.Before(sorted[j].StateChangedAt) })
	var out []string
	for _, s := range sorted {
		if total <= budgetMiB {
			break
		}
		out = append(out, s.ID)
		total -= s.MemoryMiB
	}
	return out
}

// pauseCovered reports whether paused sandbox s's SnapshotID was taken of its
// paused state: committed no earlier than the pause was recorded. A crash
// between recording the pause and recording its snapshot leaves it false.
func (m *Manager) pauseCovered(ctx context.Context, s *metadata.Sandbox) bool {
	if s.SnapshotID == "" || s.PendingSnapshot != "" {
		return false
	}
	rec, err := m.cfg.DB.GetSnapshot(ctx, s.SnapshotID)
	if err != nil || rec == nil || rec.SandboxID != s.ID {
		return false
	}
	return !rec.CreatedAt.Before(s.StateChangedAt.Add(-time.Millisecond))
}

// reconcilePaused settles a sandbox recorded paused at start-up (Reconcile).
// alive and isPaused say whether its instance still runs and is paused. It
// returns whether the instance is kept.
//
//   - instance alive: it is paused again if it is not (a crash during an
//     unpause), a snapshot of the paused state is taken if none covers it (a
//     crash during the pause), and it stays paused;
//   - instance gone, the pause's snapshot committed: hibernated on it;
//   - instance gone, no such snapshot (the pause was never acknowledged): the
//     memory is lost, as for a running sandbox: error (an explicit resume
//     recovers it from its last snapshot, if any).
func (m *Manager) reconcilePaused(ctx context.Context, s *metadata.Sandbox, alive, isPaused bool) bool {
	covered := m.pauseCovered(ctx, s)
	if !alive {
		if covered {
			s.PendingSnapshot = ""
			if err := m.demoteLocked(ctx, s, "exited"); err == nil {
				m.log.Info("reconcile: paused sandbox's instance gone; hibernated on its pause's snapshot", "sandbox", s.ID, "snapshot", s.SnapshotID)
				return false
			}
		}
		m.lost(ctx, s, "lost on server restart: paused, its sandbox process was gone and no snapshot of the paused state had committed")
		return false
	}
	p, err := m.pausable(s)
	if err == nil && !isPaused {
		err = p.Pause(ctx, s.Instance)
		covered = false // it ran after its snapshot
	}
	if err == nil && !covered {
		s.PendingSnapshot = ""
		_, err = m.snapshotLocked(ctx, s, true, m.cfg.AsyncUpload)
	}
	if err != nil {
		m.log.Warn("reconcile: paused sandbox could not be settled", "sandbox", s.ID, "err", err)
		if m.pauseCovered(ctx, s) {
			s.PendingSnapshot = ""
			if m.demoteLocked(ctx, s, "exited") == nil {
				return false
			}
		}
		m.lost(ctx, s, "lost on server restart: paused, and its state could not be captured: "+err.Error())
		return false
	}
	// The agent does not answer while paused: its client is recorded
	// without a health check, and the instance followed.
	m.mu.Lock()
	m.live[s.ID] = m.agentFor(s.Instance)
	m.mu.Unlock()
	m.watch(s.ID, s.Instance)
	m.log.Info("reconcile: reattached a paused sandbox", "sandbox", s.ID, "instance", s.Instance)
	return true
}

// msf is d in milliseconds with microseconds, for logs.
func msf(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
