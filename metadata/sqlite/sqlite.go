// Package sqlite is the metadata store (metadata.Store) in an embedded SQLite
// database: one file in the data directory (modernc.org/sqlite, pure Go, no
// cgo), in WAL mode with synchronous=FULL so a committed transaction survives
// a power loss. Its schema is the numbered migrations in migrations/, applied
// in order on Open (see migrate.go).
package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	_ "modernc.org/sqlite" // registers driver "sqlite"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// DB is a metadata.Store in a SQLite database file.
type DB struct {
	sql *sql.DB
}

var _ metadata.Store = (*DB)(nil)

// Open opens (creating if needed) the database file at path and brings its
// schema up to date (migrate). Errors: the file cannot be opened, a
// migration failed (nothing of it is applied), or the database was written
// by a newer torpor (its schema version is higher than this one knows).
func Open(path string) (*DB, error) {
	dsn := "file:" + path + "?_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_pragma=busy_timeout(10000)&_pragma=foreign_keys(1)"
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("metadata: open %s: %w", path, err)
	}
	// One writer at a time is SQLite's model; a single connection also keeps
	// transactions from seeing SQLITE_BUSY.
	db.SetMaxOpenConns(1)
	if err := migrate(db); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata: %s: %w", path, err)
	}
	return &DB{sql: db}, nil
}

// Close closes the database.
func (d *DB) Close() error { return d.sql.Close() }

func ts(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

func tsp(t *time.Time) any {
	if t == nil {
		return nil
	}
	return ts(*t)
}

func parseTS(s string) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, s)
	return t
}

type execer interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

type scanner interface{ Scan(...any) error }

// queryList runs q and scans each row with scan.
func queryList[T any](ctx context.Context, d *DB, what, q string, scan func(scanner) (T, error), args ...any) ([]T, error) {
	rows, err := d.sql.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("metadata: %s: %w", what, err)
	}
	defer rows.Close()
	var out []T
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, fmt.Errorf("metadata: %s: %w", what, err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("metadata: %s: %w", what, err)
	}
	return out, nil
}

func scanString(r scanner) (string, error) {
	var s string
	err := r.Scan(&s)
	return s, err
}

// inTx runs f in a transaction and commits it if f succeeds.
func (d *DB) inTx(ctx context.Context, what string, f func(tx *sql.Tx) error) error {
	tx, err := d.sql.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("metadata: %s: %w", what, err)
	}
	defer tx.Rollback()
	if err := f(tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("metadata: %s: %w", what, err)
	}
	return nil
}

// oldestFirst sorts by time, then id. Timestamps are stored as RFC 3339 text,
// whose order is not always the times' (fractions are trimmed), so lists are
// sorted here.
func oldestFirst[T any](v []T, key func(T) (time.Time, string)) {
	sort.SliceStable(v, func(i, j int) bool {
		ti, idi := key(v[i])
		tj, idj := key(v[j])
		if !ti.Equal(tj) {
			return ti.Before(tj)
		}
		return idi < idj
	})
}

// nextGeneration increments the generation counter in x.
func nextGeneration(ctx context.Context, x execer) (int64, error) {
	var v int64
	err := x.QueryRowContext(ctx, `UPDATE counters SET value = value + 1 WHERE name = 'generation' RETURNING value`).Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("metadata: next generation: %w", err)
	}
	return v, nil
}

// NextGeneration implements metadata.Counters.
func (d *DB) NextGeneration(ctx context.Context) (int64, error) { return nextGeneration(ctx, d.sql) }

// deleted maps a DELETE's result to ErrNotFound when it removed no row.
func deleted(res sql.Result, err error, what, id string) error {
	if err != nil {
		return fmt.Errorf("metadata: delete %s %s: %w", what, id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("%s %s: %w", what, id, metadata.ErrNotFound)
	}
	return nil
}

// notFound maps sql.ErrNoRows to ErrNotFound.
func notFound(err error, what, id string) error {
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("%s %s: %w", what, id, metadata.ErrNotFound)
	}
	return fmt.Errorf("metadata: get %s %s: %w", what, id, err)
}

// images

const imageCols = `name, digest, bytes, source, created_at`

func scanImage(r scanner) (sandbox.Image, error) {
	var (
		img             sandbox.Image
		bytes           sql.NullInt64
		source, created sql.NullString
	)
	if err := r.Scan(&img.Name, &img.Digest, &bytes, &source, &created); err != nil {
		return sandbox.Image{}, err
	}
	img.Bytes = bytes.Int64
	img.Source = source.String
	if created.Valid {
		img.CreatedAt = parseTS(created.String)
	}
	return img, nil
}

// PutImage implements metadata.Images.
func (d *DB) PutImage(ctx context.Context, img sandbox.Image) error {
	_, err := d.sql.ExecContext(ctx, `INSERT INTO images (`+imageCols+`) VALUES (?, ?, ?, ?, ?)
		ON CONFLICT(name) DO UPDATE SET digest = excluded.digest, bytes = excluded.bytes, source = excluded.source, created_at = excluded.created_at`,
		img.Name, img.Digest, img.Bytes, img.Source, ts(img.CreatedAt))
	if err != nil {
		return fmt.Errorf("metadata: put image %s: %w", img.Name, err)
	}
	return nil
}

// GetImage implements metadata.Images.
func (d *DB) GetImage(ctx context.Context, name string) (sandbox.Image, error) {
	img, err := scanImage(d.sql.QueryRowContext(ctx, `SELECT `+imageCols+` FROM images WHERE name = ?`, name))
	if err != nil {
		return sandbox.Image{}, notFound(err, "image", name)
	}
	return img, nil
}

// ImageByDigest implements metadata.Images.
func (d *DB) ImageByDigest(ctx context.Context, digest string) (sandbox.Image, error) {
	img, err := scanImage(d.sql.QueryRowContext(ctx, `SELECT `+imageCols+` FROM images WHERE digest = ? ORDER BY name LIMIT 1`, digest))
	if err != nil {
		return sandbox.Image{}, notFound(err, "image", digest)
	}
	return img, nil
}

// ListImages implements metadata.Images.
func (d *DB) ListImages(ctx context.Context) ([]sandbox.Image, error) {
	return queryList(ctx, d, "list images", `SELECT `+imageCols+` FROM images ORDER BY name`, scanImage)
}

// volumes

func scanVolume(r scanner) (metadata.Volume, error) {
	var v metadata.Volume
	var created string
	err := r.Scan(&v.Name, &created, &v.CopiedFrom)
	v.CreatedAt = parseTS(created)
	return v, err
}

// CreateVolume implements metadata.Volumes.
func (d *DB) CreateVolume(ctx context.Context, v metadata.Volume) error {
	res, err := d.sql.ExecContext(ctx, `INSERT INTO volumes (name, created_at, copied_from) VALUES (?,?,?) ON CONFLICT(name) DO NOTHING`,
		v.Name, ts(v.CreatedAt), v.CopiedFrom)
	if err != nil {
		return fmt.Errorf("metadata: create volume %s: %w", v.Name, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("volume %s: %w", v.Name, metadata.ErrExists)
	}
	return nil
}

// GetVolume implements metadata.Volumes.
func (d *DB) GetVolume(ctx context.Context, name string) (metadata.Volume, error) {
	v, err := scanVolume(d.sql.QueryRowContext(ctx, `SELECT name, created_at, copied_from FROM volumes WHERE name = ?`, name))
	if err != nil {
		return metadata.Volume{}, notFound(err, "volume", name)
	}
	return v, nil
}

// ListVolumes implements metadata.Volumes.
func (d *DB) ListVolumes(ctx context.Context) ([]metadata.Volume, error) {
	return queryList(ctx, d, "list volumes", `SELECT name, created_at, copied_from FROM volumes ORDER BY name`, scanVolume)
}

// DeleteVolume implements metadata.Volumes.
func (d *DB) DeleteVolume(ctx context.Context, name string) error {
	res, err := d.sql.ExecContext(ctx, `DELETE FROM volumes WHERE name = ?`, name)
	return deleted(res, err, "volume", name)
}
