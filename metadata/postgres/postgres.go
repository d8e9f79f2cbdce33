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
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
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
	// server is the session that holds the node lock (LockServer), node its
	// name.
	server *sql.Conn
	node   string
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
	if d.server != nil {
		// Unlocked at once: a closed session's locks go only once its
		// backend has noticed.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		d.server.ExecContext(ctx, `SELECT pg_advisory_unlock($1, hashtext($2))`, int32(serverLockKey), d.node)
		d.server.Close()
		cancel()
		d.server = nil
	}
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
// one connection, held until Close (or until that session ends). A server
// acts on the sandboxes its node owns and reattaches them at start, so two
// servers must not be one node; servers with different node names share
// the database. Errors: ErrLocked (wrapped, naming the node and the
// holder's session) when another session holds it; a failure of the
// database.
func (d *DB) LockServer(ctx context.Context, node string) error {
	if d.server != nil {
		return nil
	}
	conn, err := d.sql.Conn(ctx)
	if err != nil {
		return fmt.Errorf("metadata: server lock: %w", err)
	}
	var ok bool
	if err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock($1, hashtext($2))`, int32(serverLockKey), node).Scan(&ok); err != nil {
		conn.Close()
		return fmt.Errorf("metadata: server lock: %w", err)
	}
	if !ok {
		conn.Close()
		var holder string
		_ = d.sql.QueryRowContext(ctx, `SELECT a.pid || ' from ' || coalesce(host(a.client_addr), 'the local socket')
			FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objid = hashtext($2)::oid AND l.objsubid = 2 AND l.granted AND l.database =
				(SELECT oid FROM pg_database WHERE datname = current_database())`, int64(serverLockKey), node).Scan(&holder)
		return fmt.Errorf("metadata: %w as node %s (its session: backend %s)", ErrLocked, node, holder)
	}
	d.server, d.node = conn, node
	return nil
}
