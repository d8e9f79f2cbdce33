package chunked

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/snapshot/storetest"
)

var ctx = context.Background()

func newFSStore(t *testing.T) *Store {
	t.Helper()
	s, err := New(ctx, Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

var bucketSeq int
var bucketMu sync.Mutex

func newS3Backend(t *testing.T, srv *s3test.Server) *S3 {
	t.Helper()
	bucketMu.Lock()
	bucketSeq++
	bucket := fmt.Sprintf("torpor-%d", bucketSeq)
	bucketMu.Unlock()
	cfg := s3Config(srv, bucket)
	cfg.CreateBucket = true
	b, err := NewS3(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// s3Config is the configuration of a backend on bucket of the test server srv.
func s3Config(srv *s3test.Server, bucket string) S3Config {
	return S3Config{Endpoint: srv.Endpoint, Bucket: bucket, AccessKey: srv.AccessKey,
		SecretKey: srv.SecretKey, Region: srv.Region, PathStyle: true}
}

func newS3Store(t *testing.T, srv *s3test.Server, cacheBytes int64) *Store {
	t.Helper()
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: newS3Backend(t, srv), CacheBytes: cacheBytes})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// damage is storetest's way to corrupt or remove a file's stored content: it
// changes one chunk of the file in the backend and drops every local copy.
func damage(remove bool) func(t *testing.T, st snapshot.Store, id, file string) {
	return func(t *testing.T, st snapshot.Store, id, file string) {
		s := st.(*Store)
		d, err := s.readDoc(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		var ref chunkRef
		for _, fc := range d.Files {
			if fc.Name == file {
				ref = fc.Chunks[len(fc.Chunks)/2]
			}
		}
		if ref.ID == "" {
			t.Fatalf("no stored chunk for %s", file)
		}
		if remove {
			removeChunk(t, s, ref.ID)
		} else {
			corruptChunk(t, s, ref.ID)
		}
		dropLocal(t, s)
	}
}

// corruptChunk flips one stored byte of chunk id in the middle of its range in
// its pack.
func corruptChunk(t *testing.T, s *Store, id string) {
	t.Helper()
	rewriteStored(t, s, id, func(data []byte, l chunkLoc) []byte {
		data[l.Off+l.Len/2] ^= 1
		return data
	})
}

// removeChunk makes the backend lose chunk id alone, as if it had never been
// written: its bytes are cut out of its pack, and the pack's index and the
// store's locations shift the chunks after it.
func removeChunk(t *testing.T, s *Store, id string) {
	t.Helper()
	var pack string
	var cut chunkLoc
	rewriteStored(t, s, id, func(data []byte, l chunkLoc) []byte {
		pack, cut = l.Pack, l
		return append(data[:l.Off:l.Off], data[l.Off+l.Len:]...)
	})
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	var entries []indexEntry
	for _, e := range s.idx.known.packs[pack] {
		switch {
		case e.ID == id:
			continue
		case e.Off > cut.Off:
			e.Off -= cut.Len
		}
		entries = append(entries, e)
	}
	s.idx.known.dropPack(pack)
	s.idx.known.addPack(pack, entries)
	ix, _ := json.Marshal(packIndex{Chunks: entries})
	if err := s.b.Put(ctx, indexKey(pack), bytes.NewReader(ix), int64(len(ix))); err != nil {
		t.Fatal(err)
	}
}

// rewriteStored replaces, in the backend, the object holding chunk id (its pack)
// with edit's result.
func rewriteStored(t *testing.T, s *Store, id string, edit func(data []byte, l chunkLoc) []byte) {
	t.Helper()
	s.idx.mu.Lock()
	l, ok := s.idx.known.locs[id]
	s.idx.mu.Unlock()
	if !ok || l.Pack == "" {
		t.Fatalf("chunk %s is in no pack of the backend (%+v)", id, l)
	}
	r, err := s.b.Get(ctx, packKey(l.Pack))
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(r)
	r.Close()
	data = edit(data, l)
	if err := s.b.Put(ctx, packKey(l.Pack), bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
}

// dropLocal empties the opened copies and the chunk cache: the next Open is cold.
func dropLocal(t *testing.T, s *Store) {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(s.dir, "open", e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	if s.cache != nil {
		s.fill.wait()
		s.cache.Clear()
	}
}

func TestConformanceFS(t *testing.T) {
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newFSStore(t) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true)})
}

func TestConformanceS3(t *testing.T) {
	srv := s3test.Start(t)
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newS3Store(t, srv, 64<<20) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true)})
}

func TestConformanceS3Async(t *testing.T) {
	srv := s3test.Start(t)
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newS3Store(t, srv, 64<<20) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true), Async: true})
}

// memImage is synthetic data shaped like gVisor's pages.img: 4 KiB pages of random
// bytes, with some all-zero pages.
func memImage(pages int) []byte {
	b := make([]byte, pages*pageSize)
	fill(b)
	for p := 0; p < pages; p += 50 {
		clear(b[p*pageSize : (p+1)*pageSize])
	}
	return b
}

// mutate rewrites about frac of img's pages in runs of run pages (memory writes
// land on neighbouring pages: heap arenas, stacks), seeded for repeatability.
func mutate(img []byte, frac float64, run int, seed uint64) []byte {
	out := bytes.Clone(img)
	pages := len(img) / pageSize
	r := mrand.New(mrand.NewPCG(seed, 1))
	want := int(frac * float64(pages))
	changed := map[int]bool{}
	for len(changed) < want {
		start := r.IntN(pages - run)
		for p := start; p < start+run && len(changed) < want; p++ {
			if !changed[p] {
				changed[p] = true
				fill(out[p*pageSize : (p+1)*pageSize])
			}
		}
	}
	return out
}

var seedMu sync.Mutex
var seedN uint64

// fill fills b with pseudo-random bytes (ChaCha8: fast, incompressible).
func fill(b []byte) {
	seedMu.Lock()
	seedN++
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], seedN)
	seedMu.Unlock()
	mrand.NewChaCha8(seed).Read(b)
}

func commit(t *testing.T, s *Store, id string, files map[string][]byte) snapshot.Manifest {
	t.Helper()
	return stageAndCommit(t, s, id, files, s.Commit)
}

func stageAndCommit(t *testing.T, s *Store, id string, files map[string][]byte,
	commitFn func(context.Context, string, snapshot.Manifest) (snapshot.Manifest, error)) snapshot.Manifest {
	t.Helper()
	dir, err := s.Stage(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	for n, b := range files {
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m, err := commitFn(ctx, id, snapshot.Manifest{ID: id, SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func mustOpen(t *testing.T, s *Store, id string, want map[string][]byte) {
	t.Helper()
	dir, _, err := s.Open(ctx, id)
	if err != nil {
		t.Fatalf("open %s: %v", id, err)
	}
	for n, b := range want {
		got, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil || !bytes.Equal(got, b) {
			t.Fatalf("open %s: file %s differs (%v)", id, n, err)
		}
	}
}

func TestDiffSnapshot(t *testing.T) {
	s := newFSStore(t)
	img := memImage(4096) // 16 MiB
	kern := make([]byte, 300_000)
	rand.Read(kern)
	m1 := commit(t, s, "snap-1", map[string][]byte{"pages.img": img, "checkpoint.img": kern})
	img2 := mutate(img, 0.05, 16, 1)
	kern2 := bytes.Clone(kern)
	kern2[1000] ^= 1
	m2 := commit(t, s, "snap-2", map[string][]byte{"pages.img": img2, "checkpoint.img": kern2})
	t.Logf("first: logical %d stored %d new %d chunks %d", m1.LogicalBytes, m1.StoredBytes, m1.NewBytes, m1.Chunks)
	t.Logf("diff (5%% of pages in runs of 16): logical %d new %d (%.1f%%)", m2.LogicalBytes, m2.NewBytes, 100*float64(m2.NewBytes)/float64(m2.LogicalBytes))
	if m2.NewBytes > m2.LogicalBytes/10 {
		t.Errorf("diff snapshot wrote %d new bytes of %d logical (> 10%%)", m2.NewBytes, m2.LogicalBytes)
	}
	if m1.NewBytes < m1.LogicalBytes*8/10 {
		t.Errorf("first snapshot wrote only %d of %d bytes", m1.NewBytes, m1.LogicalBytes)
	}
	// An inserted page (gVisor maps new memory) shifts the rest of the file: the
	// content-defined cut points re-synchronise right after it.
	ins := append(bytes.Clone(img2[:100*pageSize]), make([]byte, pageSize)...)
	rand.Read(ins[100*pageSize:])
	ins = append(ins, img2[100*pageSize:]...)
	m3 := commit(t, s, "snap-3", map[string][]byte{"pages.img": ins, "checkpoint.img": kern2})
	t.Logf("one page inserted: new %d bytes", m3.NewBytes)
	if m3.NewBytes > 4*maxChunk {
		t.Errorf("one inserted page cost %d new bytes", m3.NewBytes)
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-1", map[string][]byte{"pages.img": img, "checkpoint.img": kern})
	mustOpen(t, s, "snap-2", map[string][]byte{"pages.img": img2, "checkpoint.img": kern2})
	mustOpen(t, s, "snap-3", map[string][]byte{"pages.img": ins})
}

func TestForksShareChunks(t *testing.T) {
	s := newFSStore(t)
	tmpl := memImage(4096) // 16 MiB
	m0 := commit(t, s, "snap-tmpl", map[string][]byte{"pages.img": tmpl})
	total := m0.NewBytes
	for i := 0; i < 10; i++ {
		f := mutate(tmpl, 0.005, 4, uint64(100+i))
		m := commit(t, s, fmt.Sprintf("snap-fork%d", i), map[string][]byte{"pages.img": f})
		total += m.NewBytes
	}
	u, _ := s.Usage(ctx)
	t.Logf("template stored %d; template + 10 forks: %d new bytes, %d in the backend (%.2fx)", m0.StoredBytes, total, u.ChunkBytes, float64(u.ChunkBytes)/float64(m0.StoredBytes))
	if u.ChunkBytes > m0.StoredBytes*3/2 || total != u.ChunkBytes {
		t.Errorf("11 snapshots store %d bytes, one stores %d (limit 1.5x)", u.ChunkBytes, m0.StoredBytes)
	}
}

func TestCorruptChunkNamed(t *testing.T) {
	s := newFSStore(t)
	img := memImage(1024)
	commit(t, s, "snap-c", map[string][]byte{"pages.img": img})
	d, _ := s.readDoc(ctx, "snap-c")
	bad := d.Files[0].Chunks[3].ID
	corruptChunk(t, s, bad)
	// The opened copy is still intact: Open uses it.
	mustOpen(t, s, "snap-c", map[string][]byte{"pages.img": img})
	// Verify reads the durable tier and names the chunk.
	_, err := s.Verify(ctx, "snap-c")
	var ce *snapshot.CorruptError
	if !errors.As(err, &ce) || ce.Snapshot != "snap-c" || ce.File != "pages.img" || !strings.Contains(err.Error(), bad) {
		t.Fatalf("verify: %v", err)
	}
	// Without the local copy, Open fails naming snapshot, file and chunk.
	dropLocal(t, s)
	_, _, err = s.Open(ctx, "snap-c")
	if !errors.As(err, &ce) || ce.Snapshot != "snap-c" || !strings.Contains(err.Error(), bad) {
		t.Fatalf("open: %v", err)
	}
	t.Logf("error: %v", err)
	// A damaged local copy is repaired from the chunks, not reported.
	s2 := newFSStore(t)
	commit(t, s2, "snap-d", map[string][]byte{"pages.img": img})
	dir, _, _ := s2.Open(ctx, "snap-d")
	b, _ := os.ReadFile(filepath.Join(dir, "pages.img"))
	b[5000] ^= 1
	os.WriteFile(filepath.Join(dir, "pages.img"), b, 0o600)
	mustOpen(t, s2, "snap-d", map[string][]byte{"pages.img": img})
}

// stopAfterPack is a backend that stops the S3 server once it has stored the
// first pack: the commit's next request fails, in the middle of the commit.
type stopAfterPack struct {
	Backend
	once sync.Once
	stop func()
}

func (b *stopAfterPack) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	err := b.Backend.Put(ctx, key, r, size)
	if strings.HasPrefix(key, "packs/") {
		b.once.Do(b.stop)
	}
	return err
}

func TestS3ColdCacheAndOutage(t *testing.T) {
	srv := s3test.Start(t)
	s := newS3Store(t, srv, 4<<20) // smaller than a snapshot: LRU evicts
	img := memImage(2048)
	files := map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel")}
	commit(t, s, "snap-a", files)
	dropLocal(t, s)
	mustOpen(t, s, "snap-a", files) // cold: every chunk from S3, filling the cache
	s.fill.wait()
	if used, n := s.cache.Used(); used > 4<<20 || n == 0 {
		t.Fatalf("cache holds %d bytes in %d chunks, limit %d", used, n, 4<<20)
	}

	// A fresh store on the same bucket (another host, or after a restart with an
	// empty disk) resumes from S3 alone.
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: s.b, CacheBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	mustOpen(t, s2, "snap-a", files)

	// The S3 server goes away in the middle of a commit.
	img2 := mutate(img, 0.3, 8, 7)
	dir, err := s.Stage(ctx, "snap-b")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "pages.img"), img2, 0o600)
	orig := s.b
	s.b = &stopAfterPack{Backend: orig, stop: srv.Stop} // stored: a pack; not stored: its index, the manifest
	cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	_, err = s.Commit(cctx, "snap-b", snapshot.Manifest{ID: "snap-b", Engine: "test"})
	cancel()
	s.b = orig
	if err == nil {
		t.Fatal("commit succeeded while the S3 server was stopped")
	}
	t.Logf("commit during outage: %v", err)
	srv.Restart()
	if ids, _ := s.List(ctx); len(ids) != 1 {
		t.Fatalf("after the failed commit: %v", ids)
	}
	if _, err := s.Manifest(ctx, "snap-b"); !errors.Is(err, snapshot.ErrNotFound) {
		t.Fatalf("failed commit left a manifest: %v", err)
	}
	if _, err := s.Commit(ctx, "snap-b", snapshot.Manifest{ID: "snap-b", Engine: "test"}); err != nil {
		t.Fatalf("retry after restart: %v", err)
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-b", map[string][]byte{"pages.img": img2})
	mustOpen(t, s, "snap-a", files)
}

func TestGCConcurrentWithCommits(t *testing.T) {
	rounds := 30
	if testing.Short() {
		rounds = 10
	}
	s := newFSStore(t)
	base := memImage(512) // 2 MiB
	var mu sync.Mutex
	want := map[string][]byte{}
	stop := make(chan struct{})
	var gcRuns int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		gcRuns = collectUntil(t, s, stop)
	}()
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			prev := base
			for i := 0; i < rounds; i++ {
				id := fmt.Sprintf("snap-w%d-%d", w, i)
				img := mutate(prev, 0.05, 8, uint64(w*1000+i))
				commit(t, s, id, map[string][]byte{"pages.img": img})
				// Straight after the commit, while GC runs: every chunk is in the backend.
				if _, err := s.Verify(ctx, id); err != nil {
					t.Errorf("verify %s during GC: %v", id, err)
				}
				mu.Lock()
				want[id] = img
				mu.Unlock()
				// Keep the last two of each writer; delete older ones (their chunks
				// are shared with the kept ones, partly).
				if i >= 2 {
					old := fmt.Sprintf("snap-w%d-%d", w, i-2)
					if err := s.Delete(ctx, old); err != nil {
						t.Error(err)
					}
					mu.Lock()
					delete(want, old)
					mu.Unlock()
				}
				prev = img
			}
		}()
	}
	// Writers finish, then GC stops.
	for {
		mu.Lock()
		n := len(want)
		mu.Unlock()
		time.Sleep(50 * time.Millisecond)
		if ids, _ := s.List(ctx); n == 4 && len(ids) == 4 {
			break
		}
	}
	close(stop)
	wg.Wait()
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	dropLocal(t, s)
	for id, img := range want {
		if _, err := s.Verify(ctx, id); err != nil {
			t.Fatalf("after %d GC runs: %v", gcRuns, err)
		}
		mustOpen(t, s, id, map[string][]byte{"pages.img": img})
	}
	t.Logf("%d GC runs during %d commits", gcRuns, 2*rounds)
}

func commitAsync(t *testing.T, s *Store, id string, files map[string][]byte) snapshot.Manifest {
	t.Helper()
	return stageAndCommit(t, s, id, files, s.CommitAsync)
}

func durable(t *testing.T, s *Store, id string) bool {
	t.Helper()
	ok, err := s.Durable(ctx, id)
	if err != nil {
		t.Fatalf("durable %s: %v", id, err)
	}
	return ok
}

func waitDurable(t *testing.T, s *Store, id string) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); !durable(t, s, id); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s not durable after 60 s", id)
		}
	}
}

// outboxEmpty waits (up to 10 s: an upload removes the chunks just after the
// manifest) until the outbox holds nothing.
func outboxEmpty(t *testing.T, s *Store) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		left := 0
		for _, prefix := range []string{"chunks/", "packs/", "index/", "manifests/"} {
			objs, err := s.outbox.List(ctx, prefix)
			if err != nil {
				t.Fatal(err)
			}
			left += len(objs)
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("outbox: %d objects left", left)
		}
	}
}

// An asynchronous hibernate while the S3 server is down: the snapshot is
// committed locally, reported not durable, opens from the local copy, survives a
// restart of the store, and is uploaded by the retries once S3 is back; then it
// opens on another host from S3 alone.
func TestS3AsyncUploadOutage(t *testing.T) {
	srv := s3test.Start(t)
	dir := t.TempDir()
	b := newS3Backend(t, srv)
	s, err := New(ctx, Config{Dir: dir, Backend: b, CacheBytes: 64 << 20, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	img := memImage(2048)
	files := map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel")}
	commit(t, s, "snap-a", files)

	srv.Stop()
	img2 := mutate(img, 0.05, 8, 3)
	files2 := map[string][]byte{"pages.img": img2, "checkpoint.img": []byte("kernel 2")}
	m := commitAsync(t, s, "snap-b", files2)
	if m.NewBytes == 0 || m.NewBytes > m.LogicalBytes/5 {
		t.Fatalf("diff commit to the outbox: new %d of %d logical bytes", m.NewBytes, m.LogicalBytes)
	}
	if durable(t, s, "snap-b") {
		t.Fatal("snap-b durable while the S3 server is down")
	}
	if ids, _ := s.Pending(ctx); len(ids) != 1 || ids[0] != "snap-b" {
		t.Fatalf("pending: %v", ids)
	}
	mustOpen(t, s, "snap-b", files2)   // from the local copy
	time.Sleep(300 * time.Millisecond) // several failed attempts
	if durable(t, s, "snap-b") {
		t.Fatal("snap-b durable while the S3 server is down")
	}

	// A restart while the upload is pending: the new process finds it and goes on.
	s.Close()
	s, err = New(ctx, Config{Dir: dir, Backend: b, CacheBytes: 64 << 20, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	if durable(t, s, "snap-b") {
		t.Fatal("snap-b durable after a restart while S3 is down")
	}
	mustOpen(t, s, "snap-b", files2)

	srv.Restart()
	s.UploadNow()
	waitDurable(t, s, "snap-b")
	outboxEmpty(t, s)

	// Another host with an empty disk resumes snap-b from S3 alone.
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: b, CacheBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if !durable(t, s2, "snap-b") {
		t.Fatal("snap-b not durable seen from another host")
	}
	mustOpen(t, s2, "snap-b", files2)
	mustOpen(t, s2, "snap-a", files)
}

// A pending snapshot whose local copy is lost before its upload: Open refuses
// it with an error naming the missing chunk and saying the snapshot is not
// durable, and the upload does not write a manifest for it.
func TestS3AsyncLostLocalCopyRefused(t *testing.T) {
	srv := s3test.Start(t)
	dir, b := t.TempDir(), newS3Backend(t, srv)
	s, err := New(ctx, Config{Dir: dir, Backend: b, CacheBytes: 64 << 20, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	files := map[string][]byte{"pages.img": memImage(512)}
	commitAsync(t, s, "snap-c", files)
	d, err := s.readDoc(ctx, "snap-c")
	if err != nil {
		t.Fatal(err)
	}
	// The first chunk: a resume reports the first chunk it misses.
	lost := d.Files[0].Chunks[0].ID
	s.idx.mu.Lock()
	l := s.idx.outKnown.locs[lost]
	s.idx.mu.Unlock()
	if l.Pack == "" {
		t.Fatalf("chunk %s is in no outbox pack", lost)
	}
	if err := os.Remove(filepath.Join(s.outbox.Dir(), filepath.FromSlash(packKey(l.Pack)))); err != nil {
		t.Fatal(err)
	}
	dropLocal(t, s)
	// A restart of the store: an upload attempt in flight may hold the chunk's
	// bytes read before the removal (and land them once S3 is back); Close
	// cancels it, and the new process has only what is on disk.
	s.Close()
	if s, err = New(ctx, Config{Dir: dir, Backend: b, CacheBytes: 64 << 20, UploadRetry: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv.Restart()
	s.UploadNow()
	time.Sleep(500 * time.Millisecond)
	_, _, err = s.Open(ctx, "snap-c")
	var ce *snapshot.CorruptError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), lost) || !strings.Contains(err.Error(), "not durable") {
		inBackend, _ := s.b.Exists(ctx, chunkKey(lost))
		_, inCache := s.cache.Get(lost)
		t.Fatalf("open of a pending snapshot with a lost chunk %s (in backend %v, cache %v): %v", lost, inBackend, inCache, err)
	}
	if durable(t, s, "snap-c") {
		t.Fatal("a snapshot with a lost chunk was made durable")
	}
	// Deleting it clears the outbox.
	if err := s.Delete(ctx, "snap-c"); err != nil {
		t.Fatal(err)
	}
	outboxEmpty(t, s)
	if ids, err := s.List(ctx); err != nil || len(ids) != 0 {
		t.Fatalf("after deleting the pending snapshot: %v %v", ids, err)
	}
}

// Asynchronous commits, uploads, deletes and collections at once: every
// snapshot still alive at the end opens, from S3 alone, byte for byte.
func TestS3AsyncWithGCConcurrent(t *testing.T) {
	srv := s3test.Start(t)
	b := newS3Backend(t, srv)
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: b, CacheBytes: 64 << 20, UploadRetry: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	base := memImage(512)
	want := map[string][]byte{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	stop := make(chan struct{})
	gcDone := make(chan int)
	go func() { gcDone <- collectUntil(t, s, stop) }()
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 6; i++ {
				id := fmt.Sprintf("snap-w%d-%d", w, i)
				img := mutate(base, 0.05, 4, uint64(w*100+i))
				commitAsync(t, s, id, map[string][]byte{"pages.img": img})
				if i%2 == 1 {
					if err := s.Delete(ctx, id); err != nil {
						t.Error(err)
					}
					continue
				}
				mu.Lock()
				want[id] = img
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	for id := range want {
		waitDurable(t, s, id)
	}
	close(stop)
	t.Logf("%d collections ran during the commits and uploads", <-gcDone)
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	outboxEmpty(t, s)
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	for id, img := range want {
		mustOpen(t, s2, id, map[string][]byte{"pages.img": img})
	}
}

// collectUntil runs Collect over and over until stop is closed (or it fails);
// it returns how many collections ran.
func collectUntil(t *testing.T, s *Store, stop <-chan struct{}) int {
	for n := 0; ; n++ {
		select {
		case <-stop:
			return n
		default:
		}
		if _, err := s.Collect(ctx, nil); err != nil {
			t.Errorf("collect: %v", err)
			return n
		}
	}
}

// cut makes whole-page chunks of at most maxChunk bytes; only the last may
// end in a partial page. The key it returns is the chunk's fingerprint, and a
// change anywhere in a chunk changes it.
func TestCutChunks(t *testing.T) {
	img := append(memImage(300), make([]byte, 1234)...) // a trailing partial page
	rand.Read(img[len(img)-1234:])
	n := 0
	for off := 0; off < len(img); n++ {
		size, key := cut(img[off:])
		if size <= 0 || size > maxChunk || (off+size < len(img) && size%pageSize != 0) {
			t.Fatalf("chunk at %d: %d bytes", off, size)
		}
		if fp := fingerprint(img[off : off+size]); fp != key {
			t.Fatalf("chunk at %d: cut's key %x, fingerprint %x", off, key, fp)
		}
		changed := bytes.Clone(img[off : off+size])
		changed[len(changed)-1] ^= 1
		if fingerprint(changed) == key {
			t.Fatalf("chunk at %d: its last byte changed, same key", off)
		}
		off += size
	}
	if n < 10 {
		t.Fatalf("%d chunks", n)
	}
}

// commitChild commits files as snapshot id whose parent is parent.
func commitChild(t *testing.T, s *Store, id, parent string, files map[string][]byte) (snapshot.Manifest, doc) {
	t.Helper()
	m := stageAndCommit(t, s, id, files, func(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
		m.Parent = parent
		return s.Commit(ctx, id, m)
	})
	d, err := s.readDoc(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return m, d
}

// A diff commit names unchanged chunks by their key match with the parent's
// chunks instead of hashing them, and the result is exactly what hashing gives:
// the same chunk list as a store that never saw the parent. Also after a
// restart (keys recomputed by the verifying Open), and whatever happens to the
// parent's opened copy on disk (keys come from the bytes that were hashed).
func TestDiffFromParentCopy(t *testing.T) {
	s := newFSStore(t)
	ref := newFSStore(t) // hashes everything
	img := memImage(4096)
	files1 := map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel 1")}
	commitChild(t, s, "snap-1", "", files1)

	img2 := mutate(img, 0.05, 16, 11)
	ins := append(bytes.Clone(img2[:700*pageSize]), make([]byte, 3*pageSize)...) // pages inserted
	rand.Read(ins[700*pageSize:])
	ins = append(ins, img2[700*pageSize:]...)
	files2 := map[string][]byte{"pages.img": ins, "checkpoint.img": []byte("kernel 2")}
	_, d2 := commitChild(t, s, "snap-2", "snap-1", files2)
	reused := s.lastReused.Load()
	_, want2 := commitChild(t, ref, "snap-2", "", files2)
	if !sameChunks(d2, want2) {
		t.Fatal("snap-2: the parent-copy commit named chunks differently from hashing them")
	}
	if n := len(d2.Files[1].Chunks); reused < int64(n)*8/10 {
		t.Fatalf("snap-2: %d of %d chunks named by a parent chunk's key, want ≥ 80%%", reused, n)
	}
	t.Logf("snap-2: %d of %d chunks named by a parent chunk's key", reused, len(d2.Files[1].Chunks))

	// A restart: no keys in memory until Open verifies the copy.
	s2, err := New(ctx, Config{Dir: s.dir})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	mustOpen(t, s2, "snap-2", files2)
	img3 := mutate(ins, 0.02, 8, 12)
	files3 := map[string][]byte{"pages.img": img3, "checkpoint.img": []byte("kernel 3")}
	_, d3 := commitChild(t, s2, "snap-3", "snap-2", files3)
	if s2.lastReused.Load() == 0 {
		t.Fatal("snap-3 after a restart: nothing taken from the verified parent copy")
	}
	_, want3 := commitChild(t, ref, "snap-3", "", files3)
	if !sameChunks(d3, want3) {
		t.Fatal("snap-3: chunks differ from hashing")
	}

	// The parent's copy is changed behind the store's back, mtime put back,
	// and the new snapshot holds the changed bytes: the keys recorded when the
	// parent was committed (from its true content) differ from the changed
	// chunk's, so no chunk gets the old content's id.
	p := filepath.Join(s2.opened("snap-3"), "pages.img")
	st, _ := os.Stat(p)
	tampered := bytes.Clone(img3)
	rand.Read(tampered[5*pageSize : 6*pageSize])
	if err := os.WriteFile(p, tampered, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chtimes(p, st.ModTime(), st.ModTime())
	files4 := map[string][]byte{"pages.img": tampered, "checkpoint.img": []byte("kernel 4")}
	_, d4 := commitChild(t, s2, "snap-4", "snap-3", files4)
	_, want4 := commitChild(t, ref, "snap-4", "", files4)
	if !sameChunks(d4, want4) {
		t.Fatal("snap-4: a tampered parent copy gave chunks different from hashing")
	}
	dropLocal(t, s2)
	mustOpen(t, s2, "snap-4", files4)

	// A copy rebuilt from the chunks (a cold resume after a restart: no keys in
	// memory) is a parent too: its keys come from the verified chunks it was
	// written from.
	s3, err := New(ctx, Config{Dir: s.dir})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	dropLocal(t, s3)
	mustOpen(t, s3, "snap-4", files4)
	img5 := mutate(tampered, 0.02, 8, 13)
	files5 := map[string][]byte{"pages.img": img5, "checkpoint.img": []byte("kernel 5")}
	_, d5 := commitChild(t, s3, "snap-5", "snap-4", files5)
	if n := s3.lastReused.Load(); n < int64(len(d5.Files[1].Chunks))*8/10 {
		t.Fatalf("snap-5 after a cold open of its parent: %d of %d chunks from the rebuilt copy, want ≥ 80%%", n, len(d5.Files[1].Chunks))
	}
	_, want5 := commitChild(t, ref, "snap-5", "", files5)
	if !sameChunks(d5, want5) {
		t.Fatal("snap-5: chunks differ from hashing")
	}
}

// zeroKey is the fingerprint of zeros, for the all-zero chunks a rebuilt copy
// does not fetch.
func TestZeroKey(t *testing.T) {
	for _, n := range []int64{1, 100, pageSize, pageSize + 1, 3 * pageSize, maxChunk} {
		if got, want := zeroKey(n), fingerprint(make([]byte, n)); got != want {
			t.Errorf("zeroKey(%d) = %x, fingerprint %x", n, got, want)
		}
	}
}

func sameChunks(a, b doc) bool {
	if len(a.Files) != len(b.Files) {
		return false
	}
	for i := range a.Files {
		if a.Files[i].Name != b.Files[i].Name || len(a.Files[i].Chunks) != len(b.Files[i].Chunks) {
			return false
		}
		for j := range a.Files[i].Chunks {
			if a.Files[i].Chunks[j].ID != b.Files[i].Chunks[j].ID || a.Files[i].Chunks[j].Len != b.Files[i].Chunks[j].Len {
				return false
			}
		}
	}
	return true
}

// TestWarmCopyCheckedByFingerprint: the opened copy of a snapshot this process
// committed is checked against the chunk keys it knows (no sha256), and a
// flipped byte in it is found; without known keys the same copy fails the
// sha256 check.
func TestWarmCopyCheckedByFingerprint(t *testing.T) {
	s := newFSStore(t)
	img := memImage(512)
	commit(t, s, "snap-w", map[string][]byte{"pages.img": img})
	dir, _, err := s.Open(ctx, "snap-w")
	if err != nil {
		t.Fatal(err)
	}
	d, ok := s.docs.get("snap-w")
	if !ok || !knownKeys(d) {
		t.Fatal("keys of a snapshot committed by this process are not known")
	}
	if _, err := s.verifyDir(ctx, "snap-w", dir, d); err != nil {
		t.Fatalf("intact copy: %v", err)
	}
	p := filepath.Join(dir, "pages.img")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2+123] ^= 0x10
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	var ce *snapshot.CorruptError
	if _, err := s.verifyDir(ctx, "snap-w", dir, d); !errors.As(err, &ce) || !strings.Contains(err.Error(), "fingerprint mismatch") {
		t.Fatalf("damaged copy, keys known: %v", err)
	}
	d.keys = nil
	if _, err := s.verifyDir(ctx, "snap-w", dir, d); !errors.As(err, &ce) || !strings.Contains(err.Error(), "sha256 mismatch") {
		t.Fatalf("damaged copy, keys unknown: %v", err)
	}
	// Open repairs the copy from the chunks.
	mustOpen(t, s, "snap-w", map[string][]byte{"pages.img": img})
}

// openAt opens (or reopens, as after a restart) a filesystem-backed store in dir.
func openAt(t *testing.T, dir string) *Store {
	t.Helper()
	s, err := New(ctx, Config{Dir: dir})
	if err != nil {
		t.Fatalf("open the store in %s: %v", dir, err)
	}
	return s
}

// Garbage a crash can leave in the backend — a pack without its index, a pack
// whose index was never synced (empty) — neither stops the store from opening
// nor survives a collection; the committed snapshot is untouched.
func TestPackGarbageCollected(t *testing.T) {
	dir := t.TempDir()
	s := openAt(t, dir)
	files := map[string][]byte{"pages.img": memImage(1024)}
	commit(t, s, "snap-a", files)
	s.Close()
	fsb := s.b.(*FS)
	lone, broken := newPackID(), newPackID()
	for _, k := range []string{packKey(lone), packKey(broken)} {
		if err := fsb.Put(ctx, k, bytes.NewReader([]byte("garbage")), 7); err != nil {
			t.Fatal(err)
		}
	}
	if err := fsb.Put(ctx, indexKey(broken), bytes.NewReader(nil), 0); err != nil {
		t.Fatal(err)
	}
	s = openAt(t, dir) // with a broken pack index
	defer s.Close()
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{packKey(lone), packKey(broken), indexKey(broken)} {
		if ok, _ := fsb.Exists(ctx, k); ok {
			t.Errorf("%s survived the collection", k)
		}
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-a", files)
	if u, err := s.Usage(ctx); err != nil || u.Packs == 0 {
		t.Fatalf("usage after the collection: %+v %v", u, err)
	}
}

// A chunk found damaged in the backend is written again by the next commit that
// has its bytes, which repairs every snapshot referencing it — also after a
// restart, when the damaged copy's index still lists it.
func TestDamagedChunkRepairedByNextCommit(t *testing.T) {
	dir := t.TempDir()
	s := openAt(t, dir)
	files := commitDamaged(t, s, "snap-a")
	// The sandbox still holds the bytes: its next hibernate stores the chunk again.
	m := commit(t, s, "snap-b", files)
	if m.NewBytes == 0 {
		t.Fatal("the damaged chunk was not written again")
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-a", files)
	s.Close()
	s = openAt(t, dir)
	defer s.Close()
	mustOpen(t, s, "snap-a", files)
	if _, err := s.Verify(ctx, "snap-a"); err != nil {
		t.Fatalf("verify after the repair and a restart: %v", err)
	}
}

// commitDamaged commits snapshot id, damages one of its chunks in the backend,
// and checks that an Open from the backend finds it; it returns the files.
func commitDamaged(t *testing.T, s *Store, id string) map[string][]byte {
	t.Helper()
	files := map[string][]byte{"pages.img": memImage(1024)}
	commit(t, s, id, files)
	d, _ := s.readDoc(ctx, id)
	bad := d.Files[0].Chunks[5].ID
	corruptChunk(t, s, bad)
	dropLocal(t, s)
	if _, _, err := s.Open(ctx, id); err == nil || !strings.Contains(err.Error(), bad) {
		t.Fatalf("open with a damaged chunk: %v", err)
	}
	return files
}

// A diff commit whose parent holds the damaged chunk stores it again too:
// the chunk matches the parent's by key, and the store knows the parent's copy
// of it is bad.
func TestDamagedChunkRepairedByNextDiffCommit(t *testing.T) {
	s := newFSStore(t)
	files := commitDamaged(t, s, "snap-a")
	m, _ := commitChild(t, s, "snap-b", "snap-a", files)
	if s.lastReused.Load() == 0 {
		t.Fatal("no chunk matched the parent's")
	}
	if m.NewBytes == 0 {
		t.Fatal("the damaged chunk was not written again")
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-b", files)
	mustOpen(t, s, "snap-a", files)
}

// A live snapshot's pack whose index is unreadable is not collected: the
// store cannot tell what is in it, and the snapshot needs it.
func TestUnindexedLivePackKept(t *testing.T) {
	dir := t.TempDir()
	s := openAt(t, dir)
	files := map[string][]byte{"pages.img": memImage(512)}
	commit(t, s, "snap-a", files)
	s.idx.mu.Lock()
	var pack string
	for id := range s.idx.known.packs {
		pack = id
	}
	s.idx.mu.Unlock()
	s.Close()
	fsb := s.b.(*FS)
	good, err := os.ReadFile(filepath.Join(fsb.Dir(), filepath.FromSlash(indexKey(pack))))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fsb.Dir(), filepath.FromSlash(indexKey(pack))), []byte("garbage{{{"), 0o600); err != nil {
		t.Fatal(err)
	}
	s = openAt(t, dir)
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if ok, _ := fsb.Exists(ctx, packKey(pack)); !ok {
		t.Fatal("a live snapshot's pack with an unreadable index was collected")
	}
	s.Close()
	// Once the index is readable again, the snapshot opens from the backend.
	if err := os.WriteFile(filepath.Join(fsb.Dir(), filepath.FromSlash(indexKey(pack))), good, 0o600); err != nil {
		t.Fatal(err)
	}
	s = openAt(t, dir)
	defer s.Close()
	dropLocal(t, s)
	mustOpen(t, s, "snap-a", files)
}

// An S3 server that accepts connections and never answers does not hold an
// asynchronous hibernate for minutes: the stage's existence check gives up
// after 3 s and the commit does not touch the backend; once the server answers
// again the upload completes.
func TestS3HungServerAsyncCommit(t *testing.T) {
	srv := s3test.Start(t)
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: newS3Backend(t, srv), CacheBytes: 64 << 20, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	files := map[string][]byte{"pages.img": memImage(256)}
	commit(t, s, "snap-a", files)
	srv.Freeze()
	t0 := time.Now()
	commitAsync(t, s, "snap-b", files)
	if d := time.Since(t0); d > 30*time.Second {
		t.Fatalf("asynchronous commit with a hung S3 server took %v", d)
	}
	if durable(t, s, "snap-b") {
		t.Fatal("snap-b durable while the S3 server hangs")
	}
	srv.Thaw()
	s.UploadNow()
	waitDurable(t, s, "snap-b")
	dropLocal(t, s)
	mustOpen(t, s, "snap-b", files)
}

// A sandbox hibernated again and again rewrites the same hot pages and a few
// cold ones: each diff pack keeps a few live chunks among many dead ones.
// Collect rewrites such packs with their live chunks only, so the backend
// holds little more than what live snapshots use, and they still open.
func TestRepackPartlyDeadPacks(t *testing.T) {
	s := newFSStore(t)
	img := memImage(512)
	commit(t, s, "snap-0", map[string][]byte{"pages.img": img})
	r := mrand.New(mrand.NewPCG(5, 5))
	for i := 1; i <= 10; i++ {
		img = bytes.Clone(img)
		fill(img[:256*pageSize]) // hot: rewritten every cycle
		for k := 0; k < 4; k++ { // cold: a few pages elsewhere
			p := 256 + r.IntN(256)
			fill(img[p*pageSize : (p+1)*pageSize])
		}
		id, prev := fmt.Sprintf("snap-%d", i), fmt.Sprintf("snap-%d", i-1)
		commitChild(t, s, id, prev, map[string][]byte{"pages.img": img})
		if err := s.Delete(ctx, prev); err != nil {
			t.Fatal(err)
		}
	}
	stored := func() (packs, live int64) {
		objs, err := s.b.List(ctx, "packs/")
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			packs += o.Size
		}
		d, err := s.readDoc(ctx, "snap-10")
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, c := range d.Files[0].Chunks {
			if c.ID != "" && !seen[c.ID] {
				seen[c.ID] = true
				live += c.Stored
			}
		}
		return packs, live
	}
	if _, err := s.Collect(ctx, []string{"snap-10"}); err != nil {
		t.Fatal(err)
	}
	packs, live := stored()
	t.Logf("after collection: %d pack bytes for %d live bytes (%.2fx)", packs, live, float64(packs)/float64(live))
	if float64(packs) > 1.5*float64(live) {
		t.Fatalf("%d pack bytes for %d live bytes: partly dead packs were not rewritten", packs, live)
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-10", map[string][]byte{"pages.img": img})
}

// newS3StoreRetrying starts versitygw and opens a store on a new bucket of it in a new
// directory, retrying uploads every 50 ms.
func newS3StoreRetrying(t *testing.T) (*s3test.Server, string, *S3, *Store) {
	t.Helper()
	srv := s3test.Start(t)
	dir := t.TempDir()
	b := newS3Backend(t, srv)
	s, err := New(ctx, Config{Dir: dir, Backend: b, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return srv, dir, b, s
}

// Deleting a snapshot that waits for its upload while S3 is down fails and
// leaves it whole (listed, not durable, openable) so the caller can try again;
// once S3 is back the delete goes through. A store that starts while S3 is
// down reports its usage as unknown (an error), not as an empty bucket.
func TestS3DeleteAndUsageWhileDown(t *testing.T) {
	srv, _, b, s := newS3StoreRetrying(t)
	defer s.Close()
	files := map[string][]byte{"pages.img": memImage(512), "checkpoint.img": []byte("kernel")}
	commit(t, s, "snap-a", files)
	srv.Stop()
	commitAsync(t, s, "snap-b", files)
	if err := s.Delete(ctx, "snap-b"); !errors.Is(err, snapshot.ErrUnavailable) {
		t.Fatalf("delete of a pending snapshot while S3 is down: %v, want ErrUnavailable", err)
	}
	if durable(t, s, "snap-b") {
		t.Fatal("snap-b reported durable after a failed delete")
	}
	mustOpen(t, s, "snap-b", files)

	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if u, err := s2.Usage(ctx); !errors.Is(err, snapshot.ErrUnavailable) {
		t.Fatalf("usage of a store that never listed S3: %+v %v, want ErrUnavailable", u, err)
	}

	srv.Restart()
	if err := s.Delete(ctx, "snap-b"); err != nil {
		t.Fatalf("delete once S3 is back: %v", err)
	}
	if ids, err := s.List(ctx); err != nil || len(ids) != 1 || ids[0] != "snap-a" {
		t.Fatalf("list after the delete: %v %v", ids, err)
	}
	if u, err := s2.Usage(ctx); err != nil || u.Chunks == 0 || u.StoredBytes == 0 {
		t.Fatalf("usage once S3 is back: %+v %v", u, err)
	}
}

// A store restarted while S3 is down cannot see which chunks S3 holds, so its
// commits store them again; once they are uploaded, garbage collection keeps
// one copy of each chunk (the one reads use) and reclaims the others, and
// every snapshot still opens from S3 alone.
func TestS3DuplicateCopiesCollected(t *testing.T) {
	srv, dir, b, s := newS3StoreRetrying(t)
	img := memImage(2048)
	files := map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel")}
	commit(t, s, "snap-a", files)
	s.Close()

	srv.Stop()
	s, err := New(ctx, Config{Dir: dir, Backend: b, UploadRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	files2 := map[string][]byte{"pages.img": mutate(img, 0.02, 8, 5), "checkpoint.img": []byte("kernel 2")}
	m := commitAsync(t, s, "snap-b", files2)
	if m.NewBytes < m.LogicalBytes/2 {
		t.Fatalf("a commit that cannot see S3 wrote %d new of %d bytes; the test needs it to store the chunks again", m.NewBytes, m.LogicalBytes)
	}
	srv.Restart()
	s.UploadNow()
	waitDurable(t, s, "snap-b")
	before, err := s.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if before.StoredBytes < before.ChunkBytes*3/2 {
		t.Fatalf("after the upload: stored %d, chunk bytes %d; the test needs duplicate copies", before.StoredBytes, before.ChunkBytes)
	}
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	after, err := s.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stored bytes %d -> %d, chunk bytes %d", before.StoredBytes, after.StoredBytes, after.ChunkBytes)
	if after.StoredBytes > after.ChunkBytes*11/10 {
		t.Errorf("after collection: stored %d for %d bytes of distinct chunks", after.StoredBytes, after.ChunkBytes)
	}
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	mustOpen(t, s2, "snap-a", files)
	mustOpen(t, s2, "snap-b", files2)
	for _, id := range []string{"snap-a", "snap-b"} {
		if _, err := s2.Verify(ctx, id); err != nil {
			t.Errorf("verify %s: %v", id, err)
		}
	}
}

// A store opened while S3 is hung (connections accepted, never answered)
// starts after the bucket check's deadline instead of waiting for the server,
// and lists the bucket once it answers again.
func TestS3HungAtStart(t *testing.T) {
	srv := s3test.Start(t)
	b := newS3Backend(t, srv)
	files := map[string][]byte{"pages.img": memImage(256)}
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	commit(t, s, "snap-a", files)
	s.Close()

	srv.Freeze()
	t0 := time.Now()
	b2, err := NewS3(ctx, s3Config(srv, b.bucket))
	if err != nil {
		srv.Thaw()
		t.Fatalf("NewS3 with the server hung: %v", err)
	}
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: b2})
	took := time.Since(t0)
	if err != nil {
		srv.Thaw()
		t.Fatalf("New with the server hung: %v", err)
	}
	defer s2.Close()
	if took > 2*s3MetaTimeout {
		t.Errorf("opening the store with S3 hung took %v", took)
	}
	t.Logf("opened with S3 hung in %v", took)
	// While it hangs, each request gives up after a probe (s3ProbeTimeout)
	// instead of its own deadline (120 s for a listing: a server's start made
	// two and took 4 min in a new-user trial).
	for name, call := range map[string]func() error{
		"List":    func() error { _, err := s2.List(ctx); return err },
		"Usage":   func() error { _, err := s2.Usage(ctx); return err },
		"Recover": func() error { return s2.Recover(ctx) },
	} {
		t1 := time.Now()
		err := call()
		if d := time.Since(t1); d > 2*s3ProbeTimeout {
			t.Errorf("%s with S3 hung took %v (err %v)", name, d, err)
		} else {
			t.Logf("%s with S3 hung: %v after %v", name, err, d.Round(time.Millisecond))
		}
	}
	srv.Thaw()
	mustOpen(t, s2, "snap-a", files)
	if u, err := s2.Usage(ctx); err != nil || u.Chunks == 0 {
		t.Errorf("usage once S3 answers again: %+v %v", u, err)
	}
}

// TestS3OwnerClaim: a store claims its S3 prefix on first use; another store
// (another data directory) is refused the prefix, before it writes or deletes
// anything, with the owner named; the owner reopens it; another prefix of the
// same bucket is free; of stores claiming a fresh prefix at once exactly one
// wins; and a store that started while S3 was down finds out on its first
// write.
func TestS3OwnerClaim(t *testing.T) {
	srv := s3test.Start(t)
	b := newS3Backend(t, srv) // creates the bucket; no owner
	cfg := func(prefix, id string) S3Config {
		return S3Config{Endpoint: srv.Endpoint, Bucket: b.bucket, AccessKey: srv.AccessKey, SecretKey: srv.SecretKey,
			Region: srv.Region, PathStyle: true, Prefix: prefix,
			Owner: &Owner{StoreID: id, Host: "host-" + id, DataDir: "/data/" + id}}
	}
	ba, err := NewS3(ctx, cfg("p/", "aaaa"))
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(ctx, Config{Dir: t.TempDir(), Backend: ba})
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{"pages.img": memImage(64)}
	commit(t, a, "snap-a", files)
	a.Close()

	_, err = NewS3(ctx, cfg("p/", "bbbb"))
	if !errors.Is(err, ErrOwnedElsewhere) || !strings.Contains(err.Error(), "/data/aaaa") || !strings.Contains(err.Error(), "host-aaaa") {
		t.Fatalf("a second store on the prefix: %v", err)
	}
	t.Logf("refused: %v", err)
	if _, err := NewS3(ctx, cfg("p/", "aaaa")); err != nil {
		t.Fatalf("the owner again: %v", err)
	}
	if _, err := NewS3(ctx, cfg("q/", "bbbb")); err != nil {
		t.Fatalf("another prefix: %v", err)
	}
	// A reader without an owner (offline inspection) is not refused.
	rcfg := s3Config(srv, b.bucket)
	rcfg.Prefix = "p/"
	rb, err := NewS3(ctx, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(ctx, Config{Dir: t.TempDir(), Backend: rb, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	mustOpen(t, r, "snap-a", files)
	r.Close()

	// Claims racing for fresh prefixes: one winner each.
	for round := 0; round < 5; round++ {
		prefix := fmt.Sprintf("race-%d/", round)
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = NewS3(ctx, cfg(prefix, fmt.Sprintf("racer%d", i)))
			}()
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			switch {
			case err == nil:
				won++
			case !errors.Is(err, ErrOwnedElsewhere):
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if won != 1 {
			t.Fatalf("round %d: %d stores claimed %s: %v", round, won, prefix, errs)
		}
	}

	// Started while S3 was down: the claim is checked on the first write, and
	// a foreign prefix stays refused.
	srv.Stop()
	bc, err := NewS3(ctx, cfg("p/", "cccc"))
	if err != nil {
		srv.Restart()
		t.Fatalf("NewS3 with S3 down: %v", err)
	}
	if err := bc.Put(ctx, "chunks/x", strings.NewReader("x"), 1); !errors.Is(err, snapshot.ErrUnavailable) {
		srv.Restart()
		t.Fatalf("put with S3 down: %v", err)
	}
	srv.Restart()
	for _, err := range []error{bc.Put(ctx, "chunks/x", strings.NewReader("x"), 1), bc.Delete(ctx, "manifests/snap-a.json")} {
		if !errors.Is(err, ErrOwnedElsewhere) {
			t.Fatalf("write by a store that started with S3 down: %v", err)
		}
	}
	a2, err := New(ctx, Config{Dir: t.TempDir(), Backend: ba})
	if err != nil {
		t.Fatal(err)
	}
	defer a2.Close()
	mustOpen(t, a2, "snap-a", files)

	// The claim deleted by hand while its store runs: the store's next write
	// (after claimRecheck) writes it again; taken by another store meanwhile,
	// the running store's writes stop.
	defer func(d time.Duration) { claimRecheck = d }(claimRecheck)
	claimRecheck = 0
	drop := func() {
		if err := ba.c.RemoveObject(ctx, b.bucket, "p/"+ownerKey, minio.RemoveObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	drop()
	if err := ba.Put(ctx, "chunks/y", strings.NewReader("y"), 1); err != nil {
		t.Fatalf("write after the claim was deleted: %v", err)
	}
	if _, err := NewS3(ctx, cfg("p/", "dddd")); !errors.Is(err, ErrOwnedElsewhere) {
		t.Fatalf("another store after the owner claimed again: %v", err)
	}
	drop()
	if _, err := NewS3(ctx, cfg("p/", "eeee")); err != nil {
		t.Fatal(err)
	}
	if err := ba.Put(ctx, "chunks/y", strings.NewReader("y"), 1); !errors.Is(err, ErrOwnedElsewhere) {
		t.Fatalf("write after another store took the prefix: %v", err)
	}
}

// TestS3PlainHTTPEndpoint: host:port means https; a server that answers plain
// HTTP there is refused at start with the http:// spelling (a new-user trial
// saw it taken for an outage: the server started and no upload ever worked).
func TestS3PlainHTTPEndpoint(t *testing.T) {
	srv := s3test.Start(t)
	_, err := NewS3(ctx, S3Config{Endpoint: srv.Addr, Bucket: "torpor-x", AccessKey: srv.AccessKey,
		SecretKey: srv.SecretKey, Region: srv.Region, PathStyle: true})
	if err == nil || !strings.Contains(err.Error(), "http://"+srv.Addr) {
		t.Fatalf("NewS3(%s) against a plain-HTTP server: %v", srv.Addr, err)
	}
}

// A pending snapshot deleted between the upload's listing and its own upload
// (its outbox chunks dropped under it) is skipped quietly: the others upload in
// the same pass instead of waiting out a backoff behind a false failure.
func TestS3AsyncDeletedDuringUpload(t *testing.T) {
	srv := s3test.Start(t)
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: newS3Backend(t, srv), CacheBytes: 64 << 20, UploadRetry: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv.Stop() // the background upload fails and waits an hour
	img := memImage(1024)
	commitAsync(t, s, "snap-a", map[string][]byte{"pages.img": img})
	filesB := map[string][]byte{"pages.img": memImage(1024)} // no chunk shared: snap-a's pack goes with it
	commitAsync(t, s, "snap-b", filesB)
	srv.Restart()
	testBeforeUpload = func(id string) {
		if id == "snap-a" {
			if err := s.Delete(ctx, id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
	}
	defer func() { testBeforeUpload = nil }()
	n, err := s.uploadPending(ctx)
	if err != nil || n != 1 {
		t.Fatalf("upload pass with snap-a deleted during it: %d uploaded, err %v; want 1, nil", n, err)
	}
	if !durable(t, s, "snap-b") {
		t.Fatal("snap-b not durable after the pass")
	}
	mustOpen(t, s, "snap-b", filesB)
	if ids, _ := s.List(ctx); len(ids) != 1 || ids[0] != "snap-b" {
		t.Fatalf("snapshots after the pass: %v, want [snap-b]", ids)
	}
}

// Config.OpenBytes bounds the opened copies: over it the least recently used
// copies (none used within openGrace) are removed; their snapshots still open,
// reassembled from the chunks. Without the bound every live snapshot kept its
// uncompressed copy.
func TestOpenedCopiesBounded(t *testing.T) {
	defer func(g time.Duration) { openGrace = g }(openGrace)
	openGrace = 0
	const copyBytes = 256 * pageSize // 1 MiB per snapshot
	s, err := New(ctx, Config{Dir: t.TempDir(), OpenBytes: 3*copyBytes + copyBytes/2})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	openBytes := func() int64 {
		var n int64
		ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
		for _, e := range ents {
			b, _ := dirBytes(filepath.Join(s.dir, "open", e.Name()))
			n += b
		}
		return n
	}
	files := map[string]map[string][]byte{}
	for i := 0; i < 6; i++ {
		id := fmt.Sprintf("snap-%d", i)
		files[id] = map[string][]byte{"pages.img": memImage(256)}
		commit(t, s, id, files[id])
		time.Sleep(10 * time.Millisecond) // distinct last-use times
	}
	deadline := time.Now().Add(10 * time.Second)
	for openBytes() > 3*copyBytes+copyBytes/2 {
		if time.Now().After(deadline) {
			t.Fatalf("opened copies hold %d bytes, bound %d", openBytes(), 3*copyBytes+copyBytes/2)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for i, want := range []bool{false, false, false, true, true, true} {
		_, err := os.Stat(s.opened(fmt.Sprintf("snap-%d", i)))
		if kept := err == nil; kept != want {
			t.Errorf("snap-%d: opened copy kept %v, want %v (least recently used go first)", i, kept, want)
		}
	}
	for i := 0; i < 6; i++ { // evicted or not, every snapshot opens whole
		id := fmt.Sprintf("snap-%d", i)
		mustOpen(t, s, id, files[id])
		time.Sleep(10 * time.Millisecond)
	}
}

// Deletes postpone the background collection until GCQuiet passes without one,
// but at most gcMaxWait: a server hibernating every few seconds deletes a
// snapshot each time and would otherwise never collect.
func TestAutoGCNotStarvedBySteadyDeletes(t *testing.T) {
	defer func(w time.Duration) { gcMaxWait = w }(gcMaxWait)
	gcMaxWait = time.Second
	s, err := New(ctx, Config{Dir: t.TempDir(), AutoGC: true, GCQuiet: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	commit(t, s, "snap-a", map[string][]byte{"pages.img": memImage(256)})
	commit(t, s, "snap-b", map[string][]byte{"pages.img": memImage(256)})
	before, err := s.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "snap-a"); err != nil {
		t.Fatal(err)
	}
	// Deletes keep coming every 200 ms (kicks, as Delete sends), never 500 ms apart.
	stop := time.Now().Add(4 * time.Second)
	for time.Now().Before(stop) {
		select {
		case s.gc.kick <- struct{}{}:
		default:
		}
		time.Sleep(200 * time.Millisecond)
		if u, _ := s.Usage(ctx); u.Chunks < before.Chunks {
			t.Logf("collected %d chunks while deletes kept coming", before.Chunks-u.Chunks)
			return
		}
	}
	t.Fatalf("no collection in 4 s of steady deletes (gcMaxWait 1 s): %d chunks before and after", before.Chunks)
}

// A hibernate's requests against a hung S3 (connections accepted, never
// answered) do not each wait out their own deadline: the stage check's 3 s
// deadline marks S3 hung, so a synchronous commit's first upload gives up after
// a probe (it waited 60 s, a new-user trial's sync hibernate took 63 s), and
// deleting the snapshot a hibernate replaced fails at once (an asynchronous
// hibernate's answer waited 10 s for it). The prefix has an owner whose claim
// is read again before each write (as after a minute of uptime).
func TestS3HungHibernateSequence(t *testing.T) {
	srv := s3test.Start(t)
	cfg := s3Config(srv, newS3Backend(t, srv).bucket) // the bucket made
	cfg.Owner = &Owner{StoreID: "store-hung", Host: "test", DataDir: t.TempDir()}
	b, err := NewS3(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func(d time.Duration) { claimRecheck = d }(claimRecheck)
	claimRecheck = 0
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: b, UploadRetry: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	files := map[string][]byte{"pages.img": memImage(256)}
	commit(t, s, "snap-a", files)
	srv.Freeze()
	defer srv.Thaw()
	stage := func(id string) {
		dir, err := s.Stage(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "pages.img"), mutate(files["pages.img"], 0.05, 8, 3), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	man := func(id string) snapshot.Manifest {
		return snapshot.Manifest{ID: id, SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()}
	}
	t0 := time.Now()
	stage("snap-b")
	if _, err := s.CommitAsync(ctx, "snap-b", man("snap-b")); err != nil {
		t.Fatal(err)
	}
	err = s.Delete(ctx, "snap-a")
	d := time.Since(t0)
	t.Logf("stage, async commit and delete of the replaced snapshot: %v (delete: %v)", d.Round(time.Millisecond), err)
	if !errors.Is(err, snapshot.ErrUnavailable) {
		t.Errorf("delete with S3 hung: %v, want ErrUnavailable", err)
	}
	if d > 3*time.Second+s3ProbeTimeout {
		t.Errorf("async hibernate sequence with S3 hung took %v", d)
	}
	t1 := time.Now()
	stage("snap-c")
	_, err = s.Commit(ctx, "snap-c", man("snap-c"))
	d = time.Since(t1)
	t.Logf("stage and synchronous commit: %v (%v)", d.Round(time.Millisecond), err)
	if !errors.Is(err, snapshot.ErrUnavailable) {
		t.Errorf("sync commit with S3 hung: %v, want ErrUnavailable", err)
	}
	if d > 3*time.Second+3*s3ProbeTimeout {
		t.Errorf("sync hibernate sequence with S3 hung took %v", d)
	}
}
