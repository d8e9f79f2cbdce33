// Package sqlite is the metadata store (metadata.Store) in an embedded SQLite
// database: one file in the data directory (modernc.org/sqlite, pure Go, no
// cgo), in WAL mode with synchronous=FULL so a committed transaction survives
// a power loss. Its schema is the numbered migrations in migrations/, applied
// in order on Open (see migrate.go); the records are read and written by
// metadata/internal/sqlstore, as metadata/postgres's are.
package sqlite

import (
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	_ "modernc.org/sqlite" // registers driver "sqlite"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/internal/sqlstore"
)

// DB is a metadata.Store in a SQLite database file.
type DB struct {
	*sqlstore.Store
	sql *sql.DB
}

var _ metadata.Store = (*DB)(nil)

// dialect: times as RFC 3339 text (UTC, nanoseconds), "" for none in the
// optional columns that are NOT NULL, the driver's UNIQUE message.
var dialect = sqlstore.Dialect{
	Time:   func(t time.Time) any { return t.UTC().Format(time.RFC3339Nano) },
	None:   "",
	Unique: func(err error) bool { return strings.Contains(err.Error(), "UNIQUE") },
}

// Open opens (creating if needed) the database file at path and brings its
// schema up to date (migrate). Errors: the file cannot be opened, a
// migration failed (nothing of it is applied), or the database was written
// by a newer torpor (its schema version is higher than this one knows).
func Open(path string) (*DB, error) {
	if err := private(path); err != nil {
		return nil, fmt.Errorf("metadata: open %s: %w", path, err)
	}
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
	return &DB{Store: sqlstore.New(db, dialect), sql: db}, nil
}

// private makes the database file at path (created empty if missing, as
// SQLite would) readable by its owner only, and its -wal and -shm files if
// they exist: it holds the hashes of API keys and the environment given to
// sandboxes. SQLite gives the files it creates beside a database the
// database file's mode. Errors: the file system's.
func private(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	f.Close()
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		if err := os.Chmod(p, 0o600); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}
