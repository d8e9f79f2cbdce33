package sqlite

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// An older database (sandboxes table without the policy columns) is migrated on
// Open: its rows get the defaults, and new records round-trip every policy field.
func TestMigrateAddsPolicyColumns(t *testing.T) {
	path, db, s := openOld(t, `INSERT INTO sandboxes (id, state, image, image_digest, guest_digest, memory_mib, cpus, env, generation, created_at, state_changed_at)
		VALUES ('sbx-old', 'hibernated', 'base', 'sha256:x', 'g', 512, 1, '{}', 1, '2024-01-01T00:00:00Z', '2024-01-01T00:00:00Z');`)
	ctx := context.Background()
	if s.IdleTimeoutS != 15 || s.HibernationMode != "memory" || s.OnTimeout != "hibernate" || s.TimeoutS != 0 {
		t.Fatalf("old row after migration: %+v", s.Policy)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	s.ID = "sbx-new"
	s.Policy = sandbox.Policy{IdleTimeoutS: 3, TimeoutS: 60, OnTimeout: "delete", HibernationMode: "filesystem",
		OnResume: []string{"sh", "-c", "x"}, Volumes: []sandbox.VolumeMount{{Name: "data", Path: "/data"}}}
	s.Meter = metadata.Meter{RunningMS: 1234, TimeoutBaseMS: 1000, SnapshotByteS: 5.5, UsageAt: now}
	if err := db.CreateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	got, err := db.GetSandbox(ctx, "sbx-new")
	if err != nil {
		t.Fatal(err)
	}
	if got.IdleTimeoutS != 3 || got.TimeoutS != 60 || got.OnTimeout != "delete" || got.HibernationMode != "filesystem" ||
		len(got.OnResume) != 3 || len(got.Volumes) != 1 || got.Volumes[0].Path != "/data" || got.RunningMS != 1234 ||
		got.TimeoutBaseMS != 1000 || got.SnapshotByteS != 5.5 || !got.UsageAt.Equal(now) {
		t.Fatalf("round trip: %+v %+v", got.Policy, got.Meter)
	}
	// Opening again (columns present) is a no-op.
	db.Close()
	if db, err = Open(path); err != nil {
		t.Fatal(err)
	}
	if err := db.CreateVolume(ctx, metadata.Volume{Name: "data", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := db.CreateVolume(ctx, metadata.Volume{Name: "data", CreatedAt: now}); !errors.Is(err, metadata.ErrExists) {
		t.Fatalf("second create of a volume: %v", err)
	}
}
