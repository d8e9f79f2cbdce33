package sqlite

import (
	"context"
	"testing"
	"time"

	"github.com/torpor/torpor/sandbox"
)

// TestLastResume: the resume report round-trips through the database, and a
// database made before the column existed gets it on open.
func TestLastResume(t *testing.T) {
	_, db, s := openOld(t, `INSERT INTO sandboxes (id, state, image, image_digest, guest_digest, memory_mib, cpus, env, generation, created_at, state_changed_at)
		VALUES ('sbx-old', 'hibernated', 'base', 'sha256:x', 'g', 512, 1, '{}', 4, '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');`)
	ctx := context.Background()
	if s.LastResume != nil {
		t.Errorf("old record has a last_resume: %+v", s.LastResume)
	}
	s.LastResume = &sandbox.ResumeReport{Event: "resume", Generation: 5, OK: true, WindowMS: 12.5,
		Steps: []sandbox.ResumeStep{{Name: "generation", MS: 0.5, OK: true}},
		Hooks: []sandbox.ResumeHook{{Name: "10-x", ExitCode: 3, Output: "out"}}}
	s.StateChangedAt = time.Now()
	if err := db.UpdateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	got, err := db.GetSandbox(ctx, "sbx-old")
	if err != nil {
		t.Fatal(err)
	}
	if r := got.LastResume; r == nil || r.Generation != 5 || r.WindowMS != 12.5 || len(r.Steps) != 1 || r.Hooks[0].ExitCode != 3 {
		t.Errorf("last_resume read back as %+v", r)
	}
}
