package chunked

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/zeebo/xxh3"
)

// BenchmarkDiffCommit times the store's part of a hibernate: a pages.img of 64
// or 512 MiB of random pages, committed once (first_GiB/s: every chunk
// compressed, hashed and packed), then b.N times with 1% of its pages
// rewritten since the parent (GiB/s: a diff commit on the local filesystem
// backend with the parent's chunk keys in memory), in GiB/s of logical bytes. The
// runsc checkpoint is not included; see bench.BenchmarkStore for the whole
// hibernate.
//
//	go test -run '^$' -bench DiffCommit -benchtime 10x ./snapshot/chunked
func BenchmarkDiffCommit(b *testing.B) {
	for _, mib := range []int{64, 512} {
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			ctx := context.Background()
			s, err := New(ctx, Config{Dir: b.TempDir()})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			img := memImage(mib << 20 / pageSize)
			stage := func(id string, data []byte) {
				dir, err := s.Stage(ctx, id)
				if err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "pages.img"), data, 0o600); err != nil {
					b.Fatal(err)
				}
			}
			parent := "snap-0"
			stage(parent, img)
			t0 := time.Now()
			if _, err := s.Commit(ctx, parent, snapshot.Manifest{ID: parent, CreatedAt: time.Now()}); err != nil {
				b.Fatal(err)
			}
			first := float64(len(img)) / (1 << 30) / time.Since(t0).Seconds()
			var total time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				img = mutate(img, 0.01, 8, uint64(i))
				id := fmt.Sprintf("snap-%d", i+1)
				stage(id, img)
				b.StartTimer()
				t0 := time.Now()
				if _, err := s.Commit(ctx, id, snapshot.Manifest{ID: id, Parent: parent, CreatedAt: time.Now()}); err != nil {
					b.Fatal(err)
				}
				total += time.Since(t0)
				parent = id
			}
			b.ReportMetric(float64(b.N)*float64(len(img))/(1<<30)/total.Seconds(), "GiB/s")
			b.ReportMetric(first, "first_GiB/s")
		})
	}
}

// BenchmarkFingerprint measures cutting 64 MiB of random pages into chunks and
// keying them, as a commit does (one XXH3-128 per page, one over each chunk's
// page hashes), beside the rule used until 2026-12-01: a CRC-32C of every page
// for the cut, then an XXH3-128 of each chunk for its key. In MB/s.
//
//	go test -run '^$' -bench Fingerprint ./snapshot/chunked
func BenchmarkFingerprint(b *testing.B) {
	img := memImage(64 << 20 / pageSize)
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	b.Run("rule=xxh3-pages", func(b *testing.B) {
		b.SetBytes(int64(len(img)))
		for i := 0; i < b.N; i++ {
			for off := 0; off < len(img); {
				n, _ := cut(img[off:])
				off += n
			}
		}
	})
	b.Run("rule=crc32c-then-xxh3", func(b *testing.B) {
		b.SetBytes(int64(len(img)))
		for i := 0; i < b.N; i++ {
			for off := 0; off < len(img); {
				n := 0
				for pages := 0; pages < maxPages && n+pageSize <= len(img)-off; pages++ {
					crc := crc32.Checksum(img[off+n:off+n+pageSize], castagnoli)
					n += pageSize
					if crc%cutModulus == cutModulus-1 {
						break
					}
				}
				_ = xxh3.Hash128(img[off : off+n])
				off += n
			}
		}
	})
}
