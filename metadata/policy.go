package metadata

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/torpor/torpor/sandbox"
)

// Meter is a sandbox record's metered usage: RunningMS is the running time
// accrued up to UsageAt, SnapshotByteS the snapshot storage accrued up to
// UsageAt in byte-seconds, TimeoutBaseMS RunningMS at the start of the current
// timeout period.
type Meter struct {
	RunningMS     int64
	SnapshotByteS float64
	UsageAt       time.Time
	TimeoutBaseMS int64
}

// policyCols are the sandboxes columns of a Policy, in the order of values().
const policyCols = `idle_timeout_s, timeout_s, on_timeout, hibernation_mode, on_resume, volumes,
	running_ms, timeout_base_ms, snapshot_byte_s, usage_at, expires_at`

const policyMarks = `?,?,?,?,?,?,?,?,?,?,?`

// policyColumnDefs are added to a sandboxes table made by an older version.
var policyColumnDefs = []struct{ name, def string }{
	{"idle_timeout_s", "INTEGER NOT NULL DEFAULT 15"},
	{"timeout_s", "INTEGER NOT NULL DEFAULT 0"},
	{"on_timeout", "TEXT NOT NULL DEFAULT 'hibernate'"},
	{"hibernation_mode", "TEXT NOT NULL DEFAULT 'memory'"},
	{"on_resume", "TEXT NOT NULL DEFAULT ''"},
	{"volumes", "TEXT NOT NULL DEFAULT ''"},
	{"running_ms", "INTEGER NOT NULL DEFAULT 0"},
	{"timeout_base_ms", "INTEGER NOT NULL DEFAULT 0"},
	{"snapshot_byte_s", "REAL NOT NULL DEFAULT 0"},
	{"usage_at", "TEXT NOT NULL DEFAULT ''"},
	{"last_resume", "TEXT NOT NULL DEFAULT ''"}, // the resume contract's last report (metadata.go)
	{"expires_at", "TEXT NOT NULL DEFAULT ''"},
}

// snapshotColumnDefs are added to a snapshots table made by an older version.
var snapshotColumnDefs = []struct{ name, def string }{
	{"logical_bytes", "INTEGER NOT NULL DEFAULT 0"},
	{"stored_bytes", "INTEGER NOT NULL DEFAULT 0"},
	{"new_bytes", "INTEGER NOT NULL DEFAULT 0"},
}

func policyValues(p sandbox.Policy, mt Meter) []any {
	onResume, volumes := "", ""
	if len(p.OnResume) > 0 {
		b, _ := json.Marshal(p.OnResume)
		onResume = string(b)
	}
	if len(p.Volumes) > 0 {
		b, _ := json.Marshal(p.Volumes)
		volumes = string(b)
	}
	usageAt := ""
	if !mt.UsageAt.IsZero() {
		usageAt = ts(mt.UsageAt)
	}
	mode := p.HibernationMode
	if mode == "" {
		mode = "memory"
	}
	onTimeout := p.OnTimeout
	if onTimeout == "" {
		onTimeout = "hibernate"
	}
	expires := ""
	if p.ExpiresAt != nil {
		expires = ts(*p.ExpiresAt)
	}
	return []any{p.IdleTimeoutS, p.TimeoutS, onTimeout, mode, onResume, volumes,
		mt.RunningMS, mt.TimeoutBaseMS, mt.SnapshotByteS, usageAt, expires}
}

type policyScan struct {
	p                                     sandbox.Policy
	mt                                    Meter
	onResume, volumes, usageAt, expiresAt string
}

func (s *policyScan) dests() []any {
	return []any{&s.p.IdleTimeoutS, &s.p.TimeoutS, &s.p.OnTimeout, &s.p.HibernationMode, &s.onResume, &s.volumes,
		&s.mt.RunningMS, &s.mt.TimeoutBaseMS, &s.mt.SnapshotByteS, &s.usageAt, &s.expiresAt}
}

func (s *policyScan) policy() (sandbox.Policy, Meter) {
	p := s.p
	if s.onResume != "" {
		_ = json.Unmarshal([]byte(s.onResume), &p.OnResume)
	}
	if s.volumes != "" {
		_ = json.Unmarshal([]byte(s.volumes), &p.Volumes)
	}
	mt := s.mt
	if s.usageAt != "" {
		mt.UsageAt, _ = time.Parse(time.RFC3339Nano, s.usageAt)
	}
	if s.expiresAt != "" {
		if t, err := time.Parse(time.RFC3339Nano, s.expiresAt); err == nil {
			p.ExpiresAt = &t
		}
	}
	return p, mt
}

const volumesSchema = `
CREATE TABLE IF NOT EXISTS volumes (
	name TEXT PRIMARY KEY,
	created_at TEXT NOT NULL,
	copied_from TEXT NOT NULL DEFAULT ''
);`

// migrate brings a database made by an older torpor up to date: columns added
// since are added with ALTER TABLE (existing rows get the defaults), new tables
// are created.
func migrate(db *sql.DB) error {
	if err := addColumns(db, "sandboxes", policyColumnDefs); err != nil {
		return err
	}
	if err := addColumns(db, "snapshots", snapshotColumnDefs); err != nil {
		return err
	}
	_, err := db.Exec(volumesSchema)
	return err
}

// addColumns adds the columns of defs that table lacks.
func addColumns(db *sql.DB, table string, defs []struct{ name, def string }) error {
	rows, err := db.Query(`PRAGMA table_info(` + table + `)`)
	if err != nil {
		return err
	}
	have := map[string]bool{}
	for rows.Next() {
		var cid, notnull, pk int
		var name, typ string
		var dflt sql.NullString
		if err := rows.Scan(&cid, &name, &typ, &notnull, &dflt, &pk); err != nil {
			rows.Close()
			return err
		}
		have[strings.ToLower(name)] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, c := range defs {
		if !have[c.name] {
			if _, err := db.Exec(`ALTER TABLE ` + table + ` ADD COLUMN ` + c.name + ` ` + c.def); err != nil {
				return fmt.Errorf("add column %s.%s: %w", table, c.name, err)
			}
		}
	}
	return nil
}

// Volume is a named volume's record (its data is a host directory).
type Volume struct {
	Name       string
	CreatedAt  time.Time
	CopiedFrom string
}

// ErrExists is returned (wrapped) when creating a volume whose name is taken.
var ErrExists = errors.New("already exists")

// CreateVolume records a new volume; ErrExists (wrapped) if the name is taken.
func (d *DB) CreateVolume(ctx context.Context, v Volume) error {
	res, err := d.SQL.ExecContext(ctx, `INSERT OR IGNORE INTO volumes (name, created_at, copied_from) VALUES (?,?,?)`,
		v.Name, ts(v.CreatedAt), v.CopiedFrom)
	if err != nil {
		return fmt.Errorf("metadata: create volume %s: %w", v.Name, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("volume %s: %w", v.Name, ErrExists)
	}
	return nil
}

// GetVolume returns one volume; ErrNotFound (wrapped) if there is none.
func (d *DB) GetVolume(ctx context.Context, name string) (Volume, error) {
	var v Volume
	var created string
	err := d.SQL.QueryRowContext(ctx, `SELECT name, created_at, copied_from FROM volumes WHERE name = ?`, name).
		Scan(&v.Name, &created, &v.CopiedFrom)
	if errors.Is(err, sql.ErrNoRows) {
		return v, fmt.Errorf("volume %s: %w", name, ErrNotFound)
	}
	if err != nil {
		return v, fmt.Errorf("metadata: get volume %s: %w", name, err)
	}
	v.CreatedAt, _ = time.Parse(time.RFC3339Nano, created)
	return v, nil
}

// ListVolumes returns all volumes by name.
func (d *DB) ListVolumes(ctx context.Context) ([]Volume, error) {
	rows, err := d.SQL.QueryContext(ctx, `SELECT name, created_at, copied_from FROM volumes ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("metadata: list volumes: %w", err)
	}
	defer rows.Close()
	var out []Volume
	for rows.Next() {
		var v Volume
		var created string
		if err := rows.Scan(&v.Name, &created, &v.CopiedFrom); err != nil {
			return nil, err
		}
		v.CreatedAt, _ = time.Parse(time.RFC3339Nano, created)
		out = append(out, v)
	}
	return out, rows.Err()
}

// DeleteVolume removes a volume record.
func (d *DB) DeleteVolume(ctx context.Context, name string) error {
	if _, err := d.SQL.ExecContext(ctx, `DELETE FROM volumes WHERE name = ?`, name); err != nil {
		return fmt.Errorf("metadata: delete volume %s: %w", name, err)
	}
	return nil
}
