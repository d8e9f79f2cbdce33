package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/internal/columns"
	"github.com/torpor/torpor/sandbox"
)

// placeholders returns "$from, $from+1, …" (n of them).
func placeholders(from, n int) string {
	p := make([]string, n)
	for i := range p {
		p[i] = fmt.Sprintf("$%d", from+i)
	}
	return strings.Join(p, ", ")
}

var (
	sandboxSelect = `SELECT ` + strings.Join(columns.SandboxNames, ", ") + ` FROM sandboxes`
	sandboxInsert = `INSERT INTO sandboxes (` + strings.Join(columns.SandboxNames, ", ") + `) VALUES (` +
		placeholders(1, len(columns.SandboxNames)) + `) ON CONFLICT (id) DO NOTHING`
	// sandboxUpdate sets every column but id and version from $1… (the
	// values without the id and the version), then version+1, where id and
	// version are the two parameters after them.
	sandboxUpdate = func() string {
		cols := columns.SandboxNames[1 : len(columns.SandboxNames)-1]
		set := make([]string, len(cols))
		for i, c := range cols {
			set[i] = fmt.Sprintf("%s = $%d", c, i+1)
		}
		return fmt.Sprintf(`UPDATE sandboxes SET %s, version = version + 1 WHERE id = $%d AND version = $%d`,
			strings.Join(set, ", "), len(cols)+1, len(cols)+2)
	}()
)

// sandboxValues are s's column values in the order of columns.SandboxNames.
func sandboxValues(s *metadata.Sandbox) []any {
	j := columns.Encode(s)
	p, mt := s.Policy, s.Meter
	mode, onTimeout := columns.Policy(p)
	return []any{s.ID, string(s.State), s.Image, s.ImageDigest, s.GuestDigest, s.MemoryMiB, s.CPUs, j.Env,
		s.Generation, s.ForkedFrom, s.SnapshotID, s.PendingSnapshot, s.Instance, s.Seq, s.Error,
		s.Deleting, s.CreatedAt, s.StateChangedAt, s.LastHibernateAt, s.LastResumeAt, s.ResumeMS, orNull(j.LastResume),
		p.IdleTimeoutS, p.TimeoutS, onTimeout, mode, orNull(j.OnResume), orNull(j.Volumes),
		mt.RunningMS, mt.TimeoutBaseMS, mt.SnapshotByteS, timeOrNull(mt.UsageAt), p.ExpiresAt, orNull(j.Metadata),
		p.ResumeOnRequest, s.Version}
}

func scanSandbox(r pgx.Row) (*metadata.Sandbox, error) {
	var s metadata.Sandbox
	var j columns.Sandbox
	var state string
	var lastResume, onResume, volumes, md *string
	var usageAt *time.Time
	p, mt := &s.Policy, &s.Meter
	err := r.Scan(&s.ID, &state, &s.Image, &s.ImageDigest, &s.GuestDigest, &s.MemoryMiB, &s.CPUs, &j.Env,
		&s.Generation, &s.ForkedFrom, &s.SnapshotID, &s.PendingSnapshot, &s.Instance, &s.Seq, &s.Error,
		&s.Deleting, &s.CreatedAt, &s.StateChangedAt, &s.LastHibernateAt, &s.LastResumeAt, &s.ResumeMS, &lastResume,
		&p.IdleTimeoutS, &p.TimeoutS, &p.OnTimeout, &p.HibernationMode, &onResume, &volumes,
		&mt.RunningMS, &mt.TimeoutBaseMS, &mt.SnapshotByteS, &usageAt, &p.ExpiresAt, &md, &p.ResumeOnRequest, &s.Version)
	if err != nil {
		return nil, err
	}
	s.State = sandbox.State(state)
	j.LastResume, j.OnResume, j.Volumes, j.Metadata = str(lastResume), str(onResume), str(volumes), str(md)
	j.Decode(&s)
	s.CreatedAt, s.StateChangedAt = utc(s.CreatedAt), utc(s.StateChangedAt)
	s.LastHibernateAt, s.LastResumeAt, p.ExpiresAt = utcp(s.LastHibernateAt), utcp(s.LastResumeAt), utcp(p.ExpiresAt)
	if usageAt != nil {
		mt.UsageAt = usageAt.UTC()
	}
	return &s, nil
}

// CreateSandbox implements metadata.Sandboxes.
func (d *DB) CreateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	c := *s
	c.Version = 1
	tag, err := d.pool.Exec(ctx, sandboxInsert, sandboxValues(&c)...)
	if err != nil {
		return fmt.Errorf("metadata: create sandbox %s: %w", s.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrExists)
	}
	s.Version = 1
	return nil
}

// GetSandbox implements metadata.Sandboxes.
func (d *DB) GetSandbox(ctx context.Context, id string) (*metadata.Sandbox, error) {
	s, err := scanSandbox(d.pool.QueryRow(ctx, sandboxSelect+` WHERE id = $1`, id))
	if err != nil {
		return nil, notFound(err, "sandbox", id)
	}
	return s, nil
}

// ListSandboxes implements metadata.Sandboxes.
func (d *DB) ListSandboxes(ctx context.Context) ([]*metadata.Sandbox, error) {
	return queryList(ctx, d, "list sandboxes", sandboxSelect+` ORDER BY created_at, id`, scanSandbox)
}

// updateSandbox writes s in q if its stored version is s.Version; the caller
// advances s.Version once the write is committed. A concurrent writer of the
// same row holds its lock until it commits; this UPDATE then reads the
// committed row, whose version no longer matches (PostgreSQL re-checks the
// WHERE clause), so of two writers of one version exactly one succeeds.
func updateSandbox(ctx context.Context, q querier, s *metadata.Sandbox) error {
	vals := sandboxValues(s)
	args := append(vals[1:len(vals)-1:len(vals)-1], s.ID, s.Version)
	tag, err := q.Exec(ctx, sandboxUpdate, args...)
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	var stored int64
	err = q.QueryRow(ctx, `SELECT version FROM sandboxes WHERE id = $1`, s.ID).Scan(&stored)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("sandbox %s: %w", s.ID, metadata.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("metadata: update sandbox %s: %w", s.ID, err)
	}
	return fmt.Errorf("sandbox %s version %d (stored: %d): %w", s.ID, s.Version, stored, metadata.ErrStale)
}

// UpdateSandbox implements metadata.Sandboxes.
func (d *DB) UpdateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	if err := updateSandbox(ctx, d.pool, s); err != nil {
		return err
	}
	s.Version++
	return nil
}

// DeleteSandbox implements metadata.Sandboxes.
func (d *DB) DeleteSandbox(ctx context.Context, id string) error {
	tag, err := d.pool.Exec(ctx, `DELETE FROM sandboxes WHERE id = $1`, id)
	return deleted(tag, err, "sandbox", id)
}

// BeginRestore implements metadata.Sandboxes.
func (d *DB) BeginRestore(ctx context.Context, s *metadata.Sandbox) (int64, error) {
	var gen int64
	err := d.inTx(ctx, "begin restore "+s.ID, func(tx pgx.Tx) error {
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
	err := d.inTx(ctx, "commit hibernate "+s.ID, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO snapshots (`+snapshotCols+`) VALUES (`+placeholders(1, 12)+`) ON CONFLICT (id) DO NOTHING`,
			snap.ID, snap.SandboxID, snap.Parent, snap.Bytes, snap.HibernateMS, snap.Engine, snap.CreatedAt,
			snap.LogicalBytes, snap.StoredBytes, snap.NewBytes, snap.Kept, snapName(snap))
		if err != nil {
			return fmt.Errorf("metadata: put snapshot %s: %w", snap.ID, err)
		}
		if tag.RowsAffected() == 0 {
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
		`SELECT id FROM sandboxes WHERE snapshot_id = $1 OR pending_snapshot = $1 ORDER BY id`, scanString, id)
}

// snapshots

const snapshotCols = `id, sandbox_id, parent, bytes, hibernate_ms, engine, created_at, logical_bytes, stored_bytes, new_bytes, kept, name`

func scanSnapshot(r pgx.Row) (*metadata.Snapshot, error) {
	var s metadata.Snapshot
	if err := r.Scan(&s.ID, &s.SandboxID, &s.Parent, &s.Bytes, &s.HibernateMS, &s.Engine, &s.CreatedAt,
		&s.LogicalBytes, &s.StoredBytes, &s.NewBytes, &s.Kept, &s.Name); err != nil {
		return nil, err
	}
	s.CreatedAt = utc(s.CreatedAt)
	return &s, nil
}

// GetSnapshot implements metadata.Snapshots.
func (d *DB) GetSnapshot(ctx context.Context, id string) (*metadata.Snapshot, error) {
	s, err := scanSnapshot(d.pool.QueryRow(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE id = $1`, id))
	if err != nil {
		return nil, notFound(err, "snapshot", id)
	}
	return s, nil
}

// ListSnapshots implements metadata.Snapshots.
func (d *DB) ListSnapshots(ctx context.Context) ([]*metadata.Snapshot, error) {
	return queryList(ctx, d, "list snapshots", `SELECT `+snapshotCols+` FROM snapshots ORDER BY created_at, id`, scanSnapshot)
}

// SetSnapshotSizes implements metadata.Snapshots.
func (d *DB) SetSnapshotSizes(ctx context.Context, id string, logical, stored, newBytes int64) error {
	tag, err := d.pool.Exec(ctx, `UPDATE snapshots SET logical_bytes = $1, stored_bytes = $2, new_bytes = $3 WHERE id = $4`,
		logical, stored, newBytes, id)
	return updated(tag, err, "snapshot", id)
}

// UnreferencedSnapshots implements metadata.Snapshots.
func (d *DB) UnreferencedSnapshots(ctx context.Context) ([]string, error) {
	return queryList(ctx, d, "unreferenced snapshots", `SELECT id FROM snapshots s WHERE NOT kept
		AND NOT EXISTS (SELECT 1 FROM sandboxes WHERE snapshot_id = s.id OR pending_snapshot = s.id) ORDER BY id`, scanString)
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
	tag, err := d.pool.Exec(ctx, `UPDATE snapshots SET kept = $1, name = $2 WHERE id = $3`, kept, name, id)
	if uniqueViolation(err) {
		return fmt.Errorf("snapshot name %q: %w", name, metadata.ErrExists)
	}
	return updated(tag, err, "snapshot", id)
}

// SnapshotByName implements metadata.Snapshots.
func (d *DB) SnapshotByName(ctx context.Context, name string) (*metadata.Snapshot, error) {
	if name == "" {
		return nil, fmt.Errorf("snapshot name %q: %w", name, metadata.ErrNotFound)
	}
	s, err := scanSnapshot(d.pool.QueryRow(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE name = $1 AND kept`, name))
	if err != nil {
		return nil, notFound(err, "snapshot named", name)
	}
	return s, nil
}

// DeleteSnapshot implements metadata.Snapshots.
func (d *DB) DeleteSnapshot(ctx context.Context, id string) error {
	tag, err := d.pool.Exec(ctx, `DELETE FROM snapshots WHERE id = $1`, id)
	return deleted(tag, err, "snapshot", id)
}
