package sqlite

import (
	"context"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
)

// A database made before retention and snapshot sizes existed (no expires_at
// column, snapshots without logical/stored/new bytes) is migrated on Open: old
// rows read as "never expires" and size 0, new values round-trip.
func TestMigrateAddsRetentionAndSnapshotSizes(t *testing.T) {
	_, db, s := openOld(t, `INSERT INTO sandboxes (id, state, image, image_digest, guest_digest, memory_mib, cpus, env, generation, snapshot_id, created_at, state_changed_at)
		VALUES ('sbx-old', 'hibernated', 'base', 'sha256:x', 'g', 512, 1, '{}', 1, 'snap-old', '2024-01-01T00:00:00Z', '2024-01-01T00:00:00Z');
		INSERT INTO snapshots (id, sandbox_id, bytes, hibernate_ms, engine, created_at)
		VALUES ('snap-old', 'sbx-old', 100, 5, 'gvisor', '2024-01-01T00:00:00Z');`)
	ctx := context.Background()
	if s.ExpiresAt != nil {
		t.Fatalf("old row expires at %v, want never", s.ExpiresAt)
	}
	snap, err := db.GetSnapshot(ctx, "snap-old")
	if err != nil || snap.Bytes != 100 || snap.LogicalBytes != 0 {
		t.Fatalf("old snapshot: %+v %v", snap, err)
	}
	users, err := db.SnapshotUsers(ctx, "snap-old")
	if err != nil || len(users) != 1 || users[0] != "sbx-old" {
		t.Fatalf("users of snap-old: %v %v", users, err)
	}

	if err := db.SetSnapshotSizes(ctx, "snap-old", 100, 100, 100); err != nil {
		t.Fatal(err)
	}
	if snap, _ := db.GetSnapshot(ctx, "snap-old"); snap.LogicalBytes != 100 || snap.StoredBytes != 100 || snap.NewBytes != 100 {
		t.Fatalf("backfilled sizes: %+v", snap)
	}

	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	s.ExpiresAt = &at
	s.ID, s.SnapshotID = "sbx-new", ""
	if err := db.CreateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	rec := &metadata.Snapshot{ID: "snap-new", SandboxID: "sbx-new", Bytes: 10, Engine: "e", CreatedAt: at,
		LogicalBytes: 10, StoredBytes: 4, NewBytes: 2}
	s.SnapshotID = rec.ID
	if err := db.CommitHibernate(ctx, rec, s); err != nil {
		t.Fatal(err)
	}
	got, err := db.GetSandbox(ctx, "sbx-new")
	if err != nil || got.ExpiresAt == nil || !got.ExpiresAt.Equal(at) {
		t.Fatalf("expires_at round trip: %v %v", got.ExpiresAt, err)
	}
	all, err := db.ListSnapshots(ctx)
	if err != nil || len(all) != 2 || all[1].ID != "snap-new" || all[1].StoredBytes != 4 || all[1].NewBytes != 2 || all[1].LogicalBytes != 10 {
		t.Fatalf("list snapshots: %+v %v", all, err)
	}
	got.ExpiresAt = nil
	if err := db.UpdateSandbox(ctx, got); err != nil {
		t.Fatal(err)
	}
	if got, _ = db.GetSandbox(ctx, "sbx-new"); got.ExpiresAt != nil {
		t.Fatalf("cleared expires_at reads %v", got.ExpiresAt)
	}
}
