package sqlite

import (
	"database/sql"
	"embed"
	"fmt"

	"github.com/torpor/torpor/metadata/internal/migration"
)

// The schema is the numbered migrations in migrations/ (embedded in the
// binary): NNNN_what.sql, numbered from 0001 without gaps. Open applies those
// the database does not have yet, in order, each in its own transaction
// together with recording its number in PRAGMA user_version, so a database is
// always at exactly one version. A migration once released is never edited;
// a change is a new file.
//
// Databases made before numbered migrations (user_version 0 with tables)
// grew by added columns; adoptLegacy brings any of them to the schema of
// 0001 first.

//go:embed migrations/*.sql
var migrationFiles embed.FS

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

// migrate applies the migrations db lacks. Errors: a migration failed (it is
// rolled back), or db's version is higher than the migrations known here (a
// newer torpor wrote it; an older one must not write to it).
func migrate(db *sql.DB) error {
	ms, err := migrations()
	if err != nil {
		return err
	}
	var have int
	if err := db.QueryRow(`PRAGMA user_version`).Scan(&have); err != nil {
		return fmt.Errorf("schema version: %w", err)
	}
	if have > len(ms) {
		return fmt.Errorf("schema version %d is newer than this torpor's %d: the database was written by a newer torpor", have, len(ms))
	}
	if have == 0 {
		if err := adoptLegacy(db); err != nil {
			return fmt.Errorf("adopt a database from before numbered migrations: %w", err)
		}
	}
	for _, m := range ms[have:] {
		tx, err := db.Begin()
		if err != nil {
			return err
		}
		if _, err := tx.Exec(m.SQL); err != nil {
			tx.Rollback()
			return fmt.Errorf("migration %s: %w", m.Name, err)
		}
		if _, err := tx.Exec(fmt.Sprintf(`PRAGMA user_version = %d`, m.Version)); err != nil {
			tx.Rollback()
			return fmt.Errorf("migration %s: record version: %w", m.Name, err)
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("migration %s: %w", m.Name, err)
		}
	}
	return nil
}

// legacyColumns are the columns releases before numbered migrations added to
// their first tables (each existing row gets the default); a database of
// that era has some or all of them.
var legacyColumns = []struct{ table, name, def string }{
	{"sandboxes", "idle_timeout_s", "INTEGER NOT NULL DEFAULT 15"},
	{"sandboxes", "timeout_s", "INTEGER NOT NULL DEFAULT 0"},
	{"sandboxes", "on_timeout", "TEXT NOT NULL DEFAULT 'hibernate'"},
	{"sandboxes", "hibernation_mode", "TEXT NOT NULL DEFAULT 'memory'"},
	{"sandboxes", "on_resume", "TEXT NOT NULL DEFAULT ''"},
	{"sandboxes", "volumes", "TEXT NOT NULL DEFAULT ''"},
	{"sandboxes", "running_ms", "INTEGER NOT NULL DEFAULT 0"},
	{"sandboxes", "timeout_base_ms", "INTEGER NOT NULL DEFAULT 0"},
	{"sandboxes", "snapshot_byte_s", "REAL NOT NULL DEFAULT 0"},
	{"sandboxes", "usage_at", "TEXT NOT NULL DEFAULT ''"},
	{"sandboxes", "last_resume", "TEXT NOT NULL DEFAULT ''"},
	{"sandboxes", "expires_at", "TEXT NOT NULL DEFAULT ''"},
	{"snapshots", "logical_bytes", "INTEGER NOT NULL DEFAULT 0"},
	{"snapshots", "stored_bytes", "INTEGER NOT NULL DEFAULT 0"},
	{"snapshots", "new_bytes", "INTEGER NOT NULL DEFAULT 0"},
}

// adoptLegacy adds to a database at user_version 0 the legacyColumns its
// tables lack, in one transaction, so that 0001 finds the schema it
// describes. A new (empty) database has no tables and is left alone. This is
// the only place that reads a table's columns, and it runs once per
// database: afterwards user_version says what the schema is.
func adoptLegacy(db *sql.DB) error {
	tx, err := db.Begin()
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for _, c := range legacyColumns {
		var tables, have int
		if err := tx.QueryRow(`SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?`, c.table).Scan(&tables); err != nil {
			return err
		}
		if tables == 0 {
			continue
		}
		if err := tx.QueryRow(`SELECT count(*) FROM pragma_table_info(?) WHERE name = ?`, c.table, c.name).Scan(&have); err != nil {
			return err
		}
		if have == 0 {
			if _, err := tx.Exec(`ALTER TABLE ` + c.table + ` ADD COLUMN ` + c.name + ` ` + c.def); err != nil {
				return fmt.Errorf("add column %s.%s: %w", c.table, c.name, err)
			}
		}
	}
	return tx.Commit()
}
