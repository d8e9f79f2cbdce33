package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// sandboxCols are the columns of a sandbox record, in the order of
// sandboxValues and scanSandbox; id first, then the written ones, lease_token
// and version last.
var sandboxCols = []string{"id", "state", "image", "image_digest", "guest_digest", "memory_mib", "cpus", "env", "generation",
	"forked_from", "snapshot_id", "pending_snapshot", "instance", "seq", "error", "deleting", "created_at",
	"state_changed_at", "last_hibernate_at", "last_resume_at", "resume_ms", "last_resume",
	"idle_timeout_s", "timeout_s", "on_timeout", "hibernation_mode", "on_resume", "volumes",
	"running_ms", "timeout_base_ms", "snapshot_byte_s", "usage_at", "expires_at", "metadata", "resume_on_request", "pids_limit", "network", "pause_after_s",
	"owner", "snapshot_node", "lease_token", "version"}

var (
	sandboxSelect = `SELECT ` + strings.Join(sandboxCols, ", ") + ` FROM sandboxes`
	sandboxInsert = `INSERT INTO sandboxes (` + strings.Join(sandboxCols, ", ") + `) VALUES (` +
		strings.TrimSuffix(strings.Repeat("?,", len(sandboxCols)), ",") + `) ON CONFLICT(id) DO NOTHING`
	// sandboxSet sets every column but id, lease_token and version from the
	// values (sandboxValues without the first and the last two), then
	// version+1.
	sandboxSet = func() string {
		var set []string
		for _, c := range sandboxCols[1 : len(sandboxCols)-2] {
			set = append(set, c+" = ?")
		}
		return `UPDATE sandboxes SET ` + strings.Join(set, ", ") + `, version = version + 1`
	}()
	// sandboxUpdate writes the record where id, version and lease token are
	// the record's; sandboxClaim where id and version are, with the next
	// lease token.
	sandboxUpdate = sandboxSet + ` WHERE id = ? AND version = ? AND lease_token = ?`
	sandboxClaim  = sandboxSet + `, lease_token = lease_token + 1 WHERE id = ? AND version = ?`
)

// sandboxValues are s's column values in the order of sandboxCols.
func (st *Store) sandboxValues(s *metadata.Sandbox) []any {
	j := encodeJSON(s)
	p, mt := s.Policy, s.Meter
	mode, onTimeout := storedPolicy(p)
	return []any{s.ID, string(s.State), s.Image, s.ImageDigest, s.GuestDigest, s.MemoryMiB, s.CPUs, j.env,
		s.Generation, s.ForkedFrom, s.SnapshotID, s.PendingSnapshot, s.Instance, s.Seq, s.Error,
		s.Deleting, st.ts(s.CreatedAt), st.ts(s.StateChangedAt), st.tsp(s.LastHibernateAt), st.tsp(s.LastResumeAt), s.ResumeMS,
		st.orNone(j.lastResume), p.IdleTimeoutS, p.TimeoutS, onTimeout, mode, st.orNone(j.onResume), st.orNone(j.volumes),
		mt.RunningMS, mt.TimeoutBaseMS, mt.SnapshotByteS, st.tsOrNone(mt.UsageAt), st.tspOrNone(p.ExpiresAt), st.orNone(j.metadata),
		p.ResumeOnRequest, s.PidsLimit, st.orNone(j.network), p.PauseAfterS, s.Owner, s.SnapshotNode, s.LeaseToken, s.Version}
}

func scanSandbox(r scanner) (*metadata.Sandbox, error) {
	var s metadata.Sandbox
	var state, env, created, changed string
	var lastH, lastR, usageAt, expiresAt, lastResume, onResume, volumes, md, network sql.NullString
	p, mt := &s.Policy, &s.Meter
	err := r.Scan(&s.ID, &state, &s.Image, &s.ImageDigest, &s.GuestDigest, &s.MemoryMiB, &s.CPUs, &env,
		&s.Generation, &s.ForkedFrom, &s.SnapshotID, &s.PendingSnapshot, &s.Instance, &s.Seq, &s.Error,
		&s.Deleting, &created, &changed, &lastH, &lastR, &s.ResumeMS, &lastResume,
		&p.IdleTimeoutS, &p.TimeoutS, &p.OnTimeout, &p.HibernationMode, &onResume, &volumes,
		&mt.RunningMS, &mt.TimeoutBaseMS, &mt.SnapshotByteS, &usageAt, &expiresAt, &md, &p.ResumeOnRequest, &s.PidsLimit, &network, &p.PauseAfterS,
		&s.Owner, &s.SnapshotNode, &s.LeaseToken, &s.Version)
	if err != nil {
		return nil, err
	}
	s.State = sandbox.State(state)
	jsonColumns{env: env, lastResume: lastResume.String, onResume: onResume.String, volumes: volumes.String,
		metadata: md.String, network: network.String}.decode(&s)
	s.CreatedAt, s.StateChangedAt = parseTS(created), parseTS(changed)
	s.LastHibernateAt, s.LastResumeAt, p.ExpiresAt = parseTSp(lastH), parseTSp(lastR), parseTSp(expiresAt)
	if t := parseTSp(usageAt); t != nil {
		mt.UsageAt = *t
	}
	return &s, nil
}

// CreateSandbox implements metadata.Sandboxes.
func (st *Store) CreateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	c := *s
	c.Version, c.LeaseToken = 1, 0
	if c.Owner != "" {
		c.LeaseToken = 1
	}
	res, err := st.exec(ctx, st.db, sandboxInsert, st.sandboxValues(&c)...)
	if err != nil {
		return fmt.Errorf("metadata: create sandbox %s: %w", s.ID, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrExists)
	}
	s.Version, s.LeaseToken = 1, c.LeaseToken
	return nil
}

// GetSandbox implements metadata.Sandboxes.
func (st *Store) GetSandbox(ctx context.Context, id string) (*metadata.Sandbox, error) {
	s, err := scanSandbox(st.row(ctx, st.db, sandboxSelect+` WHERE id = ?`, id))
	if err != nil {
		return nil, notFound(err, "sandbox", id)
	}
	return s, nil
}

// ListSandboxes implements metadata.Sandboxes.
func (st *Store) ListSandboxes(ctx context.Context) ([]*metadata.Sandbox, error) {
	out, err := queryList(ctx, st, "list sandboxes", sandboxSelect+` ORDER BY created_at, id`, scanSandbox)
	oldestFirst(out, func(s *metadata.Sandbox) (time.Time, string) { return s.CreatedAt, s.ID })
	return out, err
}

// updateSandbox writes s in x if its stored version is s.Version and its
// stored lease token s.LeaseToken; the caller advances s.Version once the
// write is committed.
func (st *Store) updateSandbox(ctx context.Context, x execer, s *metadata.Sandbox) error {
	vals := st.sandboxValues(s)
	args := append(vals[1:len(vals)-2:len(vals)-2], s.ID, s.Version, s.LeaseToken)
	res, err := st.exec(ctx, x, sandboxUpdate, args...)
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	if n, _ := res.RowsAffected(); n == 1 {
		return nil
	}
	var stored, token int64
	var owner string
	err = st.row(ctx, x, `SELECT version, lease_token, owner FROM sandboxes WHERE id = ?`, s.ID).Scan(&stored, &token, &owner)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	if token != s.LeaseToken {
		return fmt.Errorf("sandbox %s lease token %d (stored: %d, owner %q): %w", s.ID, s.LeaseToken, token, owner, metadata.ErrFenced)
	}
	return fmt.Errorf("sandbox %s version %d (stored: %d): %w", s.ID, s.Version, stored, metadata.ErrStale)
}

// ClaimSandbox implements metadata.Sandboxes.
func (st *Store) ClaimSandbox(ctx context.Context, s *metadata.Sandbox) error {
	var token int64
	err := st.inTx(ctx, "claim sandbox "+s.ID, func(tx *sql.Tx) error {
		vals := st.sandboxValues(s)
		args := append(vals[1:len(vals)-2:len(vals)-2], s.ID, s.Version)
		res, err := st.exec(ctx, tx, sandboxClaim, args...)
		if err != nil {
			return fmt.Errorf("metadata: claim sandbox %s: %w", s.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			var stored int64
			err := st.row(ctx, tx, `SELECT version FROM sandboxes WHERE id = ?`, s.ID).Scan(&stored)
			if errors.Is(err, sql.ErrNoRows) {
				return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrNotFound)
			}
			if err != nil {
				return fmt.Errorf("metadata: claim sandbox %s: %w", s.ID, err)
			}
			return fmt.Errorf("claim of sandbox %s version %d (stored: %d): %w", s.ID, s.Version, stored, metadata.ErrStale)
		}
		if err := st.row(ctx, tx, `SELECT lease_token FROM sandboxes WHERE id = ?`, s.ID).Scan(&token); err != nil {
			return fmt.Errorf("metadata: claim sandbox %s: %w", s.ID, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	s.Version++
	s.LeaseToken = token
	return nil
}

// UpdateSandbox implements metadata.Sandboxes.
func (st *Store) UpdateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	if err := st.updateSandbox(ctx, st.db, s); err != nil {
		return err
	}
	s.Version++
	return nil
}

// DeleteSandbox implements metadata.Sandboxes.
func (st *Store) DeleteSandbox(ctx context.Context, id string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM sandboxes WHERE id = ?`, id)
	return deleted(res, err, "sandbox", id)
}

// BeginRestore implements metadata.Sandboxes.
func (st *Store) BeginRestore(ctx context.Context, s *metadata.Sandbox) (int64, error) {
	var gen int64
	err := st.inTx(ctx, "begin restore "+s.ID, func(tx *sql.Tx) error {
		var err error
		if gen, err = st.nextGeneration(ctx, tx); err != nil {
			return err
		}
		return st.updateSandbox(ctx, tx, s)
	})
	if err != nil {
		return 0, err
	}
	s.Version++
	return gen, nil
}

// CommitHibernate implements metadata.Sandboxes.
func (st *Store) CommitHibernate(ctx context.Context, snap *metadata.Snapshot, s *metadata.Sandbox) error {
	err := st.inTx(ctx, "commit hibernate "+s.ID, func(tx *sql.Tx) error {
		res, err := st.exec(ctx, tx, `INSERT INTO snapshots (`+snapshotCols+`) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO NOTHING`,
			snap.ID, snap.SandboxID, snap.Parent, snap.Bytes, snap.HibernateMS, snap.Engine, st.ts(snap.CreatedAt),
			snap.LogicalBytes, snap.StoredBytes, snap.NewBytes, snap.Kept, snapName(snap), snap.OutboxNode)
		if err != nil {
			return fmt.Errorf("metadata: put snapshot %s: %w", snap.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return fmt.Errorf("snapshot %s: %w", snap.ID, metadata.ErrExists)
		}
		return st.updateSandbox(ctx, tx, s)
	})
	if err != nil {
		return err
	}
	s.Version++
	return nil
}

// SnapshotUsers implements metadata.Sandboxes.
func (st *Store) SnapshotUsers(ctx context.Context, id string) ([]string, error) {
	return queryList(ctx, st, "snapshot users "+id,
		`SELECT id FROM sandboxes WHERE snapshot_id = ? OR pending_snapshot = ? ORDER BY id`, scanString, id, id)
}

// snapshots

const snapshotCols = `id, sandbox_id, parent, bytes, hibernate_ms, engine, created_at, logical_bytes, stored_bytes, new_bytes, kept, name, outbox_node`

func scanSnapshot(r scanner) (*metadata.Snapshot, error) {
	var s metadata.Snapshot
	var created string
	if err := r.Scan(&s.ID, &s.SandboxID, &s.Parent, &s.Bytes, &s.HibernateMS, &s.Engine, &created,
		&s.LogicalBytes, &s.StoredBytes, &s.NewBytes, &s.Kept, &s.Name, &s.OutboxNode); err != nil {
		return nil, err
	}
	s.CreatedAt = parseTS(created)
	return &s, nil
}

// GetSnapshot implements metadata.Snapshots.
func (st *Store) GetSnapshot(ctx context.Context, id string) (*metadata.Snapshot, error) {
	s, err := scanSnapshot(st.row(ctx, st.db, `SELECT `+snapshotCols+` FROM snapshots WHERE id = ?`, id))
	if err != nil {
		return nil, notFound(err, "snapshot", id)
	}
	return s, nil
}

// ListSnapshots implements metadata.Snapshots.
func (st *Store) ListSnapshots(ctx context.Context) ([]*metadata.Snapshot, error) {
	out, err := queryList(ctx, st, "list snapshots", `SELECT `+snapshotCols+` FROM snapshots ORDER BY created_at, id`, scanSnapshot)
	oldestFirst(out, func(s *metadata.Snapshot) (time.Time, string) { return s.CreatedAt, s.ID })
	return out, err
}

// SetSnapshotSizes implements metadata.Snapshots.
func (st *Store) SetSnapshotSizes(ctx context.Context, id string, logical, stored, newBytes int64) error {
	res, err := st.exec(ctx, st.db, `UPDATE snapshots SET logical_bytes = ?, stored_bytes = ?, new_bytes = ? WHERE id = ?`,
		logical, stored, newBytes, id)
	if err != nil {
		return fmt.Errorf("metadata: set snapshot sizes %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("snapshot %s: %w", id, metadata.ErrNotFound)
	}
	return nil
}

// SetSnapshotUploaded implements metadata.Snapshots.
func (st *Store) SetSnapshotUploaded(ctx context.Context, id string) error {
	res, err := st.exec(ctx, st.db, `UPDATE snapshots SET outbox_node = '' WHERE id = ?`, id)
	if err != nil {
		return fmt.Errorf("metadata: set snapshot %s uploaded: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("snapshot %s: %w", id, metadata.ErrNotFound)
	}
	return nil
}

// UnreferencedSnapshots implements metadata.Snapshots.
func (st *Store) UnreferencedSnapshots(ctx context.Context) ([]string, error) {
	return queryList(ctx, st, "unreferenced snapshots", `SELECT id FROM snapshots WHERE id NOT IN
		(SELECT snapshot_id FROM sandboxes UNION SELECT pending_snapshot FROM sandboxes UNION SELECT snapshot_id FROM pools)
		AND NOT kept ORDER BY id`, scanString)
}

// snapName is the name a snapshot record is stored with: only a kept one has one.
func snapName(s *metadata.Snapshot) string {
	if !s.Kept {
		return ""
	}
	return s.Name
}

// SetSnapshotKept implements metadata.Snapshots.
func (st *Store) SetSnapshotKept(ctx context.Context, id string, kept bool, name string) error {
	if !kept {
		name = ""
	}
	res, err := st.exec(ctx, st.db, `UPDATE snapshots SET kept = ?, name = ? WHERE id = ?`, kept, name, id)
	if err != nil {
		if st.d.Unique(err) {
			return fmt.Errorf("snapshot name %q: %w", name, metadata.ErrExists)
		}
		return fmt.Errorf("metadata: keep snapshot %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("snapshot %s: %w", id, metadata.ErrNotFound)
	}
	return nil
}

// SnapshotByName implements metadata.Snapshots.
func (st *Store) SnapshotByName(ctx context.Context, name string) (*metadata.Snapshot, error) {
	if name == "" {
		return nil, fmt.Errorf("snapshot name %q: %w", name, metadata.ErrNotFound)
	}
	s, err := scanSnapshot(st.row(ctx, st.db, `SELECT `+snapshotCols+` FROM snapshots WHERE name = ? AND kept`, name))
	if err != nil {
		return nil, notFound(err, "snapshot named", name)
	}
	return s, nil
}

// DeleteSnapshot implements metadata.Snapshots.
func (st *Store) DeleteSnapshot(ctx context.Context, id string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM snapshots WHERE id = ?`, id)
	return deleted(res, err, "snapshot", id)
}
