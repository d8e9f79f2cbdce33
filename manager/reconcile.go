package manager

import (
	"context"
	"fmt"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/metadata"
)

// Reconcile makes the database and the host agree after a start or a crash. Call it
// once, before serving. For every sandbox record:
//
//   - deleting: the delete is finished (instance stopped, record removed);
//   - running: if its engine instance still runs and its guest agent answers, it is
//     reattached; otherwise the instance is stopped and the sandbox is reported
//     error ("lost on server restart": its memory is gone);
//   - hibernating: if the pending snapshot committed, the sandbox is hibernated on
//     it; else if the instance still runs it is running again; else error;
//   - resuming: a half-done restore is stopped; the sandbox is hibernated on its
//     snapshot, which is untouched by a restore;
//   - creating: the instance is stopped; error;
//   - hibernated, error: any instance is stopped.
//
// Then every engine instance that no running sandbox owns is stopped, and staged
// snapshots that never committed are removed.
func (m *Manager) Reconcile(ctx context.Context) error {
	if err := m.cfg.Store.Recover(ctx); err != nil {
		return fmt.Errorf("reconcile: snapshot store: %w", err)
	}
	infos, err := m.cfg.Engine.List(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	running := map[string]bool{}
	for _, i := range infos {
		if i.Running {
			running[i.ID] = true
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
		if s.Deleting {
			if err := m.deleteLocked(ctx, s); err != nil {
				m.log.Warn("reconcile: finish delete", "sandbox", s.ID, "err", err)
			}
			continue
		}
		alive := s.Instance != "" && running[s.Instance]
		switch s.State {
		case apiv1.StateRunning:
			if alive {
				if err := m.waitAgent(ctx, s); err == nil {
					keep[s.Instance] = true
					m.log.Info("reconcile: reattached", "sandbox", s.ID, "instance", s.Instance)
					continue
				}
			}
			m.lost(ctx, s, "lost on server restart: its sandbox process was gone or did not answer")
		case apiv1.StateHibernating:
			if s.PendingSnapshot != "" && isCommitted[s.PendingSnapshot] {
				m.finishHibernate(ctx, s)
			} else if alive && m.waitAgent(ctx, s) == nil {
				s.PendingSnapshot = ""
				keep[s.Instance] = true
				_ = m.setState(ctx, s, apiv1.StateRunning)
			} else {
				m.lost(ctx, s, "hibernate interrupted by server restart before its snapshot committed")
			}
		case apiv1.StateResuming:
			if s.Instance != "" {
				_ = m.cfg.Engine.Stop(ctx, s.Instance)
			}
			s.Instance = ""
			_ = m.setState(ctx, s, apiv1.StateHibernated)
		case apiv1.StateCreating:
			m.lost(ctx, s, "create interrupted by server restart")
		default: // hibernated, error
			if s.Instance != "" && s.State == apiv1.StateHibernated {
				s.Instance = ""
				_ = m.cfg.DB.PutSandbox(ctx, s)
			}
		}
	}
	for _, i := range infos {
		if !keep[i.ID] {
			m.log.Info("reconcile: stopping orphaned instance", "instance", i.ID, "pid", i.Pid)
			if err := m.cfg.Engine.Stop(ctx, i.ID); err != nil {
				m.log.Warn("reconcile: stop orphan", "instance", i.ID, "err", err)
			}
		}
	}
	// Snapshots committed in the store that no record knows (a crash between the
	// store's commit and the database's) are removed; none can be resumed.
	known, err := m.cfg.DB.SnapshotIDs(ctx)
	if err == nil {
		for _, id := range committed {
			if !known[id] {
				pending := false
				for _, s := range all {
					pending = pending || s.PendingSnapshot == id
				}
				if !pending {
					_ = m.cfg.Store.Delete(ctx, id)
				}
			}
		}
	}
	m.collectSnapshots(ctx)
	return nil
}

func (m *Manager) lost(ctx context.Context, s *metadata.Sandbox, why string) {
	if s.Instance != "" {
		_ = m.cfg.Engine.Stop(ctx, s.Instance)
	}
	s.PendingSnapshot = ""
	m.fail(ctx, s, fmt.Errorf("%s", why))
}

// finishHibernate completes a hibernate whose snapshot committed before a crash.
func (m *Manager) finishHibernate(ctx context.Context, s *metadata.Sandbox) {
	if s.Instance != "" {
		_ = m.cfg.Engine.Stop(ctx, s.Instance)
	}
	man, err := m.cfg.Store.Manifest(ctx, s.PendingSnapshot)
	if err != nil {
		m.lost(ctx, s, "hibernate interrupted: "+err.Error())
		return
	}
	s.SnapshotID = s.PendingSnapshot
	s.PendingSnapshot = ""
	s.Instance = ""
	s.State = apiv1.StateHibernated
	s.StateChangedAt = man.CreatedAt
	s.LastHibernateAt = &man.CreatedAt
	rec := &metadata.Snapshot{ID: man.ID, SandboxID: s.ID, Parent: man.Parent, Bytes: man.Bytes,
		HibernateMS: man.HibernateMS, Engine: man.Engine + " " + man.EngineVersion, CreatedAt: man.CreatedAt}
	if err := m.cfg.DB.CommitHibernate(ctx, rec, s); err != nil {
		m.log.Warn("reconcile: finish hibernate", "sandbox", s.ID, "err", err)
	}
}
