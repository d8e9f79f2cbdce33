package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
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

// openOld opens a database made by oldDatabase(t, rows) and returns its path,
// the store and the record of sandbox "sbx-old" (rows must make it).
func openOld(t *testing.T, rows string) (string, *DB, *metadata.Sandbox) {
	t.Helper()
	path := oldDatabase(t, rows)
	db, err := Open(path)
	if err != nil {
		t.Fatalf("open an old database: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := db.GetSandbox(context.Background(), "sbx-old")
	if err != nil {
		t.Fatal(err)
	}
	return path, db, s
}

// mainSchema is a database as the last release before numbered migrations
// wrote it: its CREATE statements, then the columns its start-up added with
// ALTER TABLE, the volumes table and the image store's images table.
const mainSchema = `
CREATE TABLE IF NOT EXISTS sandboxes (
	id TEXT PRIMARY KEY, state TEXT NOT NULL, image TEXT NOT NULL, image_digest TEXT NOT NULL,
	guest_digest TEXT NOT NULL, memory_mib INTEGER NOT NULL, cpus REAL NOT NULL, env TEXT NOT NULL,
	generation INTEGER NOT NULL, forked_from TEXT NOT NULL DEFAULT '', snapshot_id TEXT NOT NULL DEFAULT '',
	pending_snapshot TEXT NOT NULL DEFAULT '', instance TEXT NOT NULL DEFAULT '', seq INTEGER NOT NULL DEFAULT 0,
	error TEXT NOT NULL DEFAULT '', deleting INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL,
	state_changed_at TEXT NOT NULL, last_hibernate_at TEXT, last_resume_at TEXT, resume_ms INTEGER NOT NULL DEFAULT 0,
	last_resume TEXT NOT NULL DEFAULT '', idle_timeout_s INTEGER NOT NULL DEFAULT 15, timeout_s INTEGER NOT NULL DEFAULT 0,
	on_timeout TEXT NOT NULL DEFAULT 'hibernate', hibernation_mode TEXT NOT NULL DEFAULT 'memory',
	on_resume TEXT NOT NULL DEFAULT '', volumes TEXT NOT NULL DEFAULT '', running_ms INTEGER NOT NULL DEFAULT 0,
	timeout_base_ms INTEGER NOT NULL DEFAULT 0, snapshot_byte_s REAL NOT NULL DEFAULT 0, usage_at TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (name, value) VALUES ('generation', 0);
CREATE TABLE IF NOT EXISTS snapshots (
	id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, parent TEXT NOT NULL DEFAULT '', bytes INTEGER NOT NULL,
	hibernate_ms INTEGER NOT NULL, engine TEXT NOT NULL, created_at TEXT NOT NULL
);
ALTER TABLE sandboxes ADD COLUMN expires_at TEXT NOT NULL DEFAULT '';
ALTER TABLE snapshots ADD COLUMN logical_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE snapshots ADD COLUMN stored_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE snapshots ADD COLUMN new_bytes INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS volumes (name TEXT PRIMARY KEY, created_at TEXT NOT NULL, copied_from TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS images (name TEXT PRIMARY KEY, digest TEXT NOT NULL, bytes INTEGER, source TEXT, created_at TEXT);`

// mainRows are rows as that release wrote them: a hibernated sandbox with
// policies, volumes, usage, retention and a resume report (JSON as the API
// showed it), its snapshot, a volume, an image and the generation counter.
const mainRows = `
UPDATE counters SET value = 41 WHERE name = 'generation';
INSERT INTO sandboxes VALUES ('sbx-main', 'hibernated', 'base', 'sha256:b', 'g1', 256, 0.5, '{"A":"1"}', 41, 'sbx-src',
	'snap-main', '', '', 3, '', 0, '2026-01-01T00:00:00Z', '2026-01-02T00:00:00.5Z', '2026-01-02T00:00:00.5Z',
	'2026-01-01T12:00:00Z', 321,
	'{"event":"resume","generation":40,"forked":true,"snapshot_id":"snap-0","steps":[{"name":"reseed","ms":0.25,"ok":true}],"clock":{"skew_ms":-3.5,"corrected":"offset-file"},"subscribers":{"total":2,"acked":1,"timed_out":["pid 7"]},"hooks":[],"ok":false,"window_ms":12.5,"agent_ms":30}',
	60, 3600, 'delete', 'filesystem', '["sh","-c","serve"]', '[{"name":"data","path":"/data"}]', 90000, 1000, 123.5,
	'2026-01-02T00:00:00.5Z', '2027-01-01T00:00:00Z');
INSERT INTO snapshots VALUES ('snap-main', 'sbx-main', 'snap-0', 1000, 80, 'gvisor 1', '2026-01-02T00:00:00Z', 1000, 400, 100);
INSERT INTO volumes VALUES ('data', '2026-01-01T00:00:00Z', '');
INSERT INTO images VALUES ('base', 'sha256:b', 4096, 'mmdebstrap:', '2025-12-31T00:00:00Z');`

// TestOpenMainDatabase: a database written by the last release before
// numbered migrations is recognised, brought to the current schema version,
// and every row reads back as it was written.
func TestOpenMainDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "torpor.db")
	old, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(mainSchema + mainRows); err != nil {
		t.Fatal(err)
	}
	old.Close()
	ctx := context.Background()
	for round := 0; round < 2; round++ { // the second open finds the current version
		db, err := Open(path)
		if err != nil {
			t.Fatalf("open %d: %v", round, err)
		}
		var v int
		if err := db.sql.QueryRow(`PRAGMA user_version`).Scan(&v); err != nil || v != SchemaVersion() || v < 2 {
			t.Fatalf("schema version %d %v, want %d", v, err, SchemaVersion())
		}
		s, err := db.GetSandbox(ctx, "sbx-main")
		if err != nil {
			t.Fatal(err)
		}
		expires := time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)
		changed := time.Date(2026, 1, 2, 0, 0, 0, 5e8, time.UTC)
		resumed := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
		want := &metadata.Sandbox{ID: "sbx-main", Version: int64(1 + round), State: sandbox.StateHibernated, Image: "base",
			ImageDigest: "sha256:b", GuestDigest: "g1", MemoryMiB: 256, CPUs: 0.5, Env: map[string]string{"A": "1"},
			Generation: 41, ForkedFrom: "sbx-src", SnapshotID: "snap-main", Seq: 3,
			CreatedAt: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), StateChangedAt: changed,
			LastHibernateAt: &changed, LastResumeAt: &resumed, ResumeMS: 321,
			Policy: sandbox.Policy{IdleTimeoutS: 60, TimeoutS: 3600, OnTimeout: "delete", HibernationMode: "filesystem",
				OnResume: []string{"sh", "-c", "serve"}, Volumes: []sandbox.VolumeMount{{Name: "data", Path: "/data"}},
				// Every sandbox from before migration 0004 resumes on request.
				ExpiresAt: &expires, ResumeOnRequest: true},
			Meter: metadata.Meter{RunningMS: 90000, TimeoutBaseMS: 1000, SnapshotByteS: 123.5, UsageAt: changed},
			LastResume: &sandbox.ResumeReport{Event: "resume", Generation: 40, Forked: true, SnapshotID: "snap-0",
				Steps:       []sandbox.ResumeStep{{Name: "reseed", MS: 0.25, OK: true}},
				Clock:       sandbox.ResumeClock{SkewMS: -3.5, Corrected: "offset-file"},
				Subscribers: sandbox.ResumeSubscribers{Total: 2, Acked: 1, TimedOut: []string{"pid 7"}},
				Hooks:       []sandbox.ResumeHook{}, WindowMS: 12.5, AgentMS: 30},
		}
		if !reflect.DeepEqual(s, want) {
			t.Fatalf("sandbox read back as\n%+v\nwant\n%+v", s, want)
		}
		snap, err := db.GetSnapshot(ctx, "snap-main")
		if err != nil || snap.Parent != "snap-0" || snap.Bytes != 1000 || snap.StoredBytes != 400 || snap.NewBytes != 100 || snap.Engine != "gvisor 1" {
			t.Fatalf("snapshot: %+v %v", snap, err)
		}
		if v, err := db.GetVolume(ctx, "data"); err != nil || !v.CreatedAt.Equal(want.CreatedAt) {
			t.Fatalf("volume: %+v %v", v, err)
		}
		if img, err := db.GetImage(ctx, "base"); err != nil || img.Digest != "sha256:b" || img.Bytes != 4096 || img.Source != "mmdebstrap:" {
			t.Fatalf("image: %+v %v", img, err)
		}
		if keys, err := db.ListAPIKeys(ctx); err != nil || len(keys) != 0 { // 0003 made the table
			t.Fatalf("api keys: %+v %v", keys, err)
		}
		if round == 0 {
			if g, err := db.NextGeneration(ctx); err != nil || g != 42 {
				t.Fatalf("next generation %d %v, want 42", g, err)
			}
			// The adopted row takes versioned updates.
			if err := db.UpdateSandbox(ctx, s); err != nil || s.Version != 2 {
				t.Fatalf("update: version %d %v", s.Version, err)
			}
		}
		db.Close()
	}
}

// TestOpenNewerDatabase: a database whose schema version is above this
// package's is refused, not written to.
func TestOpenNewerDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "torpor.db")
	db, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.sql.Exec(fmt.Sprintf(`PRAGMA user_version = %d`, SchemaVersion()+1)); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if db, err := Open(path); err == nil || !strings.Contains(err.Error(), "newer") {
		if db != nil {
			db.Close()
		}
		t.Fatalf("open of a newer database: %v", err)
	}
}

// TestMigrationsNumbered: the embedded migrations run 1, 2, … without gaps.
func TestMigrationsNumbered(t *testing.T) {
	ms, err := migrations()
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range ms {
		if m.Version != i+1 || m.SQL == "" {
			t.Errorf("migration %d: %+v", i, m)
		}
	}
}
