package manager

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Kept snapshots: a sandbox's state saved for new sandboxes to start from
// (E2B's snapshots, docs/e2b.md). KeepSnapshot takes one of a running sandbox,
// which goes on running (the checkpoint a fork takes of its source), or keeps
// the memory snapshot a hibernated sandbox resumes from; the record is marked
// kept, so the snapshot outlives its sandbox's later hibernates and its
// deletion. StartFromSnapshot starts a new sandbox from one, as a fork clone
// of it. DeleteKeptSnapshot ends the keeping: the snapshot is deleted once no
// sandbox resumes from it.

// KeepSnapshot keeps the current state of sandbox id as a snapshot named name
// ("" = no name; names are unique among kept snapshots). A running sandbox is
// checkpointed and keeps running; a hibernated one keeps the snapshot it
// resumes from. Errors: sandbox.ErrNotFound; sandbox.ErrConflict for a
// sandbox in another state, one hibernated in mode filesystem (no memory to
// start from), one that mounts volumes, or a name taken.
func (m *Manager) KeepSnapshot(ctx context.Context, id, name string) (sandbox.KeptSnapshot, error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return sandbox.KeptSnapshot{}, err
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.KeptSnapshot{}, err
	}
	if len(s.Volumes) > 0 {
		return sandbox.KeptSnapshot{}, sandboxConflict(id, "sandbox %s mounts volumes (%s), which a snapshot does not hold", id, volumeNames(s.Volumes))
	}
	if name != "" {
		if _, err := m.cfg.DB.SnapshotByName(ctx, name); err == nil {
			return sandbox.KeptSnapshot{}, conflict("snapshot name %q: taken", name)
		}
	}
	ctx = context.WithoutCancel(ctx)
	snapID := s.SnapshotID
	switch s.State {
	case sandbox.StateRunning:
		if snapID, err = m.snapshotLocked(ctx, s, true, m.cfg.AsyncUpload); err != nil {
			return sandbox.KeptSnapshot{}, err
		}
	case sandbox.StateHibernated, sandbox.StatePaused:
		if m.isFilesystemSnapshot(ctx, snapID) {
			return sandbox.KeptSnapshot{}, sandboxConflict(id, "sandbox %s is hibernated in mode filesystem (no memory snapshot to keep)", id).WithHint("resume it first")
		}
	default:
		return sandbox.KeptSnapshot{}, sandboxConflict(id, "sandbox %s is in state %s; only a running or hibernated sandbox can be snapshotted", id, s.State)
	}
	if err := m.cfg.DB.SetSnapshotKept(ctx, snapID, true, name); errors.Is(err, metadata.ErrExists) {
		return sandbox.KeptSnapshot{}, conflict("snapshot name %q: taken", name)
	} else if err != nil {
		return sandbox.KeptSnapshot{}, err
	}
	m.touch(id)
	return m.GetKeptSnapshot(ctx, snapID)
}

// GetKeptSnapshot returns the kept snapshot whose id or name is ref. Errors:
// sandbox.ErrNotFound (also for a snapshot that is not kept).
func (m *Manager) GetKeptSnapshot(ctx context.Context, ref string) (sandbox.KeptSnapshot, error) {
	rec, err := m.cfg.DB.GetSnapshot(ctx, ref)
	if errors.Is(err, metadata.ErrNotFound) || (err == nil && !rec.Kept) {
		rec, err = m.cfg.DB.SnapshotByName(ctx, ref)
	}
	if errors.Is(err, metadata.ErrNotFound) {
		return sandbox.KeptSnapshot{}, notFound("snapshot", ref)
	}
	if err != nil {
		return sandbox.KeptSnapshot{}, err
	}
	return m.keptView(ctx, rec)
}

func (m *Manager) keptView(ctx context.Context, rec *metadata.Snapshot) (sandbox.KeptSnapshot, error) {
	users, err := m.cfg.DB.SnapshotUsers(ctx, rec.ID)
	if err != nil {
		return sandbox.KeptSnapshot{}, err
	}
	return sandbox.KeptSnapshot{Snapshot: m.snapView(ctx, rec, users), Name: rec.Name}, nil
}

// ListKeptSnapshots returns every kept snapshot, oldest first.
func (m *Manager) ListKeptSnapshots(ctx context.Context) ([]sandbox.KeptSnapshot, error) {
	recs, err := m.cfg.DB.ListSnapshots(ctx)
	if err != nil {
		return nil, err
	}
	var out []sandbox.KeptSnapshot
	for _, r := range recs {
		if !r.Kept {
			continue
		}
		v, err := m.keptView(ctx, r)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// DeleteKeptSnapshot ends the keeping of kept snapshot id: it is deleted now
// if no sandbox resumes from it, else once none does. Errors:
// sandbox.ErrNotFound (also for a snapshot that is not kept).
func (m *Manager) DeleteKeptSnapshot(ctx context.Context, id string) error {
	rec, err := m.cfg.DB.GetSnapshot(ctx, id)
	if errors.Is(err, metadata.ErrNotFound) || (err == nil && !rec.Kept) {
		return notFound("snapshot", id)
	}
	if err != nil {
		return err
	}
	ctx = context.WithoutCancel(ctx)
	if err := m.cfg.DB.SetSnapshotKept(ctx, id, false, ""); err != nil {
		return err
	}
	m.collectSnapshots(ctx)
	return nil
}

// StartFromSnapshot starts a new sandbox from kept snapshot snapID, as a fork
// clone of it (its own generation; the guest is told it is a clone). The
// image, memory and CPU limits are the snapshot's; the environment is the
// snapshot's with spec.Env over it; the policies and metadata are spec's
// (spec's Image, MemoryMiB, CPUs and Volumes must be left zero). Errors:
// sandbox.ErrNotFound for an unknown or not kept snapshot;
// sandbox.ErrInvalidArgument for a bad spec; sandbox.ErrSnapshotCorrupt; the
// restore's error (the sandbox is then left in state error).
func (m *Manager) StartFromSnapshot(ctx context.Context, snapID string, spec sandbox.Spec) (sandbox.Sandbox, error) {
	if spec.Image != "" || spec.MemoryMiB != 0 || spec.CPUs != 0 || len(spec.Volumes) > 0 {
		return sandbox.Sandbox{}, invalid("a sandbox started from snapshot %s has its image, memory, CPUs and no volumes", snapID)
	}
	if err := checkEnv(spec.Env); err != nil {
		return sandbox.Sandbox{}, err
	}
	if err := checkMetadata(spec.Metadata); err != nil {
		return sandbox.Sandbox{}, err
	}
	pol, err := m.createPolicy(ctx, spec)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	rec, err := m.cfg.DB.GetSnapshot(ctx, snapID)
	if errors.Is(err, metadata.ErrNotFound) || (err == nil && !rec.Kept) {
		return sandbox.Sandbox{}, notFound("snapshot", snapID)
	}
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	ctx = context.WithoutCancel(ctx)
	// A ready clone of the snapshot's warm pool, if it has one (pool.go).
	if sb, ok, err := m.startPooledFromSnapshot(ctx, rec, spec, pol); ok {
		return sb, err
	}
	dir, man, done, err := m.openSnapshot(ctx, snapID, "start from snapshot", snapID)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	defer done()
	if isFilesystemManifest(man) {
		return sandbox.Sandbox{}, conflict("snapshot %s holds a writable layer only (no memory to start from)", snapID)
	}
	e, err := m.restoreEngine(snapID, man)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	rootfs, err := m.snapshotImage(ctx, man.Spec.Image, man.Spec.ImageDigest)
	if err != nil {
		return sandbox.Sandbox{}, fmt.Errorf("start from snapshot %s: image %s: %w", snapID, man.Spec.ImageDigest, err)
	}
	env := maps.Clone(man.Spec.Env)
	if len(spec.Env) > 0 && env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, spec.Env)
	gen, err := m.cfg.DB.NextGeneration(ctx)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	now := time.Now().UTC()
	c := &metadata.Sandbox{
		ID: newID("sbx-"), State: sandbox.StateCreating, Image: man.Spec.Image, ImageDigest: man.Spec.ImageDigest,
		GuestDigest: man.Spec.GuestDigest, MemoryMiB: man.Spec.MemoryMiB, CPUs: man.Spec.CPUs, Env: env,
		Generation: gen, ForkedFrom: rec.SandboxID, SnapshotID: snapID, Seq: 1,
		Metadata: spec.Metadata, CreatedAt: now, StateChangedAt: now, Policy: pol, Owner: m.cfg.Node,
	}
	c.Instance = instanceID(c.ID, 1)
	if err := m.cfg.DB.CreateSandbox(ctx, c); err != nil {
		return sandbox.Sandbox{}, err
	}
	if err := m.startClone(ctx, e, c, m.restoreFrom(ctx, e, c, rootfs, dir)); err != nil {
		return m.view(ctx, c), fmt.Errorf("start from snapshot %s: %w", snapID, err)
	}
	m.writeResolvConf(ctx, c)
	m.cfg.Metrics.created.Inc()
	return m.view(ctx, c), nil
}
