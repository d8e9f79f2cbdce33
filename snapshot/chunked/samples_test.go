package chunked

import (
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// TestRealCheckpoints commits consecutive real gVisor checkpoints and reports
// dedup and throughput: set TORPOR_CHUNK_SAMPLES to a directory holding one
// sub-directory per checkpoint (checkpoint.img, pages_meta.img, pages.img), in
// name order. Skipped otherwise. See README "Snapshot store" for how to make them.
func TestRealCheckpoints(t *testing.T) {
	root := os.Getenv("TORPOR_CHUNK_SAMPLES")
	if root == "" {
		t.Skip("TORPOR_CHUNK_SAMPLES not set")
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, e := range ents {
		if st, err := os.Stat(filepath.Join(root, e.Name())); err == nil && st.IsDir() {
			dirs = append(dirs, filepath.Join(root, e.Name()))
		}
	}
	sort.Strings(dirs)
	t.Run("fs", func(t *testing.T) { commitSamples(t, newFSStore(t), dirs) })
	t.Run("s3", func(t *testing.T) { commitSamples(t, newS3Store(t, s3test.Start(t), 1<<30), dirs) })
}

func commitSamples(t *testing.T, s *Store, dirs []string) {
	mibps := func(n int64, d time.Duration) float64 { return float64(n) / (1 << 20) / d.Seconds() }
	for i, src := range dirs {
		id := "snap-" + filepath.Base(src)
		dir, err := s.Stage(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(src)
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join(src, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			os.WriteFile(filepath.Join(dir, e.Name()), b, 0o600)
		}
		t0 := time.Now()
		m, err := s.Commit(ctx, id, snapshot.Manifest{ID: id})
		if err != nil {
			t.Fatal(err)
		}
		dc := time.Since(t0)
		t0 = time.Now()
		if _, _, err := s.Open(ctx, id); err != nil {
			t.Fatal(err)
		}
		dw := time.Since(t0)
		dropLocal(t, s)
		t0 = time.Now()
		if _, _, err := s.Open(ctx, id); err != nil {
			t.Fatal(err)
		}
		dcold := time.Since(t0)
		t.Logf("#%d %s: logical %d, %d chunks, new %d (%.2f%%), stored %d; commit %v (%.0f MiB/s); open warm %v (%.0f MiB/s), cold %v (%.0f MiB/s)",
			i, filepath.Base(src), m.LogicalBytes, m.Chunks, m.NewBytes, 100*float64(m.NewBytes)/float64(m.LogicalBytes), m.StoredBytes,
			dc.Round(time.Millisecond), mibps(m.LogicalBytes, dc), dw.Round(time.Millisecond), mibps(m.LogicalBytes, dw),
			dcold.Round(time.Millisecond), mibps(m.LogicalBytes, dcold))
	}
}
