// Package postgres is the metadata store (metadata.Store) in a PostgreSQL
// database, reached with pgx (github.com/jackc/pgx/v5, through its
// database/sql driver): what several hosts would share, where metadata/sqlite
// keeps one host's records in a file. The records are read and written by
// metadata/internal/sqlstore, as SQLite's are, and both pass the conformance
// suite metadata/storetest with the same semantics: a sandbox update names
// the version it read and fails with metadata.ErrStale if another writer
// (another connection, another host) changed the row since; the methods
// that write several records do so in one transaction.
//
// Its schema is the numbered migrations in migrations/, the same schema
// versions as metadata/sqlite's, applied on Open (see migrate.go). Columns
// use PostgreSQL's types: times are timestamptz (microseconds: a time reads
// back truncated to the microsecond), structured fields jsonb, booleans
// boolean, a field's "none" NULL.
package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/internal/sqlstore"
)

// DB is a metadata.Store in a PostgreSQL database.
type DB struct {
	*sqlstore.Store
	sql *sql.DB
	// lockMu guards the node lock's fields: server is the session that
	// holds it (LockServer; nil: none), node its name, session that
	// session's backend (to tell it from another server's once the
	// connection to it is lost).
	lockMu  sync.Mutex
	server  *sql.Conn
	node    string
	session backend
}

// backend names a server session: its process id and start time (a pid
// alone may be reused).
type backend struct {
	pid   int64
	start time.Time
}

var _ metadata.Store = (*DB)(nil)

// dialect: $n placeholders, times as timestamptz, NULL for none.
var dialect = sqlstore.Dialect{
	Rebind: rebind,
	Time:   func(t time.Time) any { return t },
	None:   nil,
	Unique: func(err error) bool {
		var pg *pgconn.PgError
		return errors.As(err, &pg) && pg.Code == "23505" // unique_violation
	},
}

// rebind numbers q's ? placeholders $1, $2, … (torpor's queries have no ?
// in a literal).
func rebind(q string) string {
	var b strings.Builder
	n := 0
	for _, r := range q {
		if r == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// ConnectTimeout bounds Open's first connection.
const ConnectTimeout = 15 * time.Second

// MaxConns bounds the connections a store opens to the server.
const MaxConns = 16

// Open connects to the database at connURL (postgres://user:password@host:port/db?…
// or a key=value string, see pgx's ParseConfig; a unix socket directory as
// host=/path) and brings its schema up to date (migrate). Errors, each naming
// the database without its password: connURL does not parse, the server
// does not answer or refuses the login within ConnectTimeout, a migration
// failed (nothing of it is applied), or the schema was written by a newer
// torpor.
func Open(ctx context.Context, connURL string) (*DB, error) {
	cfg, err := pgx.ParseConfig(connURL)
	if err != nil {
		return nil, fmt.Errorf("metadata: postgres: %w", err)
	}
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "torpor"
	}
	name := Describe(cfg)
	db := stdlib.OpenDB(*cfg, stdlib.OptionAfterConnect(utcTimes))
	db.SetMaxOpenConns(MaxConns)
	db.SetMaxIdleConns(4)
	pctx, cancel := context.WithTimeout(ctx, ConnectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata: postgres %s: connect: %w", name, err)
	}
	if err := migrate(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata: postgres %s: %w", name, err)
	}
	return &DB{Store: sqlstore.New(db, dialect), sql: db}, nil
}

// utcTimes makes conn read timestamptz values in UTC (pgx's default is the
// process's local zone, whose offsets of long ago have seconds that RFC 3339
// text, as database/sql hands times to sqlstore, cannot carry).
func utcTimes(_ context.Context, conn *pgx.Conn) error {
	conn.TypeMap().RegisterType(&pgtype.Type{Name: "timestamptz", OID: pgtype.TimestamptzOID,
		Codec: &pgtype.TimestamptzCodec{ScanLocation: time.UTC}})
	return nil
}

// Describe names a database for messages: postgres://user@host:port/database
// (a socket directory: postgres://user@/database?host=/dir), without a
// password.
func Describe(c *pgx.ConnConfig) string {
	u := url.URL{Scheme: "postgres", User: url.User(c.User), Host: fmt.Sprintf("%s:%d", c.Host, c.Port), Path: "/" + c.Database}
	if strings.HasPrefix(c.Host, "/") {
		u.Host, u.RawQuery = "", "host="+c.Host
	}
	return u.String()
}

// Close releases the server lock, if held, and closes the database.
func (d *DB) Close() error {
	d.lockMu.Lock()
	if d.server != nil {
		// Unlocked at once: a closed session's locks go only once its
		// backend has noticed.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		d.server.ExecContext(ctx, `SELECT pg_advisory_unlock($1, hashtext($2))`, int32(serverLockKey), d.node)
		d.server.Close()
		cancel()
		d.server = nil
	}
	d.lockMu.Unlock()
	return d.Store.Close()
}

// ErrLocked: another torpor server uses the database as the same node
// (LockServer).
var ErrLocked = errors.New("another torpor server uses this database")

// serverLockKey is the first key of the advisory locks LockServer takes
// (any fixed number that no other user of the database takes; these are
// "torp" in ASCII); the second is the hash of the node's name.
const serverLockKey = 0x746f7270

// LockServer takes the database's lock of node: a session advisory lock on
// one connection, held until Close (or until that session ends: see
// KeepServerLock). A server acts on the sandboxes its node owns and
// reattaches them at start, so two servers must not be one node; servers
// with different node names share the database. Errors: ErrLocked
// (wrapped, naming the node and the holder's session) when another session
// holds it; a failure of the database.
func (d *DB) LockServer(ctx context.Context, node string) error {
	d.lockMu.Lock()
	defer d.lockMu.Unlock()
	if d.server != nil {
		return nil
	}
	return d.lockServer(ctx, node)
}

// lockServer is LockServer with lockMu held and no session. A holder that
// is this store's own earlier session (its connection lost on this side
// while the server still runs it: a cut network) is ended
// (pg_terminate_backend) and the lock taken again, for up to 5 s.
func (d *DB) lockServer(ctx context.Context, node string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		conn, err := d.sql.Conn(ctx)
		if err != nil {
			return fmt.Errorf("metadata: server lock: %w", err)
		}
		var ok bool
		var self backend
		if err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock($1, hashtext($2)), pg_backend_pid(),
			(SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())`, int32(serverLockKey), node).Scan(&ok, &self.pid, &self.start); err != nil {
			conn.Close()
			return fmt.Errorf("metadata: server lock: %w", err)
		}
		if ok {
			d.server, d.node, d.session = conn, node, self
			return nil
		}
		conn.Close()
		holder, from, _ := d.holder(ctx, node)
		gone := holder.pid == 0 // released since the try
		own := d.node == node && holder.pid == d.session.pid && holder.start.Equal(d.session.start)
		if (!own && !gone) || time.Now().After(deadline) {
			return fmt.Errorf("metadata: %w as node %s (its session: backend %d from %s, since %s)", ErrLocked, node, holder.pid, from,
				holder.start.UTC().Format(time.RFC3339))
		}
		if gone {
			continue
		}
		if _, err := d.sql.ExecContext(ctx, `SELECT pg_terminate_backend($1)`, holder.pid); err != nil {
			return fmt.Errorf("metadata: server lock: end this server's lost session (backend %d): %w", holder.pid, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("metadata: server lock: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// holder is the session that holds node's lock (pid 0: none) and where it
// comes from (a client address or "the local socket").
func (d *DB) holder(ctx context.Context, node string) (b backend, from string, err error) {
	err = d.sql.QueryRowContext(ctx, `SELECT a.pid, a.backend_start, coalesce(host(a.client_addr), 'the local socket')
		FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objid = hashtext($2)::oid AND l.objsubid = 2 AND l.granted AND l.database =
			(SELECT oid FROM pg_database WHERE datname = current_database())`, int64(serverLockKey), node).Scan(&b.pid, &b.start, &from)
	if errors.Is(err, sql.ErrNoRows) {
		err = nil
	}
	return b, from, err
}

// ServerLockHolder is the backend process id of the session that holds
// node's server lock (LockServer) in this database, 0 when none does (for
// operators and tests: pg_terminate_backend ends it). Errors: the
// database's.
func (d *DB) ServerLockHolder(ctx context.Context, node string) (pid int64, err error) {
	b, _, err := d.holder(ctx, node)
	return b.pid, err
}

// KeepServerLock makes sure the store still holds the lock LockServer took:
// it asks the lock's session whether it holds it, and when that session is
// gone (its connection failed or was cut, the database restarted, the
// backend was terminated) takes the lock again on a new session; retaken
// says it did. A server calls it every second and before it serves again
// after fencing itself. Errors: ErrLocked (wrapped, naming the node and the
// holder's session) when another session took the lock meanwhile (another
// server as this node: this one must stop acting as it); a failure of the
// database (the lock is not held; call again); no LockServer before.
func (d *DB) KeepServerLock(ctx context.Context) (retaken bool, err error) {
	d.lockMu.Lock()
	defer d.lockMu.Unlock()
	if d.node == "" {
		return false, errors.New("metadata: server lock: not taken (LockServer)")
	}
	if d.server != nil {
		var held bool
		err := d.server.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
			AND classid = $1 AND objid = hashtext($2)::oid AND objsubid = 2 AND granted)`, int64(serverLockKey), d.node).Scan(&held)
		if err == nil && held {
			return false, nil
		}
		// Gone, or not answering: never used again (closed, not returned
		// to the pool, where it might hold the lock for another caller).
		d.server.Raw(func(any) error { return driver.ErrBadConn })
		d.server.Close()
		d.server = nil
	}
	if err := d.lockServer(ctx, d.node); err != nil {
		return false, err
	}
	return true, nil
}
