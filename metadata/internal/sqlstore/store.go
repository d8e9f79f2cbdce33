// Package sqlstore is the metadata store (metadata.Store) over a SQL
// database through database/sql, written once for every database torpor
// keeps records in: metadata/sqlite (one host's file) and metadata/postgres
// (a server several hosts share) open their database, apply their
// migrations and hand it here with their Dialect. Both schemas have the
// same tables and columns (the same schema versions); they differ in
// column types, which the Dialect covers.
//
// Semantics (metadata.Store's words): a sandbox update is
// UPDATE … WHERE id = ? AND version = ?; no row changed means ErrStale (or
// ErrNotFound). In SQLite one writer at a time makes that exact; in
// PostgreSQL a second writer of the row waits for the first's row lock and
// then finds the version changed (READ COMMITTED re-checks the WHERE
// clause), so of two writers of one version exactly one succeeds. Methods
// that write several records do so in one transaction.
package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Dialect is what differs between the databases.
type Dialect struct {
	// Rebind turns a query's ? placeholders into the database's (nil: ?).
	Rebind func(query string) string
	// Time is how a time is written: SQLite RFC 3339 text (which sorts by
	// time only when fractions have the same length: lists are sorted here
	// again), PostgreSQL timestamptz (a time.Time). Read back, either
	// scans into a string in RFC 3339 (database/sql formats a time.Time so).
	Time func(time.Time) any
	// None is what an optional time or JSON column holds when it has no
	// value: SQLite "" (its columns are NOT NULL DEFAULT ''), PostgreSQL
	// NULL (nil).
	None any
	// Unique says whether err is a violation of a UNIQUE constraint.
	Unique func(error) bool
}

// Store is a metadata.Store over db.
type Store struct {
	db *sql.DB
	d  Dialect
}

var _ metadata.Store = (*Store)(nil)

// New returns the store over db, whose schema is up to date.
func New(db *sql.DB, d Dialect) *Store {
	if d.Rebind == nil {
		d.Rebind = func(q string) string { return q }
	}
	return &Store{db: db, d: d}
}

// Close closes the database.
func (st *Store) Close() error { return st.db.Close() }

// ts is t as written.
func (st *Store) ts(t time.Time) any { return st.d.Time(t) }

// tsp is *t as written, NULL for nil.
func (st *Store) tsp(t *time.Time) any {
	if t == nil {
		return nil
	}
	return st.d.Time(*t)
}

// tsOrNone is t as written, None for the zero time.
func (st *Store) tsOrNone(t time.Time) any {
	if t.IsZero() {
		return st.d.None
	}
	return st.d.Time(t)
}

// orNone is s, None for "".
func (st *Store) orNone(s string) any {
	if s == "" {
		return st.d.None
	}
	return s
}

// parseTS reads a time column scanned into a string, in UTC; the zero time
// for "" or what does not parse.
func parseTS(s string) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, s)
	return t.UTC()
}

// parseTSp is a nullable time column's value, nil for NULL or "".
func parseTSp(s sql.NullString) *time.Time {
	if !s.Valid || s.String == "" {
		return nil
	}
	t := parseTS(s.String)
	return &t
}

type execer interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

type scanner interface{ Scan(...any) error }

// exec runs q (with ? placeholders) in x.
func (st *Store) exec(ctx context.Context, x execer, q string, args ...any) (sql.Result, error) {
	return x.ExecContext(ctx, st.d.Rebind(q), args...)
}

// row runs q (with ? placeholders) in x for one row.
func (st *Store) row(ctx context.Context, x execer, q string, args ...any) *sql.Row {
	return x.QueryRowContext(ctx, st.d.Rebind(q), args...)
}

// queryList runs q and scans each row with scan.
func queryList[T any](ctx context.Context, st *Store, what, q string, scan func(scanner) (T, error), args ...any) ([]T, error) {
	rows, err := st.db.QueryContext(ctx, st.d.Rebind(q), args...)
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
func (st *Store) inTx(ctx context.Context, what string, f func(tx *sql.Tx) error) error {
	tx, err := st.db.BeginTx(ctx, nil)
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

// oldestFirst sorts by time, then id. SQLite stores timestamps as RFC 3339
// text, whose order is not always the times' (fractions are trimmed), so
// lists are sorted here.
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
func (st *Store) nextGeneration(ctx context.Context, x execer) (int64, error) {
	var v int64
	err := st.row(ctx, x, `UPDATE counters SET value = value + 1 WHERE name = 'generation' RETURNING value`).Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("metadata: next generation: %w", err)
	}
	return v, nil
}

// NextGeneration implements metadata.Counters.
func (st *Store) NextGeneration(ctx context.Context) (int64, error) {
	return st.nextGeneration(ctx, st.db)
}

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

// updated maps an UPDATE's result to ErrNotFound when it changed no row.
func updated(res sql.Result, err error, what, id string) error {
	if err != nil {
		return fmt.Errorf("metadata: update %s %s: %w", what, id, err)
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
	img.CreatedAt = parseTS(created.String)
	return img, nil
}

// PutImage implements metadata.Images.
func (st *Store) PutImage(ctx context.Context, img sandbox.Image) error {
	_, err := st.exec(ctx, st.db, `INSERT INTO images (`+imageCols+`) VALUES (?, ?, ?, ?, ?)
		ON CONFLICT(name) DO UPDATE SET digest = excluded.digest, bytes = excluded.bytes, source = excluded.source, created_at = excluded.created_at`,
		img.Name, img.Digest, img.Bytes, img.Source, st.ts(img.CreatedAt))
	if err != nil {
		return fmt.Errorf("metadata: put image %s: %w", img.Name, err)
	}
	return nil
}

// GetImage implements metadata.Images.
func (st *Store) GetImage(ctx context.Context, name string) (sandbox.Image, error) {
	img, err := scanImage(st.row(ctx, st.db, `SELECT `+imageCols+` FROM images WHERE name = ?`, name))
	if err != nil {
		return sandbox.Image{}, notFound(err, "image", name)
	}
	return img, nil
}

// ImageByDigest implements metadata.Images.
func (st *Store) ImageByDigest(ctx context.Context, digest string) (sandbox.Image, error) {
	img, err := scanImage(st.row(ctx, st.db, `SELECT `+imageCols+` FROM images WHERE digest = ? ORDER BY name LIMIT 1`, digest))
	if err != nil {
		return sandbox.Image{}, notFound(err, "image", digest)
	}
	return img, nil
}

// ListImages implements metadata.Images.
func (st *Store) ListImages(ctx context.Context) ([]sandbox.Image, error) {
	return queryList(ctx, st, "list images", `SELECT `+imageCols+` FROM images ORDER BY name`, scanImage)
}

// volumes

func scanVolume(r scanner) (metadata.Volume, error) {
	var v metadata.Volume
	var created string
	err := r.Scan(&v.Name, &created, &v.CopiedFrom, &v.Node)
	v.CreatedAt = parseTS(created)
	return v, err
}

// CreateVolume implements metadata.Volumes.
func (st *Store) CreateVolume(ctx context.Context, v metadata.Volume) error {
	res, err := st.exec(ctx, st.db, `INSERT INTO volumes (name, created_at, copied_from, node) VALUES (?,?,?,?) ON CONFLICT(name) DO NOTHING`,
		v.Name, st.ts(v.CreatedAt), v.CopiedFrom, v.Node)
	if err != nil {
		return fmt.Errorf("metadata: create volume %s: %w", v.Name, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("volume %s: %w", v.Name, metadata.ErrExists)
	}
	return nil
}

// GetVolume implements metadata.Volumes.
func (st *Store) GetVolume(ctx context.Context, name string) (metadata.Volume, error) {
	v, err := scanVolume(st.row(ctx, st.db, `SELECT name, created_at, copied_from, node FROM volumes WHERE name = ?`, name))
	if err != nil {
		return metadata.Volume{}, notFound(err, "volume", name)
	}
	return v, nil
}

// ListVolumes implements metadata.Volumes.
func (st *Store) ListVolumes(ctx context.Context) ([]metadata.Volume, error) {
	return queryList(ctx, st, "list volumes", `SELECT name, created_at, copied_from, node FROM volumes ORDER BY name`, scanVolume)
}

// DeleteVolume implements metadata.Volumes.
func (st *Store) DeleteVolume(ctx context.Context, name string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM volumes WHERE name = ?`, name)
	return deleted(res, err, "volume", name)
}

// tspOrNone is *t as written, None for nil.
func (st *Store) tspOrNone(t *time.Time) any {
	if t == nil {
		return st.d.None
	}
	return st.d.Time(*t)
}
