package manager

import (
	"context"
	"fmt"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Reconcile makes the database and the host agree after a start or a crash. Call it
// once, before serving. For every sandbox record:
//
//   - deleting: the delete is finished (instance stopped, record removed);
//   - running: if its engine instance still runs and its guest agent answers, it is
//     reattached; otherwise the instance is stopped and the sandbox is reported
//     error ("lost on server restart": its memory is gone);
//   - hibernating: runsc checkpoint runs in its own session and outlives a crashed
//     server, so first the checkpoint is waited for (finishInterruptedCheckpoints)
//     and, if the sandbox process exited after writing it, committed now. Then: if
//     the pending snapshot committed, the sandbox is hibernated on it; else if the
//     instance still runs it is running again; else error;
//   - resuming: a half-done restore is stopped; the sandbox is hibernated on its
//     snapshot, which is untouched by a restore;
//   - creating: the instance is stopped; error;
//   - paused: see reconcilePaused (pause.go): reattached paused if its instance
//     is alive, else hibernated on its pause's snapshot (error if none committed);
//   - hibernated, error: any instance is stopped.
//
// Then every engine instance that no running sandbox owns is stopped — among
// them the prepared instances a crashed server left (engine.RestorePreparer:
// listed under ids no sandbox has) and warm pools' ready clones, which have no
// records (pool.go; the pools refill once the server runs, RunPools) — and
// staged snapshots that never committed are removed.
func (m *Manager) Reconcile(ctx context.Context) error {
	m.finishInterruptedCheckpoints(ctx)
	if err := m.cfg.Store.Recover(ctx); err != nil {
		return fmt.Errorf("reconcile: snapshot store: %w", err)
	}
	// Every engine's instances, each recorded as its engine's (engOf).
	var infos []engine.Info
	for _, e := range m.cfg.Engines.All() {
		list, err := engineCalls{Engine: e, m: m}.List(ctx)
		if err != nil {
			return fmt.Errorf("reconcile: %w", err)
		}
		for _, i := range list {
			m.setInstanceEngine(i.ID, e.Name())
		}
		infos = append(infos, list...)
	}
	running, paused := map[string]bool{}, map[string]bool{}
	for _, i := range infos {
		if i.Running {
			running[i.ID] = true
		}
		if i.Paused {
			paused[i.ID] = true
		}
	}
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	keep := map[string]bool{}
	committed, _ := m.cfg.Store.List(ctx)
	isCommitted := map[string]bool{}
	for _, id := range committed {
		isCommitted[id] = true
	}
	for _, s := range all {
		if !m.reconcileOwner(ctx, s) {
			continue // another node's: an instance of it here is stopped below
		}
		if s.Deleting {
			if err := m.deleteLocked(ctx, s); err != nil {
				m.log.Warn("reconcile: finish delete", "sandbox", s.ID, "err", err)
			}
			continue
		}
		alive := s.Instance != "" && running[s.Instance]
		switch s.State {
		case sandbox.StatePaused:
			if m.reconcilePaused(ctx, s, alive, paused[s.Instance]) {
				keep[s.Instance] = true
			}
		case sandbox.StateRunning:
			if alive && paused[s.Instance] {
				// Paused by a pause whose record a crash cut short: its
				// agent answers only once it runs again.
				if p, ok := m.eng(s).Engine.(engine.Pauser); ok {
					_ = p.Unpause(ctx, s.Instance)
				}
			}
			if alive {
				if err := m.waitAgent(ctx, s); err == nil {
					keep[s.Instance] = true
					m.log.Info("reconcile: reattached", "sandbox", s.ID, "instance", s.Instance)
					continue
				}
			}
			m.lost(ctx, s, "lost on server restart: its sandbox process was gone or did not answer")
		case sandbox.StateHibernating:
			if s.PendingSnapshot != "" && isCommitted[s.PendingSnapshot] {
				m.finishHibernate(ctx, s)
			} else if alive && m.waitAgent(ctx, s) == nil {
				s.PendingSnapshot = ""
				keep[s.Instance] = true
				_ = m.setState(ctx, s, sandbox.StateRunning)
			} else {
				m.lost(ctx, s, "hibernate interrupted by server restart before its snapshot committed")
			}
		case sandbox.StateResuming:
			if s.Instance != "" {
				_ = m.eng(s).Stop(ctx, s.Instance)
			}
			s.Instance = ""
			_ = m.setState(ctx, s, sandbox.StateHibernated)
		case sandbox.StateCreating:
			m.lost(ctx, s, "create interrupted by server restart")
		default: // hibernated, error
			if s.Instance != "" && s.State == sandbox.StateHibernated {
				s.Instance = ""
				_ = m.cfg.DB.UpdateSandbox(ctx, s)
			}
		}
	}
	for _, i := range infos {
		if !keep[i.ID] {
			m.log.Info("reconcile: stopping orphaned instance", "instance", i.ID, "pid", i.Pid)
			if err := m.engOf(i.ID).Stop(ctx, i.ID); err != nil {
				m.log.Warn("reconcile: stop orphan", "instance", i.ID, "err", err)
			}
		}
	}
	// Snapshots committed in the store that no record knows (a crash between the
	// store's commit and the database's) are removed; none can be resumed.
	recs, err := m.cfg.DB.ListSnapshots(ctx)
	if err == nil {
		m.recordUploads(ctx, recs)
		known := map[string]bool{}
		for _, r := range recs {
			known[r.ID] = true
		}
		for _, id := range committed {
			if !known[id] {
				pending := false
				for _, s := range all {
					pending = pending || s.PendingSnapshot == id
				}
				if !pending && !m.mayBeAnotherNodes(ctx, id) {
					m.log.Warn("reconcile: deleting a committed snapshot no record of this server knows", "snapshot", id)
					_ = m.cfg.Store.Delete(ctx, id)
				}
			}
		}
	}
	m.collectSnapshots(ctx)
	return nil
}

// unrecordedSnapshotAge is how old a committed snapshot that no record knows
// must be before Reconcile deletes it on a shared database: younger, it may be
// another node's commit whose record (a sandbox's, or a pool template's) is
// being written that moment.
const unrecordedSnapshotAge = time.Hour

// mayBeAnotherNodes says whether committed snapshot id, which no record
// knows, may be a commit another node is recording now: on a shared database,
// one created less than unrecordedSnapshotAge ago (or whose manifest cannot
// be read) is left for a later start-up to delete.
func (m *Manager) mayBeAnotherNodes(ctx context.Context, id string) bool {
	if m.cfg.SingleNode {
		return false
	}
	man, err := m.cfg.Store.Manifest(ctx, id)
	if err != nil || time.Since(man.CreatedAt) < unrecordedSnapshotAge {
		m.log.Info("reconcile: keeping a recent committed snapshot no record knows yet (another node may be recording it)", "snapshot", id)
		return true
	}
	return false
}

// reconcileOwner says whether Reconcile handles s: a sandbox this node owns,
// or one no node owns. A record without owner that has an instance (written
// before sandboxes had owners) and, with Config.SingleNode, every record are
// claimed for this node first. Another node's sandbox (it may have been
// fenced off this node while it was away) is left alone, and its instance on
// this host, if any, is an orphan.
func (m *Manager) reconcileOwner(ctx context.Context, s *metadata.Sandbox) bool {
	switch {
	case s.Owner == m.cfg.Node:
		return true
	case s.Owner == "" && (s.State == sandbox.StateHibernated || s.State == sandbox.StateError):
		return true
	case s.Owner == "" || m.cfg.SingleNode:
		if err := m.claim(ctx, s); err != nil {
			m.log.Warn("reconcile: claim", "sandbox", s.ID, "err", err)
			return false
		}
		return true
	}
	return false
}

func (m *Manager) lost(ctx context.Context, s *metadata.Sandbox, why string) {
	if s.Instance != "" {
		_ = m.eng(s).Stop(ctx, s.Instance)
	}
	s.PendingSnapshot = ""
	m.fail(ctx, s, fmt.Errorf("%s", why))
}

// finishHibernate completes a hibernate whose snapshot committed before a crash.
func (m *Manager) finishHibernate(ctx context.Context, s *metadata.Sandbox) {
	if s.Instance != "" {
		_ = m.eng(s).Stop(ctx, s.Instance)
	}
	man, err := m.cfg.Store.Manifest(ctx, s.PendingSnapshot)
	if err != nil {
		m.lost(ctx, s, "hibernate interrupted: "+err.Error())
		return
	}
	s.SnapshotID = s.PendingSnapshot
	s.PendingSnapshot = ""
	s.Instance = ""
	s.State = sandbox.StateHibernated
	s.StateChangedAt = man.CreatedAt
	s.LastHibernateAt = &man.CreatedAt
	rec := m.snapshotRecord(ctx, man, s, man.HibernateMS, man.CreatedAt)
	if err := m.cfg.DB.CommitHibernate(ctx, rec, s); err != nil {
		m.log.Warn("reconcile: finish hibernate", "sandbox", s.ID, "err", err)
	}
}

// checkpointWait bounds how long Reconcile waits for a checkpoint that a crashed
// server left running (a 512 MiB checkpoint takes ~0.5–2.5 s here).
const checkpointWait = 2 * time.Minute

// finishInterruptedCheckpoints handles sandboxes a crash left in state hibernating
// with an uncommitted snapshot: it waits until the instance's sandbox process has
// exited (runsc checkpoint finished and stopped it) or its agent answers again (the
// checkpoint failed; the sandbox runs), and in the first case commits the staged
// checkpoint, so the hibernate the user asked for completes and no memory is lost.
// It runs before the store's Recover, which would remove the staged files.
func (m *Manager) finishInterruptedCheckpoints(ctx context.Context) {
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return
	}
	for _, s := range all {
		if s.Deleting || s.State != sandbox.StateHibernating || s.PendingSnapshot == "" || s.Instance == "" {
			continue
		}
		if !m.reconcileOwner(ctx, s) {
			continue
		}
		if _, err := m.cfg.Store.Manifest(ctx, s.PendingSnapshot); err == nil {
			continue // committed; Reconcile finishes it
		}
		if !m.waitCheckpointExit(ctx, s.Instance) {
			continue
		}
		man := m.manifestFor(s, m.eng(s), s.PendingSnapshot, time.Now().UTC())
		if _, err := m.cfg.Store.Commit(ctx, s.PendingSnapshot, man); err != nil {
			m.log.Warn("reconcile: interrupted hibernate could not be committed", "sandbox", s.ID, "snapshot", s.PendingSnapshot, "err", err)
			continue
		}
		m.log.Info("reconcile: committed a checkpoint a crash interrupted", "sandbox", s.ID, "snapshot", s.PendingSnapshot)
	}
	m.finishFencedCheckpoints(ctx)
}

// waitCheckpointExit waits (checkpointWait at most) until instance's
// sandbox process has exited (runsc checkpoint finished and stopped it: true)
// or its agent answers again (the checkpoint failed; the sandbox runs: false).
func (m *Manager) waitCheckpointExit(ctx context.Context, instance string) bool {
	deadline := time.Now().Add(checkpointWait)
	for time.Now().Before(deadline) {
		if !m.instanceRunning(ctx, instance) {
			return true
		}
		hctx, cancel := context.WithTimeout(ctx, time.Second)
		err := m.agentFor(instance).Health(hctx)
		cancel()
		if err == nil {
			return false
		}
		time.Sleep(200 * time.Millisecond)
	}
	return false
}

func (m *Manager) instanceRunning(ctx context.Context, instance string) bool {
	infos, err := m.engOf(instance).List(ctx)
	if err != nil {
		return true // unknown: keep waiting
	}
	for _, i := range infos {
		if i.ID == instance && i.Running {
			return true
		}
	}
	return false
}
