package manager

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Snapshot visibility (GET/DELETE /v1/snapshots…, verify) and retention
// (expires_at, checked by the lifecycle loop).

// snapshotRecord is the metadata record of a committed manifest for sandbox s:
// sizes from the manifest (a plain-file store has no chunks: its logical, stored
// and new bytes are all Bytes), hibernate time hibernateMS, created at. A
// snapshot that waits in this node's upload outbox records this node as its
// OutboxNode (outbox.go).
func (m *Manager) snapshotRecord(ctx context.Context, man snapshot.Manifest, s *metadata.Sandbox, hibernateMS int64, at time.Time) *metadata.Snapshot {
	rec := &metadata.Snapshot{ID: man.ID, SandboxID: s.ID, Parent: man.Parent, Bytes: man.Bytes,
		HibernateMS: hibernateMS, Engine: man.Engine + " " + man.EngineVersion, CreatedAt: at,
		OutboxNode: m.outboxNodeOf(ctx, man.ID)}
	return withSizes(rec, man)
}

// withSizes copies a committed manifest's sizes into its record. A plain-file
// store has no chunks: its logical, stored and new bytes are all Bytes.
func withSizes(rec *metadata.Snapshot, man snapshot.Manifest) *metadata.Snapshot {
	if man.LogicalBytes > 0 || man.StoredBytes > 0 {
		rec.LogicalBytes, rec.StoredBytes, rec.NewBytes = man.LogicalBytes, man.StoredBytes, man.NewBytes
	} else {
		rec.LogicalBytes, rec.StoredBytes, rec.NewBytes = man.Bytes, man.Bytes, man.Bytes
	}
	return rec
}

// snapView is a snapshot record as the API shows it. Records made before sizes
// were kept read them once from the store's manifest and keep them.
func (m *Manager) snapView(ctx context.Context, rec *metadata.Snapshot, users []string) sandbox.Snapshot {
	if rec.LogicalBytes == 0 && rec.StoredBytes == 0 {
		if man, err := m.cfg.Store.Manifest(ctx, rec.ID); err == nil {
			withSizes(rec, man)
			_ = m.cfg.DB.SetSnapshotSizes(ctx, rec.ID, rec.LogicalBytes, rec.StoredBytes, rec.NewBytes)
		}
	}
	v := sandbox.Snapshot{ID: rec.ID, SandboxID: rec.SandboxID, Bytes: rec.Bytes, HibernateMS: rec.HibernateMS,
		Engine: rec.Engine, CreatedAt: rec.CreatedAt,
		LogicalBytes: rec.LogicalBytes, StoredBytes: rec.StoredBytes, NewBytes: rec.NewBytes,
		Durable: true, UsedBy: users}
	if rec.Parent != "" {
		v.Parent = &rec.Parent
	}
	if as, ok := m.cfg.Store.(snapshot.AsyncStore); ok {
		// A store that cannot say (its backend is unreachable) is not claiming
		// durability; nor is a record that names the node whose outbox holds
		// it (this node's store knows nothing of another node's outbox).
		d, err := as.Durable(ctx, rec.ID)
		v.Durable = err == nil && d && rec.OutboxNode == ""
	}
	if rec.StoredBytes > 0 {
		v.DedupRatio = float64(rec.LogicalBytes) / float64(rec.StoredBytes)
	}
	if owner, err := m.cfg.DB.GetSandbox(ctx, rec.SandboxID); err == nil {
		v.ExpiresAt = owner.ExpiresAt
	}
	return v
}

func (m *Manager) getSnapshot(ctx context.Context, id string) (*metadata.Snapshot, error) {
	rec, err := m.cfg.DB.GetSnapshot(ctx, id)
	if errors.Is(err, metadata.ErrNotFound) {
		return nil, notFound("snapshot", id)
	}
	return rec, err
}

// ListSnapshots returns every committed snapshot, oldest first.
func (m *Manager) ListSnapshots(ctx context.Context) ([]sandbox.Snapshot, error) {
	recs, err := m.cfg.DB.ListSnapshots(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Snapshot, 0, len(recs))
	for _, r := range recs {
		users, err := m.cfg.DB.SnapshotUsers(ctx, r.ID)
		if err != nil {
			return nil, err
		}
		out = append(out, m.snapView(ctx, r, users))
	}
	return out, nil
}

// StoreUsage returns the snapshot store's footprint (kind left empty for the
// caller): snapshot count and logical bytes from the database, the rest from
// the store (UsageOf). Errors: database and local directory reads.
func (m *Manager) StoreUsage(ctx context.Context) (sandbox.StoreUsage, error) {
	recs, err := m.cfg.DB.ListSnapshots(ctx)
	if err != nil {
		return sandbox.StoreUsage{}, err
	}
	var logical int64
	for _, r := range recs {
		if r.LogicalBytes > 0 {
			logical += r.LogicalBytes
		} else {
			logical += r.Bytes
		}
	}
	return UsageOf(ctx, m.cfg.Store, len(recs), logical)
}

// UsageOf is the footprint of store st holding snapshots snapshots of logical
// bytes in all: stored, chunk, pending-upload and local bytes come from st when
// it reports them (snapshot.UsageReporter), else stay 0. Errors: st's Usage.
func UsageOf(ctx context.Context, st snapshot.Store, snapshots int, logical int64) (sandbox.StoreUsage, error) {
	u := sandbox.StoreUsage{Snapshots: snapshots, LogicalBytes: logical}
	if ur, ok := st.(snapshot.UsageReporter); ok {
		su, err := ur.Usage(ctx)
		if err != nil {
			return u, fmt.Errorf("snapshot store usage: %w", err)
		}
		u.StoredBytes, u.ChunkBytes, u.Chunks, u.Packs = su.StoredBytes, su.ChunkBytes, su.Chunks, su.Packs
		u.PendingUploadBytes, u.LocalBytes = su.PendingUploadBytes, su.LocalBytes
	}
	if u.StoredBytes > 0 {
		u.DedupRatio = float64(u.LogicalBytes) / float64(u.StoredBytes)
	}
	return u, nil
}

// GetSnapshot returns one snapshot. Errors: sandbox.ErrNotFound.
func (m *Manager) GetSnapshot(ctx context.Context, id string) (sandbox.Snapshot, error) {
	rec, err := m.getSnapshot(ctx, id)
	if err != nil {
		return sandbox.Snapshot{}, err
	}
	users, err := m.cfg.DB.SnapshotUsers(ctx, id)
	if err != nil {
		return sandbox.Snapshot{}, err
	}
	return m.snapView(ctx, rec, users), nil
}

// DeleteSnapshot deletes a snapshot from the store and the database. Errors:
// sandbox.ErrNotFound; sandbox.ErrConflict while a sandbox resumes from it or is writing it.
func (m *Manager) DeleteSnapshot(ctx context.Context, id string) error {
	rec, err := m.getSnapshot(ctx, id)
	if err != nil {
		return err
	}
	// The owner's lock keeps its hibernate and fork calls out while we check.
	unlock, err := m.lock(ctx, rec.SandboxID)
	if err != nil {
		return err
	}
	defer unlock()
	// Again under the lock: of concurrent deletes of one snapshot, the later
	// ones find it gone (404) instead of all answering 204.
	if _, err := m.getSnapshot(ctx, id); err != nil {
		return err
	}
	users, err := m.cfg.DB.SnapshotUsers(ctx, id)
	if err != nil {
		return err
	}
	if len(users) > 0 {
		return conflict("snapshot %s is in use: sandbox %s resumes from it (delete the sandbox instead)", id, users[0])
	}
	pools, err := m.cfg.DB.ListPools(ctx)
	if err != nil {
		return err
	}
	for _, p := range pools {
		if p.SnapshotID == id {
			return conflict("snapshot %s is the template of the warm pool of %s %s", id, p.Kind, p.Name).
				WithHint("set that pool's size to 0 first")
		}
	}
	ctx = context.WithoutCancel(ctx)
	if err := m.cfg.Store.Delete(ctx, id); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	// A collection may have removed the record meanwhile: it is gone either way.
	if err := m.cfg.DB.DeleteSnapshot(ctx, id); err != nil && !errors.Is(err, metadata.ErrNotFound) {
		return err
	}
	return nil
}

// VerifySnapshot reads every byte of a snapshot and checks its hashes. Errors:
// sandbox.ErrNotFound; sandbox.ErrSnapshotCorrupt naming the file (and chunk) that failed.
func (m *Manager) VerifySnapshot(ctx context.Context, id string) (sandbox.VerifyResult, error) {
	if _, err := m.getSnapshot(ctx, id); err != nil {
		return sandbox.VerifyResult{}, err
	}
	var man snapshot.Manifest
	var err error
	if v, ok := m.cfg.Store.(snapshot.Verifier); ok {
		man, err = v.Verify(ctx, id)
	} else {
		_, man, err = m.cfg.Store.Open(ctx, id)
	}
	var ce *snapshot.CorruptError
	switch {
	case errors.As(err, &ce):
		return sandbox.VerifyResult{}, corrupt("", "", err)
	case errors.Is(err, snapshot.ErrNotFound):
		return sandbox.VerifyResult{}, corrupt("", "", fmt.Errorf("snapshot %s is recorded but missing from the store: %v", id, err))
	case errors.As(err, new(*snapshot.KeyError)):
		return sandbox.VerifyResult{}, wrongKey("", "", err)
	case err != nil:
		return sandbox.VerifyResult{}, err
	}
	return sandbox.VerifyResult{OK: true, Files: len(man.Files), Bytes: man.Bytes}, nil
}

// expired says whether a sandbox's retention has run out at now.
func expired(s *metadata.Sandbox, now time.Time) bool {
	return s.ExpiresAt != nil && !now.Before(*s.ExpiresAt)
}

// expire deletes a hibernated sandbox whose expires_at has passed, with
// the snapshots nothing else uses. A sandbox in any other state is left alone
// (the lifecycle loop checks it again once it is hibernated).
func (m *Manager) expire(ctx context.Context, id string) error {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return nil
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil || s.State != sandbox.StateHibernated || !expired(s, time.Now()) {
		return nil
	}
	m.log.Info("retention: deleting expired hibernated sandbox", "sandbox", id, "expires_at", s.ExpiresAt.Format(time.RFC3339))
	return m.deleteLocked(context.WithoutCancel(ctx), s)
}
