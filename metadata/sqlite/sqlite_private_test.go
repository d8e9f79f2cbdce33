package sqlite

import (
	"os"
	"path/filepath"
	"testing"
)

// TestOpenPrivate: the database file and its WAL files are readable by their
// owner only, also when an older torpor left them readable by all.
func TestOpenPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "torpor.db")
	db, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	db, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.sql.Exec(`CREATE TABLE IF NOT EXISTS private_test (x)`); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", filepath.Base(p), fi.Mode().Perm())
		}
	}
}
