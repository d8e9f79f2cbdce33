package server

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/metadata/sqlite"
)

// CheckDatabase says whether database is a metadata database a server can
// be pointed at: "" (SQLite in the data directory) or a postgres:// (or
// postgresql://) URL. It does not connect.
func CheckDatabase(database string) error {
	if database == "" || strings.HasPrefix(database, "postgres://") || strings.HasPrefix(database, "postgresql://") {
		return nil
	}
	return fmt.Errorf("--database %q: want a postgres://user@host:port/dbname URL (or none: SQLite in the data directory)", redact(database))
}

// redact drops what may be a password from a database string for messages:
// everything between "://" and the last "@".
func redact(s string) string {
	scheme, rest, ok := strings.Cut(s, "://")
	if i := strings.LastIndex(rest, "@"); ok && i >= 0 {
		return scheme + "://…@" + rest[i+1:]
	}
	return s
}

// OpenDatabase opens the metadata store: database "" is the SQLite file
// torpor.db in dataDir; a postgres:// URL is that PostgreSQL database
// (metadata/postgres; its schema is migrated on open). Errors: database is
// neither (CheckDatabase), or the store's Open error (a PostgreSQL server
// that does not answer within postgres.ConnectTimeout, a refused login, a
// failed migration).
func OpenDatabase(ctx context.Context, dataDir, database string) (metadata.Store, error) {
	if err := CheckDatabase(database); err != nil {
		return nil, err
	}
	if database == "" {
		return sqlite.Open(filepath.Join(dataDir, "torpor.db"))
	}
	return postgres.Open(ctx, database)
}

// openServerDatabase is OpenDatabase for a server that is node: in a
// PostgreSQL database it also takes that node's lock
// (postgres.DB.LockServer), since a server reattaches and acts on the
// sandboxes its node owns.
func openServerDatabase(ctx context.Context, dataDir, database, node string) (metadata.Store, error) {
	db, err := OpenDatabase(ctx, dataDir, database)
	if err != nil {
		return nil, err
	}
	if pg, ok := db.(*postgres.DB); ok {
		if err := pg.LockServer(ctx, node); err != nil {
			pg.Close()
			return nil, fmt.Errorf("%w: one torpor server per node name; give each server its own --node", err)
		}
	}
	return db, nil
}
