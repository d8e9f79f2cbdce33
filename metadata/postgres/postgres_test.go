package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/metadata/storetest"
	"github.com/torpor/torpor/sandbox"
)

var ctx = context.Background()

// TestPostgres runs this package's tests on one private cluster (a cluster
// takes seconds to make), each on new databases.
func TestPostgres(t *testing.T) {
	c := pgtest.Start(t)
	for _, tc := range []struct {
		name string
		f    func(*testing.T, *pgtest.Cluster)
	}{
		{"Conformance", testConformance},
		{"Migrations", testMigrations},
		{"ServerLock", testServerLock},
		{"ServerLockKept", testServerLockKept},
		{"StaleAcrossStores", testStaleAcrossStores},
		{"APIKeysVerify", testAPIKeysVerify},
		{"TimesInAnyZone", testTimesInAnyZone},
		{"CollectLock", testCollectLock},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.f(t, c) })
	}
}

// testConformance runs the metadata store suite on a new database per test.
func testConformance(t *testing.T, c *pgtest.Cluster) {
	storetest.Run(t, func(t *testing.T) func() (metadata.Store, error) {
		url := c.NewDatabase(t)
		return func() (metadata.Store, error) { return Open(ctx, url) }
	})
}

func open(t *testing.T, url string) *DB {
	t.Helper()
	db, err := Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// testMigrations: a new database gets every migration, one row each with
// SQLite's schema versions; a reopen applies nothing; a database at a higher
// version than this package knows is refused; several stores opening one new
// database at once (several hosts starting) all succeed and the migrations
// are applied once.
func testMigrations(t *testing.T, c *pgtest.Cluster) {
	if SchemaVersion() != sqlite.SchemaVersion() {
		t.Errorf("schema version %d, SQLite's %d: each version is one migration in both stores", SchemaVersion(), sqlite.SchemaVersion())
	}
	url := c.NewDatabase(t)
	const n = 6
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			db, err := Open(ctx, url)
			if err == nil {
				db.Close()
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("concurrent open of a new database: %v", err)
		}
	}
	db := open(t, url)
	rows, err := db.sql.QueryContext(ctx, `SELECT version, name FROM schema_migrations ORDER BY version`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Version int
		Name    string
	}
	var got []row
	for rows.Next() {
		var r row
		if err := rows.Scan(&r.Version, &r.Name); err != nil {
			t.Fatal(err)
		}
		got = append(got, r)
	}
	rows.Close()
	ms, _ := migrations()
	if len(got) != len(ms) {
		t.Fatalf("schema_migrations has %d rows (%v), want %d", len(got), got, len(ms))
	}
	for i, m := range ms {
		if got[i].Version != m.Version || got[i].Name != m.Name {
			t.Errorf("row %d: %+v, want version %d %s", i, got[i], m.Version, m.Name)
		}
	}
	db.Close()
	db = open(t, url)
	if v, err := schemaVersion(ctx, db.sql); err != nil || v != len(ms) {
		t.Errorf("after reopen: version %d %v", v, err)
	}
	if _, err := db.sql.ExecContext(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, 'from-the-future.sql')`, len(ms)+1); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if db, err := Open(ctx, url); err == nil || !strings.Contains(err.Error(), "newer") {
		if db != nil {
			db.Close()
		}
		t.Fatalf("open of a newer database: %v", err)
	}
}

// TestOpenErrors: a URL that does not parse and a server that does not
// answer are errors at Open, naming the database and not its password.
func TestOpenErrors(t *testing.T) {
	if _, err := Open(ctx, "postgres://u:secret@[::1"); err == nil || strings.Contains(err.Error(), "secret") {
		t.Errorf("unparsable URL: %v", err)
	}
	dir := t.TempDir() // no server's socket in it
	_, err := Open(ctx, "postgres://u:secret@/torpor?host="+dir)
	if err == nil || strings.Contains(err.Error(), "secret") || !strings.Contains(err.Error(), "connect") || !strings.Contains(err.Error(), "postgres://u@/torpor?host="+dir) {
		t.Errorf("no server: %v", err)
	}
	t0 := time.Now()
	if _, err := Open(ctx, "postgres://u@127.0.0.1:1/torpor?connect_timeout=5"); err == nil {
		t.Errorf("closed port: no error")
	} else if time.Since(t0) > ConnectTimeout {
		t.Errorf("closed port: %v after %v", err, time.Since(t0))
	}
}

// testServerLock: one server lock per node name and database; another
// node's is independent, it is free again once its holder closes, and
// another database's is independent.
func testServerLock(t *testing.T, c *pgtest.Cluster) {
	url := c.NewDatabase(t)
	a, b := open(t, url), open(t, url)
	if err := a.LockServer(ctx, "node-a"); err != nil {
		t.Fatal(err)
	}
	if err := b.LockServer(ctx, "node-a"); !errors.Is(err, ErrLocked) {
		t.Fatalf("second server lock: %v, want ErrLocked", err)
	}
	if err := open(t, url).LockServer(ctx, "node-b"); err != nil {
		t.Errorf("another node's lock: %v", err)
	}
	other := open(t, c.NewDatabase(t))
	if err := other.LockServer(ctx, "node-a"); err != nil {
		t.Errorf("another database's lock: %v", err)
	}
	a.Close()
	if err := b.LockServer(ctx, "node-a"); err != nil {
		t.Errorf("lock after the holder closed: %v", err)
	}
}

// lockHolder is the backend pid that holds node's server lock in db's
// database (0: none).
func lockHolder(t *testing.T, db *DB, node string) int64 {
	t.Helper()
	pid, err := db.ServerLockHolder(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// terminate ends backend pid (as another server's network cut or an
// operator's pg_terminate_backend would) and waits until it is gone.
func terminate(t *testing.T, db *DB, pid int64) {
	t.Helper()
	if _, err := db.sql.ExecContext(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var n int
		if err := db.sql.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d still there 30 s after pg_terminate_backend", pid)
		}
	}
}

// testServerLockKept: KeepServerLock leaves a held lock alone; once the
// lock's session is ended (pg_terminate_backend) it notices and takes the
// lock again on a new session, which then refuses a second server; if
// another server took the lock in the gap it fails with ErrLocked naming
// that server's session; a session of its own that the store lost sight of
// (its connection gone on this side only) but the database still runs is
// ended and the lock taken again.
func testServerLockKept(t *testing.T, c *pgtest.Cluster) {
	url := c.NewDatabase(t)
	a, b, watch := open(t, url), open(t, url), open(t, url)
	if _, err := a.KeepServerLock(ctx); err == nil {
		t.Errorf("KeepServerLock before LockServer: no error")
	}
	if err := a.LockServer(ctx, "node-a"); err != nil {
		t.Fatal(err)
	}
	if retaken, err := a.KeepServerLock(ctx); retaken || err != nil {
		t.Fatalf("KeepServerLock of a held lock: retaken %v %v", retaken, err)
	}
	first := lockHolder(t, watch, "node-a")
	terminate(t, watch, first)
	if pid := lockHolder(t, watch, "node-a"); pid != 0 {
		t.Fatalf("lock held by backend %d after its session ended", pid)
	}
	if retaken, err := a.KeepServerLock(ctx); !retaken || err != nil {
		t.Fatalf("KeepServerLock after the session ended: retaken %v %v; want the lock taken again", retaken, err)
	}
	if pid := lockHolder(t, watch, "node-a"); pid == 0 || pid == first {
		t.Fatalf("lock held by backend %d after the retake; want a new session (not %d)", pid, first)
	}
	if err := b.LockServer(ctx, "node-a"); !errors.Is(err, ErrLocked) {
		t.Fatalf("a second server after the retake: %v, want ErrLocked", err)
	}

	// Another server takes the lock while a's session is gone.
	terminate(t, watch, lockHolder(t, watch, "node-a"))
	if err := b.LockServer(ctx, "node-a"); err != nil {
		t.Fatalf("a second server while the first one's session is gone: %v", err)
	}
	taker := lockHolder(t, watch, "node-a")
	_, err := a.KeepServerLock(ctx)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), fmt.Sprintf("backend %d ", taker)) {
		t.Fatalf("KeepServerLock with the lock taken by another server: %v; want ErrLocked naming backend %d", err, taker)
	}
	if pid := lockHolder(t, watch, "node-a"); pid != taker {
		t.Fatalf("the other server's lock is held by %d, want %d: KeepServerLock must not take it", pid, taker)
	}

	// The store loses sight of its own session, which still holds the lock.
	d := open(t, url)
	if err := d.LockServer(ctx, "node-d"); err != nil {
		t.Fatal(err)
	}
	stale := d.server
	defer stale.Close()
	held := lockHolder(t, watch, "node-d")
	fresh, err := d.sql.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d.lockMu.Lock()
	d.server = fresh // not holding the lock: as if the first connection was lost
	d.lockMu.Unlock()
	if retaken, err := d.KeepServerLock(ctx); !retaken || err != nil {
		t.Fatalf("KeepServerLock with its own old session holding the lock: retaken %v %v", retaken, err)
	}
	if pid := lockHolder(t, watch, "node-d"); pid == 0 || pid == held {
		t.Errorf("node-d's lock is held by %d; want a new session (not %d)", pid, held)
	}
	if err := stale.PingContext(ctx); err == nil {
		t.Errorf("the old session still answers: it was not ended")
	}
}

// testStaleAcrossStores: two stores (two hosts' pools) on one database that
// read the same version of a record: of their concurrent updates exactly one
// wins, the other gets ErrStale, many times over.
func testStaleAcrossStores(t *testing.T, c *pgtest.Cluster) {
	url := c.NewDatabase(t)
	a, b := open(t, url), open(t, url)
	now := time.Now()
	s := &metadata.Sandbox{ID: "sbx-a", State: "running", Image: "base", CreatedAt: now, StateChangedAt: now}
	if err := a.CreateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	const rounds = 30
	for i := 0; i < rounds; i++ {
		ra, err := a.GetSandbox(ctx, "sbx-a")
		if err != nil {
			t.Fatal(err)
		}
		rb, _ := b.GetSandbox(ctx, "sbx-a")
		ra.Error, rb.Error = fmt.Sprintf("a %d", i), fmt.Sprintf("b %d", i)
		var wg sync.WaitGroup
		var ea, eb error
		wg.Add(2)
		go func() { defer wg.Done(); _, ea = a.BeginRestore(ctx, ra) }()
		go func() { defer wg.Done(); eb = b.UpdateSandbox(ctx, rb) }()
		wg.Wait()
		if (ea == nil) == (eb == nil) || !(errors.Is(ea, metadata.ErrStale) || errors.Is(eb, metadata.ErrStale)) {
			t.Fatalf("round %d: errors %v and %v, want one nil and one ErrStale", i, ea, eb)
		}
		got, _ := a.GetSandbox(ctx, "sbx-a")
		if want := map[bool]string{true: ra.Error, false: rb.Error}[ea == nil]; got.Error != want || got.Version != int64(i+2) {
			t.Fatalf("round %d: stored %q version %d, want %q version %d", i, got.Error, got.Version, want, i+2)
		}
	}
}

// testAPIKeysVerify: package apikey's keys made in and verified against the
// PostgreSQL store, as a server and `torpor key` use it.
func testAPIKeysVerify(t *testing.T, c *pgtest.Cluster) {
	db := open(t, c.NewDatabase(t))
	key, rec, err := apikey.Create(ctx, db, "ci", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	v := apikey.NewVerifier(db, apikey.Config{})
	got, err := v.Verify(ctx, key)
	if err != nil || got.ID != rec.ID || got.Name != "ci" {
		t.Fatalf("verify: %+v %v", got, err)
	}
	last := "0" // a key that differs from the real one in its last digit
	if key[len(key)-1] == '0' {
		last = "1"
	}
	if _, err := v.Verify(ctx, key[:len(key)-1]+last); err == nil {
		t.Errorf("a wrong key verified")
	}
}

// testTimesInAnyZone: a zero time and times of long ago read back as
// written whatever the process's time zone (pgx reads timestamptz in the
// local zone unless told otherwise; old zones have offsets in seconds).
func testTimesInAnyZone(t *testing.T, c *pgtest.Cluster) {
	db := open(t, c.NewDatabase(t))
	local := time.Local
	t.Cleanup(func() { time.Local = local })
	zone, err := time.LoadLocation("Europe/Amsterdam") // +00:19:32 before 1937
	if err != nil {
		t.Skip("no time zone database:", err)
	}
	time.Local = zone
	for i, at := range []time.Time{{}, time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2030, 6, 1, 12, 0, 0, 500000000, zone)} {
		img := sandbox.Image{Name: fmt.Sprintf("img-%d", i), Digest: "sha256:aa", CreatedAt: at}
		if err := db.PutImage(ctx, img); err != nil {
			t.Fatal(err)
		}
		got, err := db.GetImage(ctx, img.Name)
		if err != nil || !got.CreatedAt.Equal(at) || got.CreatedAt.Location() != time.UTC {
			t.Errorf("time %v read back as %v (%v)", at, got.CreatedAt, err)
		}
	}
}
