// Package postgres is the metadata store (metadata.Store) in a PostgreSQL
// database, reached with pgx (github.com/jackc/pgx/v5) through a connection
// pool: what several hosts would share, where metadata/sqlite keeps one
// host's records in a file. Both pass the conformance suite
// metadata/storetest and keep the same records with the same semantics: a
// sandbox update names the version it read and fails with metadata.ErrStale
// if another writer (another connection, another host) changed the row since;
// the methods that write several records do so in one transaction.
//
// Its schema is the numbered migrations in migrations/, the same schema
// versions as metadata/sqlite's, applied on Open (see migrate.go). Columns
// use PostgreSQL's types: times are timestamptz (microseconds: a time reads
// back truncated to the microsecond), structured fields jsonb
// (metadata/internal/columns), a field's "none" NULL.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// DB is a metadata.Store in a PostgreSQL database.
type DB struct {
	pool *pgxpool.Pool
	// server is the connection that holds the server lock (LockServer),
	// taken out of the pool.
	server *pgx.Conn
}

var _ metadata.Store = (*DB)(nil)

// ConnectTimeout bounds Open's first connection.
const ConnectTimeout = 15 * time.Second

// Open connects to the database at connURL (postgres://user:password@host:port/db?…
// or a key=value string, see pgx's ParseConfig; a unix socket directory as
// host=/path) and brings its schema up to date (migrate). Errors, each naming
// the database without its password: connURL does not parse, the server
// does not answer or refuses the login within ConnectTimeout, a migration
// failed (nothing of it is applied), or the schema was written by a newer
// torpor.
func Open(ctx context.Context, connURL string) (*DB, error) {
	cfg, err := pgxpool.ParseConfig(connURL)
	if err != nil {
		return nil, fmt.Errorf("metadata: postgres: %w", err)
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = "torpor"
	}
	name := describe(cfg.ConnConfig)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("metadata: postgres %s: %w", name, err)
	}
	pctx, cancel := context.WithTimeout(ctx, ConnectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("metadata: postgres %s: connect: %w", name, err)
	}
	if err := migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("metadata: postgres %s: %w", name, err)
	}
	return &DB{pool: pool}, nil
}

// describe names a database for messages: user@host:port/database, no
// password.
func describe(c *pgx.ConnConfig) string {
	u := url.URL{Scheme: "postgres", User: url.User(c.User), Host: fmt.Sprintf("%s:%d", c.Host, c.Port), Path: "/" + c.Database}
	return u.String()
}

// Close releases the server lock, if held, and closes the pool.
func (d *DB) Close() error {
	if d.server != nil {
		// Unlocked at once; a closed session's locks go only once its
		// backend has noticed.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		d.server.Exec(ctx, `SELECT pg_advisory_unlock($1)`, int64(serverLockKey))
		d.server.Close(ctx)
		cancel()
		d.server = nil
	}
	d.pool.Close()
	return nil
}

// ErrLocked: another torpor server holds the database (LockServer).
var ErrLocked = errors.New("another torpor server uses this database")

// serverLockKey is the advisory lock LockServer takes (any fixed number
// that no other user of the database takes; these are "torp" in ASCII).
const serverLockKey = 0x746f7270

// LockServer takes the database's server lock: a session advisory lock on
// one of the pool's connections, held until Close (or until that
// connection ends). A torpor server reconciles every sandbox record with
// its own host, so until sandboxes have owners, one server per database.
// Errors: ErrLocked (wrapped) when another session holds it; a failure of
// the database.
func (d *DB) LockServer(ctx context.Context) error {
	if d.server != nil {
		return nil
	}
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("metadata: server lock: %w", err)
	}
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, int64(serverLockKey)).Scan(&ok); err != nil {
		conn.Release()
		return fmt.Errorf("metadata: server lock: %w", err)
	}
	if !ok {
		conn.Release()
		var pid int
		_ = d.pool.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = $1 AND granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, int64(serverLockKey)).Scan(&pid)
		var addr string
		_ = d.pool.QueryRow(ctx, `SELECT coalesce(host(client_addr), 'local socket') FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&addr)
		return fmt.Errorf("metadata: %w (its session: backend pid %d from %s)", ErrLocked, pid, addr)
	}
	d.server = conn.Hijack()
	return nil
}

func utc(t time.Time) time.Time { return t.UTC() }

// utcp is t in UTC, nil for nil.
func utcp(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	u := t.UTC()
	return &u
}

// orNull is s, NULL for "".
func orNull(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// str is *s, "" for NULL.
func str(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// timeOrNull is t, NULL for the zero time.
func timeOrNull(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// queryList runs q and scans each row with scan; no rows give nil.
func queryList[T any](ctx context.Context, d *DB, what, q string, scan func(pgx.Row) (T, error), args ...any) ([]T, error) {
	rows, err := d.pool.Query(ctx, q, args...)
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

func scanString(r pgx.Row) (string, error) {
	var s string
	err := r.Scan(&s)
	return s, err
}

// querier is what runs a statement: the pool or a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// inTx runs f in a transaction and commits it if f succeeds.
func (d *DB) inTx(ctx context.Context, what string, f func(tx pgx.Tx) error) error {
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("metadata: %s: %w", what, err)
	}
	defer tx.Rollback(context.Background())
	if err := f(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("metadata: %s: %w", what, err)
	}
	return nil
}

// nextGeneration increments the generation counter in q (its row lock
// orders concurrent callers; in a transaction, a rollback gives the value
// back).
func nextGeneration(ctx context.Context, q querier) (int64, error) {
	var v int64
	err := q.QueryRow(ctx, `UPDATE counters SET value = value + 1 WHERE name = 'generation' RETURNING value`).Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("metadata: next generation: %w", err)
	}
	return v, nil
}

// NextGeneration implements metadata.Counters.
func (d *DB) NextGeneration(ctx context.Context) (int64, error) { return nextGeneration(ctx, d.pool) }

// deleted maps a DELETE's result to ErrNotFound when it removed no row.
func deleted(tag pgconn.CommandTag, err error, what, id string) error {
	if err != nil {
		return fmt.Errorf("metadata: delete %s %s: %w", what, id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%s %s: %w", what, id, metadata.ErrNotFound)
	}
	return nil
}

// updated maps an UPDATE's result to ErrNotFound when it changed no row.
func updated(tag pgconn.CommandTag, err error, what, id string) error {
	if err != nil {
		return fmt.Errorf("metadata: update %s %s: %w", what, id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%s %s: %w", what, id, metadata.ErrNotFound)
	}
	return nil
}

// notFound maps pgx.ErrNoRows to ErrNotFound.
func notFound(err error, what, id string) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%s %s: %w", what, id, metadata.ErrNotFound)
	}
	return fmt.Errorf("metadata: get %s %s: %w", what, id, err)
}

// uniqueViolation says whether err is PostgreSQL's unique_violation.
func uniqueViolation(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "23505"
}

// images

const imageCols = `name, digest, bytes, source, created_at`

func scanImage(r pgx.Row) (sandbox.Image, error) {
	var img sandbox.Image
	var created *time.Time
	if err := r.Scan(&img.Name, &img.Digest, &img.Bytes, &img.Source, &created); err != nil {
		return sandbox.Image{}, err
	}
	if created != nil {
		img.CreatedAt = created.UTC()
	}
	return img, nil
}

// PutImage implements metadata.Images.
func (d *DB) PutImage(ctx context.Context, img sandbox.Image) error {
	_, err := d.pool.Exec(ctx, `INSERT INTO images (`+imageCols+`) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, bytes = excluded.bytes, source = excluded.source, created_at = excluded.created_at`,
		img.Name, img.Digest, img.Bytes, img.Source, timeOrNull(img.CreatedAt))
	if err != nil {
		return fmt.Errorf("metadata: put image %s: %w", img.Name, err)
	}
	return nil
}

// GetImage implements metadata.Images.
func (d *DB) GetImage(ctx context.Context, name string) (sandbox.Image, error) {
	img, err := scanImage(d.pool.QueryRow(ctx, `SELECT `+imageCols+` FROM images WHERE name = $1`, name))
	if err != nil {
		return sandbox.Image{}, notFound(err, "image", name)
	}
	return img, nil
}

// ImageByDigest implements metadata.Images.
func (d *DB) ImageByDigest(ctx context.Context, digest string) (sandbox.Image, error) {
	img, err := scanImage(d.pool.QueryRow(ctx, `SELECT `+imageCols+` FROM images WHERE digest = $1 ORDER BY name LIMIT 1`, digest))
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

func scanVolume(r pgx.Row) (metadata.Volume, error) {
	var v metadata.Volume
	err := r.Scan(&v.Name, &v.CreatedAt, &v.CopiedFrom)
	v.CreatedAt = utc(v.CreatedAt)
	return v, err
}

// CreateVolume implements metadata.Volumes.
func (d *DB) CreateVolume(ctx context.Context, v metadata.Volume) error {
	tag, err := d.pool.Exec(ctx, `INSERT INTO volumes (name, created_at, copied_from) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING`,
		v.Name, v.CreatedAt, v.CopiedFrom)
	if err != nil {
		return fmt.Errorf("metadata: create volume %s: %w", v.Name, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("volume %s: %w", v.Name, metadata.ErrExists)
	}
	return nil
}

// GetVolume implements metadata.Volumes.
func (d *DB) GetVolume(ctx context.Context, name string) (metadata.Volume, error) {
	v, err := scanVolume(d.pool.QueryRow(ctx, `SELECT name, created_at, copied_from FROM volumes WHERE name = $1`, name))
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
	tag, err := d.pool.Exec(ctx, `DELETE FROM volumes WHERE name = $1`, name)
	return deleted(tag, err, "volume", name)
}
