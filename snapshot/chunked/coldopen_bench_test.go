package chunked

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// BenchmarkColdOpen times the store's part of a cold resume: a pages.img of 64
// or 512 MiB of random pages, committed once, then opened b.N times by a new
// store on the same backend with no opened copy and an empty chunk cache (a
// host that never saw the snapshot), on the local filesystem backend (packs in
// the page cache) and on S3 (versitygw on loopback; skipped without it).
// Reports ms per Open and cpu_ms (this process's CPU, user and system, per Open
// and the chunk cache's filling after it, which competes with the restore).
//
//	go test -run '^$' -bench ColdOpen -benchtime 5x ./snapshot/chunked
func BenchmarkColdOpen(b *testing.B) {
	for _, kind := range []string{"fs", "s3"} {
		for _, mib := range []int{64, 512} {
			b.Run(fmt.Sprintf("%s/%dMiB", kind, mib), func(b *testing.B) {
				ctx := context.Background()
				var backend func() Backend
				switch kind {
				case "fs":
					dir := b.TempDir()
					backend = func() Backend {
						fs, err := NewFS(dir)
						if err != nil {
							b.Fatal(err)
						}
						return fs
					}
				case "s3":
					if s3test.Binary() == "" {
						b.Skip("versitygw not installed")
					}
					srv := s3test.Start(b)
					cfg := s3Config(srv, "torpor-cold")
					cfg.CreateBucket = true
					if _, err := NewS3(ctx, cfg); err != nil {
						b.Fatal(err)
					}
					cfg.CreateBucket = false
					backend = func() Backend {
						s, err := NewS3(ctx, cfg)
						if err != nil {
							b.Fatal(err)
						}
						return s
					}
				}
				newStore := func() *Store {
					c := Config{Dir: b.TempDir(), Backend: backend()}
					if kind == "s3" {
						c.CacheBytes = 4 << 30
					}
					s, err := New(ctx, c)
					if err != nil {
						b.Fatal(err)
					}
					return s
				}
				w := newStore()
				dir, err := w.Stage(ctx, "snap-0")
				if err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "pages.img"), memImage(mib<<20/pageSize), 0o600); err != nil {
					b.Fatal(err)
				}
				if _, err := w.Commit(ctx, "snap-0", snapshot.Manifest{ID: "snap-0", CreatedAt: time.Now()}); err != nil {
					b.Fatal(err)
				}
				w.Close()
				var total, cpu time.Duration
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					s := newStore()
					b.StartTimer()
					t0, c0 := time.Now(), processCPU()
					if _, _, err := s.Open(ctx, "snap-0"); err != nil {
						b.Fatal(err)
					}
					total += time.Since(t0)
					if s.fill != nil {
						s.fill.wait() // its CPU counts: it competes with the restore
					}
					cpu += processCPU() - c0
					b.StopTimer()
					s.Close()
					b.StartTimer()
				}
				b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/open")
				b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu_ms/open")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
