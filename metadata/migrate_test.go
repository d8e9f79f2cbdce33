package metadata

import (
	"database/sql"
	"path/filepath"
	"testing"
)

// firstSchema is the sandboxes and snapshots tables as the first release made them,
// before any column was added; migration tests start from it.
const firstSchema = `CREATE TABLE sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL, image TEXT NOT NULL,
		image_digest TEXT NOT NULL, guest_digest TEXT NOT NULL, memory_mib INTEGER NOT NULL, cpus REAL NOT NULL,
		env TEXT NOT NULL, generation INTEGER NOT NULL, forked_from TEXT NOT NULL DEFAULT '',
		snapshot_id TEXT NOT NULL DEFAULT '', pending_snapshot TEXT NOT NULL DEFAULT '', instance TEXT NOT NULL DEFAULT '',
		seq INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '', deleting INTEGER NOT NULL DEFAULT 0,
		created_at TEXT NOT NULL, state_changed_at TEXT NOT NULL, last_hibernate_at TEXT, last_resume_at TEXT,
		resume_ms INTEGER NOT NULL DEFAULT 0);
		CREATE TABLE snapshots (id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, parent TEXT NOT NULL DEFAULT '',
		bytes INTEGER NOT NULL, hibernate_ms INTEGER NOT NULL, engine TEXT NOT NULL, created_at TEXT NOT NULL);`

// oldDatabase writes a database with firstSchema and the given statements (rows)
// and returns its path, for tests of what Open migrates.
func oldDatabase(t *testing.T, rows string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "old.db")
	old, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if _, err := old.Exec(firstSchema + "\n" + rows); err != nil {
		t.Fatal(err)
	}
	return path
}
