package chunked

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/local"
	"github.com/zeebo/xxh3"
)

// BenchmarkDiffCommit times the store's part of a hibernate: a pages.img of 64
// or 512 MiB of random pages, committed first into three fresh stores
// alternately with three commits of it into plain stores (snapshot/local:
// sha256 and fsync of the staged file), the pairs in the same run
// (first_GiB/s, the median: every chunk compressed, hashed, packed and
// synced; first_vs_plain: the plain commit's median time over the chunked
// one's, ≥ 1 when the chunked store is as fast; first_deferred_vs_plain: the
// same against a third commit of each round into a store with
// Config.DeferFirstCommits, acknowledged once the file is synced, whose
// chunk commit (started at once here, not after deferredDelay) is waited for
// before the next round (first_deferred_chunks_s: its median time from the
// acknowledgement, on one worker); first_cpu_s: the median
// CPU time, user and system, which load from other processes does not
// change), then b.N times with 1% of its pages
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
			img := memImage(mib << 20 / pageSize)
			stageInto := func(st snapshot.Store, id string, data []byte) {
				dir, err := st.Stage(ctx, id)
				if err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "pages.img"), data, 0o600); err != nil {
					b.Fatal(err)
				}
			}
			// firstCommit stages img in st and commits it: wall and CPU time.
			firstCommit := func(st snapshot.Store) (wall, cpu time.Duration) {
				stageInto(st, "snap-0", img)
				t0, cpu0 := time.Now(), processCPU()
				if _, err := st.Commit(ctx, "snap-0", snapshot.Manifest{ID: "snap-0", CreatedAt: time.Now()}); err != nil {
					b.Fatal(err)
				}
				return time.Since(t0), processCPU() - cpu0
			}
			var s *Store
			var chunkedWall, plainWall, deferredWall, deferredChunks, chunkedCPU []time.Duration
			oldDelay := deferredDelay
			deferredDelay = 0
			defer func() { deferredDelay = oldDelay }()
			for i := 0; i < 3; i++ {
				ps, err := local.New(b.TempDir())
				if err != nil {
					b.Fatal(err)
				}
				w, _ := firstCommit(ps)
				plainWall = append(plainWall, w)
				if s != nil {
					s.Close()
				}
				if s, err = New(ctx, Config{Dir: b.TempDir()}); err != nil {
					b.Fatal(err)
				}
				w, c := firstCommit(s)
				chunkedWall, chunkedCPU = append(chunkedWall, w), append(chunkedCPU, c)
				ds, err := New(ctx, Config{Dir: b.TempDir(), DeferFirstCommits: true})
				if err != nil {
					b.Fatal(err)
				}
				w, _ = firstCommit(ds)
				deferredWall = append(deferredWall, w)
				t0 := time.Now()
				waitDeferred(ds)
				deferredChunks = append(deferredChunks, time.Since(t0))
				ds.Close()
			}
			defer s.Close()
			stage := func(id string, data []byte) { stageInto(s, id, data) }
			parent := "snap-0"
			first := float64(len(img)) / (1 << 30) / medianDuration(chunkedWall).Seconds()
			firstVsPlain := medianDuration(plainWall).Seconds() / medianDuration(chunkedWall).Seconds()
			firstCPU := medianDuration(chunkedCPU).Seconds()
			deferredVsPlain := medianDuration(plainWall).Seconds() / medianDuration(deferredWall).Seconds()
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
			b.ReportMetric(firstVsPlain, "first_vs_plain")
			b.ReportMetric(deferredVsPlain, "first_deferred_vs_plain")
			b.ReportMetric(medianDuration(deferredChunks).Seconds(), "first_deferred_chunks_s")
			b.ReportMetric(firstCPU, "first_cpu_s")
		})
	}
}

// medianDuration is the median of d (the upper one of an even count); d is
// sorted in place.
func medianDuration(d []time.Duration) time.Duration {
	slices.Sort(d)
	return d[len(d)/2]
}

// processCPU is the CPU time (user and system) this process has used so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
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

// BenchmarkEncryption compares the store without a key and with one
// (Config.Key, seal.go) on the local filesystem backend, per size (a
// pages.img of random pages):
//
//   - op=first: a first commit (every chunk hashed, compressed, packed and,
//     with a key, sealed);
//   - op=diff: a diff commit with 1% of the pages rewritten since the parent;
//   - op=open-cold: an Open without an opened copy (every chunk read from its
//     pack, opened, decompressed, verified and written);
//   - op=open-after-commit: the Open right after a diff commit, what a resume
//     after a hibernate does: warm without a key (the commit kept the staged
//     files as the opened copy), cold with one (it keeps no plaintext).
//
// Throughput in MB/s of logical bytes. key=none and key=aes run next to each
// other; repeat the whole run (not -count, which repeats each sub-benchmark
// in a row) so that both see the same load on a shared machine:
//
//	for i in 1 2 3 4 5 6; do go test -run '^$' -bench Encryption -benchtime 3x ./snapshot/chunked; done | tee enc.txt
//	benchstat -col /key enc.txt
func BenchmarkEncryption(b *testing.B) {
	raw := make([]byte, KeyBytes)
	key, _ := NewKey(raw)
	for _, mib := range []int{64, 512} {
		for _, op := range []string{"first", "diff", "open-cold", "open-after-commit"} {
			for _, k := range []*Key{nil, key} {
				name := "none"
				if k != nil {
					name = "aes"
				}
				b.Run(fmt.Sprintf("op=%s/size=%dMiB/key=%s", op, mib, name), func(b *testing.B) {
					benchEncryption(b, k, op, mib)
				})
			}
		}
	}
}

func benchEncryption(b *testing.B, k *Key, op string, mib int) {
	ctx := context.Background()
	s, err := New(ctx, Config{Dir: b.TempDir(), Key: k})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	img := memImage(mib << 20 / pageSize)
	n := 0
	commit := func(parent string) string {
		n++
		id := fmt.Sprintf("snap-%d", n)
		dir, err := s.Stage(ctx, id)
		if err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "pages.img"), img, 0o600); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if _, err := s.Commit(ctx, id, snapshot.Manifest{ID: id, Parent: parent, CreatedAt: time.Now()}); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		return id
	}
	open := func(id string) {
		b.StartTimer()
		if _, _, err := s.Open(ctx, id); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
	}
	b.StopTimer()
	b.SetBytes(int64(len(img)))
	parent := ""
	if op != "first" {
		parent = commit("")
		b.ResetTimer()
		b.StopTimer()
	}
	for i := 0; i < b.N; i++ {
		switch op {
		case "first":
			fill(img) // new content: nothing to deduplicate
			commit("")
		case "diff":
			img = mutate(img, 0.01, 8, uint64(i))
			parent = commit(parent)
		case "open-cold":
			if err := os.RemoveAll(s.opened(parent)); err != nil {
				b.Fatal(err)
			}
			s.dropOpened(parent)
			open(parent)
		case "open-after-commit":
			img = mutate(img, 0.01, 8, uint64(i))
			parent = commit(parent)
			open(parent)
		}
	}
}

// BenchmarkChunkSeal measures, on one core, what a key adds per stored chunk
// (16 KiB of random bytes, as compressed memory pages are): the address
// (sha256 without a key, HMAC-SHA256 with one) and, with a key, sealing
// (subkey derivation, AES-256-GCM) and opening. In MB/s of chunk bytes.
//
//	go test -run '^$' -bench ChunkSeal -count 6 ./snapshot/chunked
func BenchmarkChunkSeal(b *testing.B) {
	chunk := make([]byte, 16<<10)
	fill(chunk)
	key, _ := NewKey(make([]byte, KeyBytes))
	s := &Store{keys: map[string]*Key{key.id: key}}
	b.Run("step=address/key=none", func(b *testing.B) {
		b.SetBytes(int64(len(chunk)))
		for i := 0; i < b.N; i++ {
			_ = (*Key)(nil).address(chunk)
		}
	})
	b.Run("step=address/key=aes", func(b *testing.B) {
		b.SetBytes(int64(len(chunk)))
		for i := 0; i < b.N; i++ {
			_ = key.address(chunk)
		}
	})
	addr := key.address(chunk)
	b.Run("step=seal/key=aes", func(b *testing.B) {
		b.SetBytes(int64(len(chunk)))
		for i := 0; i < b.N; i++ {
			_ = key.sealChunk(addr, chunk)
		}
	})
	sealed := key.sealChunk(addr, chunk)
	b.Run("step=open/key=aes", func(b *testing.B) {
		b.SetBytes(int64(len(chunk)))
		for i := 0; i < b.N; i++ {
			if _, _, err := s.unsealChunk(sealed, addr); err != nil {
				b.Fatal(err)
			}
		}
	})
}
