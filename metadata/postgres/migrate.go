package postgres

import (
	"context"
	"database/sql"
	"embed"
	"fmt"

	"github.com/torpor/torpor/metadata/internal/migration"
)

// The schema is the numbered migrations in migrations/ (embedded in the
// binary): NNNN_what.sql, numbered from 0001 without gaps, one per schema
// version of metadata/sqlite's migrations (the same versions, in
// PostgreSQL's types). Open applies those the database does not have yet,
// in order, each in its own transaction together with its row in table
// schema_migrations (version, name, applied_at), so a database is always at
// exactly one version: its highest row. Several hosts may start at once:
// migrate holds an advisory lock while it reads and applies, so exactly one
// of them applies each migration and the others find it done. A migration
// once released is never edited; a change is a new file.

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrateLockKey is the advisory lock migrate holds ("torm" in ASCII).
const migrateLockKey = 0x746f726d

// migrations returns the embedded migrations in order (see
// migration.Load for its errors).
func migrations() ([]migration.Migration, error) {
	return migration.Load(migrationFiles, "migrations")
}

// SchemaVersion is the schema version this package brings a database to.
func SchemaVersion() int {
	ms, _ := migrations()
	return len(ms)
}

// migrate applies the migrations db lacks. Errors: a migration failed (it
// is rolled back), or db's version is higher than the migrations known here
// (a newer torpor wrote it; an older one must not write to it).
func migrate(ctx context.Context, db *sql.DB) error {
	ms, err := migrations()
	if err != nil {
		return err
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, int64(migrateLockKey)); err != nil {
		return fmt.Errorf("migrations: lock: %w", err)
	}
	defer conn.ExecContext(context.Background(), `SELECT pg_advisory_unlock($1)`, int64(migrateLockKey))
	if _, err := conn.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	have, err := schemaVersion(ctx, conn)
	if err != nil {
		return err
	}
	if have > len(ms) {
		return fmt.Errorf("schema version %d is newer than this torpor's %d: the database was written by a newer torpor", have, len(ms))
	}
	for _, m := range ms[have:] {
		if err := apply(ctx, conn, m); err != nil {
			return fmt.Errorf("migration %s: %w", m.Name, err)
		}
	}
	return nil
}

// apply runs m and records it, in one transaction on conn.
func apply(ctx context.Context, conn *sql.Conn, m migration.Migration) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, m.SQL); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
		return err
	}
	return tx.Commit()
}

// schemaVersion is the highest version in schema_migrations (0: none).
func schemaVersion(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}) (int, error) {
	var v int
	if err := q.QueryRowContext(ctx, `SELECT coalesce(max(version), 0) FROM schema_migrations`).Scan(&v); err != nil {
		return 0, fmt.Errorf("schema version: %w", err)
	}
	return v, nil
}
