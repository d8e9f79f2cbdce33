// Package metadata is torpor's system of record for sandboxes and snapshots: an
// embedded SQLite database (modernc.org/sqlite, pure Go, no cgo) in the data
// directory. Every state change the sandbox manager makes is written here, in one
// transaction, before the API acknowledges it.
package metadata

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	_ "modernc.org/sqlite" // registers driver "sqlite"

	"github.com/torpor/torpor/sandbox"
)

// ErrNotFound is returned (wrapped) for unknown sandbox or snapshot ids.
var ErrNotFound = errors.New("not found")

// DB is the metadata database.
type DB struct {
	SQL *sql.DB
}

// Sandbox is a sandbox's persisted record.
type Sandbox struct {
	ID          string
	State       sandbox.State
	Image       string
	ImageDigest string
	GuestDigest string
	MemoryMiB   int
	CPUs        float64
	Env         map[string]string
	Generation  int64
	ForkedFrom  string
	// SnapshotID is the latest committed snapshot this sandbox resumes from ("" if
	// none). A clone starts with its source's snapshot here.
	SnapshotID string
	// PendingSnapshot is the id of a snapshot being written while State is
	// hibernating, so a restart can tell whether the commit happened.
	PendingSnapshot string
	// Instance is the engine instance id while the sandbox runs; Seq counts launches.
	Instance string
	Seq      int64
	Error    string
	// Deleting is set (and persisted) before a delete starts stopping things.
	Deleting        bool
	CreatedAt       time.Time
	StateChangedAt  time.Time
	LastHibernateAt *time.Time
	LastResumeAt    *time.Time
	ResumeMS        int64
	sandbox.Policy
	Meter
	// LastResume is the guest agent's report of the last start, resume or fork
	// (stored as JSON in column last_resume).
	LastResume *sandbox.ResumeReport
}

// Snapshot is a snapshot's persisted record (its manifest lives in the store).
type Snapshot struct {
	ID          string
	SandboxID   string
	Parent      string
	Bytes       int64
	HibernateMS int64
	Engine      string
	CreatedAt   time.Time
	// LogicalBytes, StoredBytes and NewBytes are the manifest's sizes (a plain
	// store: all equal to Bytes); 0 in records made before they were kept.
	LogicalBytes int64
	StoredBytes  int64
	NewBytes     int64
}

const schema = `
CREATE TABLE IF NOT EXISTS sandboxes (
	id TEXT PRIMARY KEY,
	state TEXT NOT NULL,
	image TEXT NOT NULL,
	image_digest TEXT NOT NULL,
	guest_digest TEXT NOT NULL,
	memory_mib INTEGER NOT NULL,
	cpus REAL NOT NULL,
	env TEXT NOT NULL,
	generation INTEGER NOT NULL,
	forked_from TEXT NOT NULL DEFAULT '',
	snapshot_id TEXT NOT NULL DEFAULT '',
	pending_snapshot TEXT NOT NULL DEFAULT '',
	instance TEXT NOT NULL DEFAULT '',
	seq INTEGER NOT NULL DEFAULT 0,
	error TEXT NOT NULL DEFAULT '',
	deleting INTEGER NOT NULL DEFAULT 0,
	created_at TEXT NOT NULL,
	state_changed_at TEXT NOT NULL,
	last_hibernate_at TEXT,
	last_resume_at TEXT,
	resume_ms INTEGER NOT NULL DEFAULT 0,
	last_resume TEXT NOT NULL DEFAULT '',
	idle_timeout_s INTEGER NOT NULL DEFAULT 15,
	timeout_s INTEGER NOT NULL DEFAULT 0,
	on_timeout TEXT NOT NULL DEFAULT 'hibernate',
	hibernation_mode TEXT NOT NULL DEFAULT 'memory',
	on_resume TEXT NOT NULL DEFAULT '',
	volumes TEXT NOT NULL DEFAULT '',
	running_ms INTEGER NOT NULL DEFAULT 0,
	timeout_base_ms INTEGER NOT NULL DEFAULT 0,
	snapshot_byte_s REAL NOT NULL DEFAULT 0,
	usage_at TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (name, value) VALUES ('generation', 0);
CREATE TABLE IF NOT EXISTS snapshots (
	id TEXT PRIMARY KEY,
	sandbox_id TEXT NOT NULL,
	parent TEXT NOT NULL DEFAULT '',
	bytes INTEGER NOT NULL,
	hibernate_ms INTEGER NOT NULL,
	engine TEXT NOT NULL,
	created_at TEXT NOT NULL
);
`

// Open opens (creating if needed) the database file at path, in WAL mode with
// synchronous=FULL so a committed transaction survives a power loss.
func Open(path string) (*DB, error) {
	dsn := "file:" + path + "?_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_pragma=busy_timeout(10000)&_pragma=foreign_keys(1)"
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("metadata: open %s: %w", path, err)
	}
	// One writer at a time is SQLite's model; a single connection also keeps
	// transactions from seeing SQLITE_BUSY.
	db.SetMaxOpenConns(1)
	if _, err := db.Exec(schema); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata: schema %s: %w", path, err)
	}
	if err := migrate(db); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata: migrate %s: %w", path, err)
	}
	return &DB{SQL: db}, nil
}

// Close closes the database.
func (d *DB) Close() error { return d.SQL.Close() }

const sandboxCols = `id, state, image, image_digest, guest_digest, memory_mib, cpus, env, generation,
	forked_from, snapshot_id, pending_snapshot, instance, seq, error, deleting, created_at,
	state_changed_at, last_hibernate_at, last_resume_at, resume_ms, last_resume` + `, ` + policyCols

func ts(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

func tsp(t *time.Time) any {
	if t == nil {
		return nil
	}
	return ts(*t)
}

// PutSandbox inserts or replaces a sandbox record.
func (d *DB) PutSandbox(ctx context.Context, s *Sandbox) error {
	return putSandbox(ctx, d.SQL, s)
}

type execer interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
}

func putSandbox(ctx context.Context, x execer, s *Sandbox) error {
	env, _ := json.Marshal(s.Env)
	lastResume := ""
	if s.LastResume != nil {
		b, _ := json.Marshal(toResumeJSON(s.LastResume))
		lastResume = string(b)
	}
	_, err := x.ExecContext(ctx, `INSERT OR REPLACE INTO sandboxes (`+sandboxCols+`)
		VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,`+policyMarks+`)`,
		append([]any{s.ID, string(s.State), s.Image, s.ImageDigest, s.GuestDigest, s.MemoryMiB, s.CPUs, string(env),
			s.Generation, s.ForkedFrom, s.SnapshotID, s.PendingSnapshot, s.Instance, s.Seq, s.Error,
			s.Deleting, ts(s.CreatedAt), ts(s.StateChangedAt), tsp(s.LastHibernateAt), tsp(s.LastResumeAt), s.ResumeMS, lastResume},
			policyValues(s.Policy, s.Meter)...)...)
	if err != nil {
		return fmt.Errorf("metadata: put sandbox %s: %w", s.ID, err)
	}
	return nil
}

type scanner interface{ Scan(...any) error }

func scanSandbox(r scanner) (*Sandbox, error) {
	var s Sandbox
	var state, env, created, changed, lastResume string
	var lastH, lastR sql.NullString
	var pol policyScan
	err := r.Scan(append([]any{&s.ID, &state, &s.Image, &s.ImageDigest, &s.GuestDigest, &s.MemoryMiB, &s.CPUs, &env,
		&s.Generation, &s.ForkedFrom, &s.SnapshotID, &s.PendingSnapshot, &s.Instance, &s.Seq, &s.Error,
		&s.Deleting, &created, &changed, &lastH, &lastR, &s.ResumeMS, &lastResume}, pol.dests()...)...)
	if err != nil {
		return nil, err
	}
	s.Policy, s.Meter = pol.policy()
	s.State = sandbox.State(state)
	_ = json.Unmarshal([]byte(env), &s.Env)
	s.CreatedAt, _ = time.Parse(time.RFC3339Nano, created)
	s.StateChangedAt, _ = time.Parse(time.RFC3339Nano, changed)
	if lastH.Valid {
		t, _ := time.Parse(time.RFC3339Nano, lastH.String)
		s.LastHibernateAt = &t
	}
	if lastR.Valid {
		t, _ := time.Parse(time.RFC3339Nano, lastR.String)
		s.LastResumeAt = &t
	}
	if lastResume != "" {
		var rep resumeJSON
		if json.Unmarshal([]byte(lastResume), &rep) == nil {
			s.LastResume = rep.report()
		}
	}
	return &s, nil
}

// GetSandbox returns one sandbox; ErrNotFound (wrapped) if there is none.
func (d *DB) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	s, err := scanSandbox(d.SQL.QueryRowContext(ctx, `SELECT `+sandboxCols+` FROM sandboxes WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("sandbox %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("metadata: get sandbox %s: %w", id, err)
	}
	return s, nil
}

// ListSandboxes returns all sandboxes, oldest first.
func (d *DB) ListSandboxes(ctx context.Context) ([]*Sandbox, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT `+sandboxCols+` FROM sandboxes ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("metadata: list sandboxes: %w", err)
	}
	defer rows.Close()
	var out []*Sandbox
	for rows.Next() {
		s, err := scanSandbox(rows)
		if err != nil {
			return nil, fmt.Errorf("metadata: list sandboxes: %w", err)
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// DeleteSandbox removes a sandbox record.
func (d *DB) DeleteSandbox(ctx context.Context, id string) error {
	_, err := d.SQL.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, id)
	if err != nil {
		return fmt.Errorf("metadata: delete sandbox %s: %w", id, err)
	}
	return nil
}

// CommitHibernate records a committed snapshot and the sandbox's new state in one
// transaction.
func (d *DB) CommitHibernate(ctx context.Context, snap *Snapshot, s *Sandbox) error {
	tx, err := d.SQL.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO snapshots (`+snapshotCols+`)
		VALUES (?,?,?,?,?,?,?,?,?,?)`, snap.ID, snap.SandboxID, snap.Parent, snap.Bytes, snap.HibernateMS, snap.Engine, ts(snap.CreatedAt),
		snap.LogicalBytes, snap.StoredBytes, snap.NewBytes); err != nil {
		return fmt.Errorf("metadata: put snapshot %s: %w", snap.ID, err)
	}
	if err := putSandbox(ctx, tx, s); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("metadata: commit hibernate %s: %w", s.ID, err)
	}
	return nil
}

const snapshotCols = `id, sandbox_id, parent, bytes, hibernate_ms, engine, created_at, logical_bytes, stored_bytes, new_bytes`

func scanSnapshot(r scanner) (*Snapshot, error) {
	var s Snapshot
	var created string
	if err := r.Scan(&s.ID, &s.SandboxID, &s.Parent, &s.Bytes, &s.HibernateMS, &s.Engine, &created,
		&s.LogicalBytes, &s.StoredBytes, &s.NewBytes); err != nil {
		return nil, err
	}
	s.CreatedAt, _ = time.Parse(time.RFC3339Nano, created)
	return &s, nil
}

// GetSnapshot returns one snapshot record; ErrNotFound (wrapped) if there is none.
func (d *DB) GetSnapshot(ctx context.Context, id string) (*Snapshot, error) {
	s, err := scanSnapshot(d.SQL.QueryRowContext(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("snapshot %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("metadata: get snapshot %s: %w", id, err)
	}
	return s, nil
}

// ListSnapshots returns all snapshot records, oldest first.
func (d *DB) ListSnapshots(ctx context.Context) ([]*Snapshot, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT `+snapshotCols+` FROM snapshots ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("metadata: list snapshots: %w", err)
	}
	defer rows.Close()
	var out []*Snapshot
	for rows.Next() {
		s, err := scanSnapshot(rows)
		if err != nil {
			return nil, fmt.Errorf("metadata: list snapshots: %w", err)
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// SetSnapshotSizes fills in the sizes of a snapshot record made before they were
// kept (read back from its manifest).
func (d *DB) SetSnapshotSizes(ctx context.Context, id string, logical, stored, newBytes int64) error {
	if _, err := d.SQL.ExecContext(ctx, `UPDATE snapshots SET logical_bytes = ?, stored_bytes = ?, new_bytes = ? WHERE id = ?`,
		logical, stored, newBytes, id); err != nil {
		return fmt.Errorf("metadata: set snapshot sizes %s: %w", id, err)
	}
	return nil
}

// SnapshotUsers returns the ids of the sandboxes that resume from snapshot id
// (sandboxes.snapshot_id) or are writing it (pending_snapshot).
func (d *DB) SnapshotUsers(ctx context.Context, id string) ([]string, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT id FROM sandboxes WHERE snapshot_id = ? OR pending_snapshot = ? ORDER BY id`, id, id)
	if err != nil {
		return nil, fmt.Errorf("metadata: snapshot users %s: %w", id, err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var sid string
		if err := rows.Scan(&sid); err != nil {
			return nil, err
		}
		out = append(out, sid)
	}
	return out, rows.Err()
}

// UnreferencedSnapshots returns the ids of snapshot records no sandbox resumes
// from (sandboxes.snapshot_id) and none is writing (pending_snapshot).
func (d *DB) UnreferencedSnapshots(ctx context.Context) ([]string, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT id FROM snapshots WHERE id NOT IN
		(SELECT snapshot_id FROM sandboxes UNION SELECT pending_snapshot FROM sandboxes)`)
	if err != nil {
		return nil, fmt.Errorf("metadata: unreferenced snapshots: %w", err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// DeleteSnapshot removes a snapshot record.
func (d *DB) DeleteSnapshot(ctx context.Context, id string) error {
	if _, err := d.SQL.ExecContext(ctx, `DELETE FROM snapshots WHERE id = ?`, id); err != nil {
		return fmt.Errorf("metadata: delete snapshot %s: %w", id, err)
	}
	return nil
}

// SnapshotIDs returns the ids of all snapshot records.
func (d *DB) SnapshotIDs(ctx context.Context) (map[string]bool, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT id FROM snapshots`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out[id] = true
	}
	return out, rows.Err()
}

// NextGeneration returns the next value of the host-wide generation counter. Every
// start, resume and fork takes a new value, so no two incarnations of any sandboxes
// — clones of one snapshot included — ever share a generation.
func (d *DB) NextGeneration(ctx context.Context) (int64, error) {
	var v int64
	err := d.SQL.QueryRowContext(ctx, `UPDATE counters SET value = value + 1 WHERE name = 'generation' RETURNING value`).Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("metadata: next generation: %w", err)
	}
	return v, nil
}

// BeginRestore takes the next generation (see NextGeneration) and writes s in the
// same transaction, so a resume persists its new state and instance with one sync.
func (d *DB) BeginRestore(ctx context.Context, s *Sandbox) (int64, error) {
	tx, err := d.SQL.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("metadata: %w", err)
	}
	defer tx.Rollback()
	var gen int64
	if err := tx.QueryRowContext(ctx, `UPDATE counters SET value = value + 1 WHERE name = 'generation' RETURNING value`).Scan(&gen); err != nil {
		return 0, fmt.Errorf("metadata: next generation: %w", err)
	}
	if err := putSandbox(ctx, tx, s); err != nil {
		return 0, err
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("metadata: begin restore %s: %w", s.ID, err)
	}
	return gen, nil
}
