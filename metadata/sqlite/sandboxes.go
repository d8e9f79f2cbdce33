package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/internal/columns"
	"github.com/torpor/torpor/sandbox"
)

// sandboxCols are the columns of a sandbox record, in the order of
// sandboxValues and scanSandbox; id first.
var sandboxCols = columns.SandboxNames

var (
	sandboxSelect = `SELECT ` + strings.Join(sandboxCols, ", ") + ` FROM sandboxes`
	sandboxInsert = `INSERT INTO sandboxes (` + strings.Join(sandboxCols, ", ") + `) VALUES (` +
		strings.TrimSuffix(strings.Repeat("?,", len(sandboxCols)), ",") + `) ON CONFLICT(id) DO NOTHING`
	// sandboxUpdate sets every column but id and version from the values
	// (without the id, with the version last), then version+1, where id and
	// version are the record's.
	sandboxUpdate = func() string {
		var set []string
		for _, c := range sandboxCols[1 : len(sandboxCols)-1] {
			set = append(set, c+" = ?")
		}
		return `UPDATE sandboxes SET ` + strings.Join(set, ", ") + `, version = version + 1 WHERE id = ? AND version = ?`
	}()
)

// sandboxValues are s's column values in the order of sandboxCols.
func sandboxValues(s *metadata.Sandbox) []any {
	j := columns.Encode(s)
	p, mt := s.Policy, s.Meter
	usageAt := ""
	if !mt.UsageAt.IsZero() {
		usageAt = ts(mt.UsageAt)
	}
	mode, onTimeout := columns.Policy(p)
	expires := ""
	if p.ExpiresAt != nil {
		expires = ts(*p.ExpiresAt)
	}
	return []any{s.ID, string(s.State), s.Image, s.ImageDigest, s.GuestDigest, s.MemoryMiB, s.CPUs, j.Env,
		s.Generation, s.ForkedFrom, s.SnapshotID, s.PendingSnapshot, s.Instance, s.Seq, s.Error,
		s.Deleting, ts(s.CreatedAt), ts(s.StateChangedAt), tsp(s.LastHibernateAt), tsp(s.LastResumeAt), s.ResumeMS, j.LastResume,
		p.IdleTimeoutS, p.TimeoutS, onTimeout, mode, j.OnResume, j.Volumes,
		mt.RunningMS, mt.TimeoutBaseMS, mt.SnapshotByteS, usageAt, expires, j.Metadata, p.ResumeOnRequest, s.Version}
}

func scanSandbox(r scanner) (*metadata.Sandbox, error) {
	var s metadata.Sandbox
	var j columns.Sandbox
	var state, created, changed, usageAt, expiresAt string
	var lastH, lastR sql.NullString
	p, mt := &s.Policy, &s.Meter
	err := r.Scan(&s.ID, &state, &s.Image, &s.ImageDigest, &s.GuestDigest, &s.MemoryMiB, &s.CPUs, &j.Env,
		&s.Generation, &s.ForkedFrom, &s.SnapshotID, &s.PendingSnapshot, &s.Instance, &s.Seq, &s.Error,
		&s.Deleting, &created, &changed, &lastH, &lastR, &s.ResumeMS, &j.LastResume,
		&p.IdleTimeoutS, &p.TimeoutS, &p.OnTimeout, &p.HibernationMode, &j.OnResume, &j.Volumes,
		&mt.RunningMS, &mt.TimeoutBaseMS, &mt.SnapshotByteS, &usageAt, &expiresAt, &j.Metadata, &p.ResumeOnRequest, &s.Version)
	if err != nil {
		return nil, err
	}
	s.State = sandbox.State(state)
	j.Decode(&s)
	s.CreatedAt, s.StateChangedAt = parseTS(created), parseTS(changed)
	if lastH.Valid {
		t := parseTS(lastH.String)
		s.LastHibernateAt = &t
	}
	if lastR.Valid {
		t := parseTS(lastR.String)
		s.LastResumeAt = &t
	}
	if usageAt != "" {
		mt.UsageAt = parseTS(usageAt)
	}
	if t, err := time.Parse(time.RFC3339Nano, expiresAt); err == nil {
		p.ExpiresAt = &t
	}
	return &s, nil
}

// CreateSandbox implements metadata.Sandboxes.
func (d *DB) CreateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	c := *s
	c.Version = 1
	res, err := d.sql.ExecContext(ctx, sandboxInsert, sandboxValues(&c)...)
	if err != nil {
		return fmt.Errorf("metadata: create sandbox %s: %w", s.ID, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrExists)
	}
	s.Version = 1
	return nil
}

// GetSandbox implements metadata.Sandboxes.
func (d *DB) GetSandbox(ctx context.Context, id string) (*metadata.Sandbox, error) {
	s, err := scanSandbox(d.sql.QueryRowContext(ctx, sandboxSelect+` WHERE id = ?`, id))
	if err != nil {
		return nil, notFound(err, "sandbox", id)
	}
	return s, nil
}

// ListSandboxes implements metadata.Sandboxes.
func (d *DB) ListSandboxes(ctx context.Context) ([]*metadata.Sandbox, error) {
	out, err := queryList(ctx, d, "list sandboxes", sandboxSelect+` ORDER BY created_at, id`, scanSandbox)
	oldestFirst(out, func(s *metadata.Sandbox) (time.Time, string) { return s.CreatedAt, s.ID })
	return out, err
}

// updateSandbox writes s in x if its stored version is s.Version; the caller
// advances s.Version once the write is committed.
func updateSandbox(ctx context.Context, x execer, s *metadata.Sandbox) error {
	vals := sandboxValues(s)
	args := append(vals[1:len(vals)-1:len(vals)-1], s.ID, s.Version)
	res, err := x.ExecContext(ctx, sandboxUpdate, args...)
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	if n, _ := res.RowsAffected(); n == 1 {
		return nil
	}
	var stored int64
	err = x.QueryRowContext(ctx, `SELECT version FROM sandboxes WHERE id = ?`, s.ID).Scan(&stored)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	return fmt.Errorf("sandbox %s version %d (stored: %d): %w", s.ID, s.Version, stored, metadata.ErrStale)
}

// UpdateSandbox implements metadata.Sandboxes.
func (d *DB) UpdateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	if err := updateSandbox(ctx, d.sql, s); err != nil {
		return err
	}
	s.Version++
	return nil
}

// DeleteSandbox implements metadata.Sandboxes.
func (d *DB) DeleteSandbox(ctx context.Context, id string) error {
	res, err := d.sql.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, id)
	return deleted(res, err, "sandbox", id)
}

// BeginRestore implements metadata.Sandboxes.
func (d *DB) BeginRestore(ctx context.Context, s *metadata.Sandbox) (int64, error) {
	var gen int64
	err := d.inTx(ctx, "begin restore "+s.ID, func(tx *sql.Tx) error {
		var err error
		if gen, err = nextGeneration(ctx, tx); err != nil {
			return err
		}
		return updateSandbox(ctx, tx, s)
	})
	if err != nil {
		return 0, err
	}
	s.Version++
	return gen, nil
}

// CommitHibernate implements metadata.Sandboxes.
func (d *DB) CommitHibernate(ctx context.Context, snap *metadata.Snapshot, s *metadata.Sandbox) error {
	err := d.inTx(ctx, "commit hibernate "+s.ID, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `INSERT INTO snapshots (`+snapshotCols+`) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO NOTHING`,
			snap.ID, snap.SandboxID, snap.Parent, snap.Bytes, snap.HibernateMS, snap.Engine, ts(snap.CreatedAt),
			snap.LogicalBytes, snap.StoredBytes, snap.NewBytes, snap.Kept, snapName(snap))
		if err != nil {
			return fmt.Errorf("metadata: put snapshot %s: %w", snap.ID, err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return fmt.Errorf("snapshot %s: %w", snap.ID, metadata.ErrExists)
		}
		return updateSandbox(ctx, tx, s)
	})
	if err != nil {
		return err
	}
	s.Version++
	return nil
}

// SnapshotUsers implements metadata.Sandboxes.
func (d *DB) SnapshotUsers(ctx context.Context, id string) ([]string, error) {
	return queryList(ctx, d, "snapshot users "+id,
		`SELECT id FROM sandboxes WHERE snapshot_id = ? OR pending_snapshot = ? ORDER BY id`, scanString, id, id)
}

// snapshots

const snapshotCols = `id, sandbox_id, parent, bytes, hibernate_ms, engine, created_at, logical_bytes, stored_bytes, new_bytes, kept, name`

func scanSnapshot(r scanner) (*metadata.Snapshot, error) {
	var s metadata.Snapshot
	var created string
	if err := r.Scan(&s.ID, &s.SandboxID, &s.Parent, &s.Bytes, &s.HibernateMS, &s.Engine, &created,
		&s.LogicalBytes, &s.StoredBytes, &s.NewBytes, &s.Kept, &s.Name); err != nil {
		return nil, err
	}
	s.CreatedAt = parseTS(created)
	return &s, nil
}

// GetSnapshot implements metadata.Snapshots.
func (d *DB) GetSnapshot(ctx context.Context, id string) (*metadata.Snapshot, error) {
	s, err := scanSnapshot(d.sql.QueryRowContext(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE id = ?`, id))
	if err != nil {
		return nil, notFound(err, "snapshot", id)
	}
	return s, nil
}

// ListSnapshots implements metadata.Snapshots.
func (d *DB) ListSnapshots(ctx context.Context) ([]*metadata.Snapshot, error) {
	out, err := queryList(ctx, d, "list snapshots", `SELECT `+snapshotCols+` FROM snapshots ORDER BY created_at, id`, scanSnapshot)
	oldestFirst(out, func(s *metadata.Snapshot) (time.Time, string) { return s.CreatedAt, s.ID })
	return out, err
}

// SetSnapshotSizes implements metadata.Snapshots.
func (d *DB) SetSnapshotSizes(ctx context.Context, id string, logical, stored, newBytes int64) error {
	res, err := d.sql.ExecContext(ctx, `UPDATE snapshots SET logical_bytes = ?, stored_bytes = ?, new_bytes = ? WHERE id = ?`,
		logical, stored, newBytes, id)
	if err != nil {
		return fmt.Errorf("metadata: set snapshot sizes %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("snapshot %s: %w", id, metadata.ErrNotFound)
	}
	return nil
}

// UnreferencedSnapshots implements metadata.Snapshots.
func (d *DB) UnreferencedSnapshots(ctx context.Context) ([]string, error) {
	return queryList(ctx, d, "unreferenced snapshots", `SELECT id FROM snapshots WHERE id NOT IN
		(SELECT snapshot_id FROM sandboxes UNION SELECT pending_snapshot FROM sandboxes) AND NOT kept ORDER BY id`, scanString)
}

// snapName is the name a snapshot record is stored with: only a kept one has one.
func snapName(s *metadata.Snapshot) string {
	if !s.Kept {
		return ""
	}
	return s.Name
}

// SetSnapshotKept implements metadata.Snapshots.
func (d *DB) SetSnapshotKept(ctx context.Context, id string, kept bool, name string) error {
	if !kept {
		name = ""
	}
	res, err := d.sql.ExecContext(ctx, `UPDATE snapshots SET kept = ?, name = ? WHERE id = ?`, kept, name, id)
	if err != nil {
		if strings.Contains(err.Error(), "UNIQUE") {
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
func (d *DB) SnapshotByName(ctx context.Context, name string) (*metadata.Snapshot, error) {
	if name == "" {
		return nil, fmt.Errorf("snapshot name %q: %w", name, metadata.ErrNotFound)
	}
	s, err := scanSnapshot(d.sql.QueryRowContext(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE name = ? AND kept`, name))
	if err != nil {
		return nil, notFound(err, "snapshot named", name)
	}
	return s, nil
}

// DeleteSnapshot implements metadata.Snapshots.
func (d *DB) DeleteSnapshot(ctx context.Context, id string) error {
	res, err := d.sql.ExecContext(ctx, `DELETE FROM snapshots WHERE id = ?`, id)
	return deleted(res, err, "snapshot", id)
}
