package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
)

// TestServeDatabaseFlag: a --database that is no postgres:// URL is a wrong
// command line (exit 2, nothing set up, no password in the message); a
// PostgreSQL server that does not answer is a start-up error (exit 1) that
// names the database and says it could not connect.
func TestServeDatabaseFlag(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	r := runTorpor("serve", "--database", "mysql://root:hunter2@db/torpor", "--data-dir", dir, "--auth", "none")
	if r.code != 2 || !strings.Contains(r.stderr, "want a postgres://") || strings.Contains(r.stderr, "hunter2") {
		t.Errorf("serve --database mysql://…: %+v", r)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("the refused serve made its data directory %s", dir)
	}
	t0 := time.Now()
	r = runTorpor("serve", "--database", "postgres://torpor:hunter2@127.0.0.1:1/torpor", "--data-dir", dir, "--auth", "none", "--listen", "127.0.0.1:0")
	if r.code != 1 || !strings.Contains(r.stderr, "postgres://torpor@127.0.0.1:1/torpor: connect") || strings.Contains(r.stderr, "hunter2") {
		t.Errorf("serve with no PostgreSQL server: %+v", r)
	}
	if d := time.Since(t0); d > postgres.ConnectTimeout+5*time.Second {
		t.Errorf("serve with no PostgreSQL server took %v", d)
	}
}

// TestKeyCommandsPostgres: with --database (or TORPOR_DATABASE) the key
// commands make, list and remove keys in PostgreSQL, where a server on that
// database verifies them; no data directory is needed.
func TestKeyCommandsPostgres(t *testing.T) {
	c := pgtest.Start(t)
	url := c.NewDatabase(t)
	r := runTorpor("key", "create", "--database", url, "--name", "ci", "--data-dir", filepath.Join(t.TempDir(), "none"))
	if r.code != 0 {
		t.Fatalf("create: %+v", r)
	}
	key := strings.TrimSpace(r.stdout)
	db, err := postgres.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	rec, err := apikey.NewVerifier(db, apikey.Config{}).Verify(context.Background(), key)
	if err != nil || rec.Name != "ci" {
		t.Fatalf("verify the printed key in PostgreSQL: %+v %v", rec, err)
	}
	t.Setenv("TORPOR_DATABASE", url)
	if r := runTorpor("key", "ls"); r.code != 0 || !strings.Contains(r.stdout, rec.ID) {
		t.Errorf("ls with TORPOR_DATABASE: %+v", r)
	}
	if r := runTorpor("key", "rm", rec.ID); r.code != 0 {
		t.Errorf("rm: %+v", r)
	}
	if keys, err := db.ListAPIKeys(context.Background()); err != nil || len(keys) != 0 {
		t.Errorf("after rm: %v %v", keys, err)
	}
}
