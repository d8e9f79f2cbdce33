package chunked

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// clusterStores returns n stores (nodes) on one new bucket of srv, each
// with its own S3 client, directory and database connection, sharing the
// collection lock of one store id in a private PostgreSQL database.
func clusterStores(t *testing.T, srv *s3test.Server, n int, put func(key string) error) []*Store {
	t.Helper()
	stores, _ := clusterStoresURL(t, srv, n, put)
	return stores
}

// clusterStoresURL is clusterStores, also returning the database's URL.
func clusterStoresURL(t *testing.T, srv *s3test.Server, n int, put func(key string) error) ([]*Store, string) {
	t.Helper()
	return clusterStoresWith(t, srv, n, func(i int, b Backend) Backend {
		if put != nil && i == 0 {
			return &watchPuts{Backend: b, put: put}
		}
		return b
	})
}

// clusterStoresWith is clusterStoresURL with store i's backend wrap(i, b).
func clusterStoresWith(t *testing.T, srv *s3test.Server, n int, wrap func(i int, b Backend) Backend) ([]*Store, string) {
	t.Helper()
	pg := pgtest.Start(t)
	url := pg.NewDatabase(t)
	bucketMu.Lock()
	bucketSeq++
	bucket := fmt.Sprintf("torpor-%d", bucketSeq)
	bucketMu.Unlock()
	var out []*Store
	for i := 0; i < n; i++ {
		cfg := s3Config(srv, bucket)
		cfg.CreateBucket = i == 0
		b, err := NewS3(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		db, err := postgres.Open(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		s, err := New(ctx, Config{Dir: t.TempDir(), Backend: wrap(i, b), CacheBytes: 64 << 20,
			UploadRetry: 20 * time.Millisecond, CollectLock: db.CollectLock("store-1")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		out = append(out, s)
	}
	return out, url
}

// watchPuts calls put before every Put to the backend; an error it returns
// fails the Put.
type watchPuts struct {
	Backend
	put func(key string) error
}

func (w *watchPuts) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if err := w.put(key); err != nil {
		return err
	}
	return w.Backend.Put(ctx, key, r, size)
}

// bucketChunks returns the chunks every pack index in b lists.
func bucketChunks(t *testing.T, b Backend) map[string]bool {
	t.Helper()
	set, err := loadPacks(ctx, b, 4, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, entries := range set.packs {
		for _, e := range entries {
			out[e.ID] = true
		}
	}
	return out
}

// Two nodes on one bucket prefix: node A commits (first and diff snapshots,
// and again the very bytes of snapshots it deleted, which another node's
// collection may have removed meanwhile) and deletes old snapshots, while
// node B collects over and over and also commits and deletes its own.
// Afterwards every surviving snapshot opens and verifies on a third store
// that never saw them, and the chunks that only deleted snapshots had are gone.
func TestClusterCollectWhileCommitting(t *testing.T) {
	srv := s3test.Start(t)
	nodes := clusterStores(t, srv, 2, nil)
	a, b := nodes[0], nodes[1]
	want := map[string]map[string][]byte{}
	dead := map[string]bool{} // chunks of deleted throwaway snapshots
	var mu sync.Mutex
	keep := func(id string, files map[string][]byte) {
		mu.Lock()
		want[id] = files
		mu.Unlock()
	}
	stop := make(chan struct{})
	var rounds, busy, deleted int
	gcDone := make(chan struct{})
	go func() {
		defer close(gcDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, err := b.Collect(ctx, nil)
			switch {
			case errors.Is(err, ErrCollectBusy):
				busy++
			case err != nil:
				t.Errorf("node B: collect: %v", err)
				return
			default:
				rounds++
				deleted += n
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // node A
		defer wg.Done()
		base := memImage(512)
		parent := ""
		for i := 0; i < 8 && !t.Failed(); i++ {
			// A throwaway snapshot of new bytes, deleted at once...
			tw := map[string][]byte{"pages.img": memImage(256)}
			tid := fmt.Sprintf("a-tmp-%d", i)
			commit(t, a, tid, tw)
			if i%2 == 0 {
				if err := a.Delete(ctx, tid); err != nil {
					t.Error(err)
				}
				// ...and the same bytes again a little later, after B may
				// have collected them: A must not name chunks B deleted.
				time.Sleep(20 * time.Millisecond)
				rid := fmt.Sprintf("a-again-%d", i)
				commit(t, a, rid, tw)
				keep(rid, tw)
			} else {
				keep(tid, tw)
			}
			// A sandbox's chain of diff snapshots, each deleting its parent.
			img := mutate(base, 0.05, 4, uint64(i))
			id := fmt.Sprintf("a-chain-%d", i)
			files := map[string][]byte{"pages.img": img}
			stageAndCommit(t, a, id, files, func(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
				m.Parent = parent
				return a.Commit(ctx, id, m)
			})
			if parent != "" {
				if err := a.Delete(ctx, parent); err != nil {
					t.Error(err)
				}
				mu.Lock()
				delete(want, parent)
				mu.Unlock()
			}
			keep(id, files)
			parent, base = id, img
		}
	}()
	go func() { // node B's own snapshots
		defer wg.Done()
		for i := 0; i < 6 && !t.Failed(); i++ {
			files := map[string][]byte{"pages.img": memImage(256)}
			id := fmt.Sprintf("b-%d", i)
			commit(t, b, id, files)
			d, err := b.readDoc(ctx, id)
			if err != nil {
				t.Error(err)
				return
			}
			if i%2 == 0 {
				if err := b.Delete(ctx, id); err != nil {
					t.Error(err)
				}
				mu.Lock()
				for c := range chunkIDs(d) {
					dead[c] = true
				}
				mu.Unlock()
				continue
			}
			keep(id, files)
		}
	}()
	wg.Wait()
	close(stop)
	<-gcDone
	t.Logf("node B: %d collections (%d chunks deleted), %d skipped for a commit", rounds, deleted, busy)
	if rounds == 0 {
		t.Fatal("no collection ran during the commits")
	}
	if _, err := b.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}

	c, err := New(ctx, Config{Dir: t.TempDir(), Backend: b.b})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	live := map[string]bool{}
	for id, files := range want {
		mustOpen(t, c, id, files) // cold: every chunk fetched and checked
		if _, err := c.Verify(ctx, id); err != nil {
			t.Fatalf("verify %s: %v", id, err)
		}
		mustOpen(t, a, id, files)
		d, err := c.readDoc(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		for id := range chunkIDs(d) {
			live[id] = true
		}
	}
	ids, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != len(want) {
		t.Fatalf("the bucket lists %d snapshots, want %d: %v", len(ids), len(want), ids)
	}
	stored := bucketChunks(t, b.b)
	for id := range dead {
		if stored[id] && !live[id] {
			t.Fatalf("chunk %s of a deleted snapshot is still in the bucket", id)
		}
	}
	for id := range live {
		if !stored[id] {
			t.Fatalf("live chunk %s is in no pack", id)
		}
	}
	t.Logf("%d live snapshots, %d live chunks, %d chunks in the bucket, %d chunks of deleted snapshots gone",
		len(want), len(live), len(stored), len(dead))
}

// A collection skips its round, without waiting, while a commit on another
// node holds the lock; the commit completes, and the next round collects.
func TestClusterCollectSkipsDuringCommit(t *testing.T) {
	srv := s3test.Start(t)
	inPack := make(chan struct{})
	resume := make(chan struct{})
	var once sync.Once
	var blocking sync.Mutex
	block := false
	nodes := clusterStores(t, srv, 2, func(key string) error {
		blocking.Lock()
		on := block
		blocking.Unlock()
		if on && strings.HasPrefix(key, "packs/") {
			once.Do(func() { close(inPack); <-resume })
		}
		return nil
	})
	a, b := nodes[0], nodes[1]
	commit(t, a, "old", map[string][]byte{"pages.img": memImage(256)})
	d, _ := a.readDoc(ctx, "old")
	if err := a.Delete(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	blocking.Lock()
	block = true
	blocking.Unlock()
	files := map[string][]byte{"pages.img": memImage(256)}
	done := make(chan error, 1)
	go func() {
		dir, err := a.Stage(ctx, "new")
		if err == nil {
			err = writeFiles(dir, files)
		}
		if err == nil {
			_, err = a.Commit(ctx, "new", snapshot.Manifest{ID: "new", SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()})
		}
		done <- err
	}()
	<-inPack // A's commit is writing its first pack
	t0 := time.Now()
	n, err := b.Collect(ctx, nil)
	if !errors.Is(err, ErrCollectBusy) {
		t.Fatalf("collect during a commit on another node: %d, %v; want ErrCollectBusy", n, err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("the skipped collection took %v", d)
	}
	if !bucketChunks(t, b.b)[firstChunk(d)] {
		t.Fatal("the deleted snapshot's chunks went during the commit")
	}
	close(resume)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	n, err = b.Collect(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 || bucketChunks(t, b.b)[firstChunk(d)] {
		t.Fatalf("the collection after the commit deleted %d chunks; the deleted snapshot's are still there", n)
	}
	mustOpen(t, b, "new", files)
}

func firstChunk(d doc) string {
	for id := range chunkIDs(d) {
		return id
	}
	return ""
}

func writeFiles(dir string, files map[string][]byte) error {
	for n, b := range files {
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// A commit whose database session ends before its manifest is known safe
// (its shared lock gone: another node may have collected meanwhile) fails
// and leaves no manifest; the same commit tried again succeeds.
func TestClusterCommitLockLost(t *testing.T) {
	srv := s3test.Start(t)
	var url string
	var once sync.Once
	var killErr error
	nodes, u := clusterStoresURL(t, srv, 1, func(key string) error {
		if strings.HasPrefix(key, "manifests/") {
			once.Do(func() { killErr = endLockSessions(url) })
		}
		return nil
	})
	url = u
	a := nodes[0]
	files := map[string][]byte{"pages.img": memImage(256)}
	dir, err := a.Stage(ctx, "snap-1")
	if err != nil {
		t.Fatal(err)
	}
	if err := writeFiles(dir, files); err != nil {
		t.Fatal(err)
	}
	m := snapshot.Manifest{ID: "snap-1", SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()}
	_, err = a.Commit(ctx, "snap-1", m)
	if killErr != nil {
		t.Fatal(killErr)
	}
	if err == nil || !strings.Contains(err.Error(), "collection lock lost") {
		t.Fatalf("commit after its lock's session ended: %v, want the lock lost", err)
	}
	if ok, err := a.b.Exists(ctx, manifestKey("snap-1")); err != nil || ok {
		t.Fatalf("the manifest of the failed commit is in the bucket (%v, %v)", ok, err)
	}
	if _, err := a.Commit(ctx, "snap-1", m); err != nil {
		t.Fatalf("commit again: %v", err)
	}
	mustOpen(t, a, "snap-1", files)
}

// endLockSessions terminates the sessions holding a collection lock and
// waits until the database has released them.
func endLockSessions(url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	const held = `FROM pg_locks WHERE locktype = 'advisory' AND classid = 1952932656 AND objsubid = 2 AND granted`
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(pid) `+held); err != nil {
		return err
	}
	for deadline := time.Now().Add(5 * time.Second); ; {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) `+held).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d collection lock sessions still there", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An asynchronous snapshot waiting for its upload names chunks of its
// parent already in the bucket; its manifest is only in its node's outbox.
// Another node's collection after the parent is deleted must not remove
// them: it skips while the snapshot is pending, and collects once it is
// uploaded. The snapshot then opens on a store that never saw it.
func TestClusterCollectSparesPendingUploads(t *testing.T) {
	srv := s3test.Start(t)
	var down sync.Mutex
	failing := false
	nodes := clusterStores(t, srv, 2, func(key string) error {
		down.Lock()
		defer down.Unlock()
		if failing {
			return errors.New("test: node A cannot reach the bucket")
		}
		return nil
	})
	a, b := nodes[0], nodes[1]
	img := memImage(512)
	commit(t, a, "parent", map[string][]byte{"pages.img": img})
	// A's uploads fail until the gate opens; between two attempts A holds
	// no lock for an upload, only the one of its pending snapshots.
	setFailing := func(v bool) {
		down.Lock()
		failing = v
		down.Unlock()
	}
	setFailing(true)
	child := map[string][]byte{"pages.img": mutate(img, 0.02, 4, 7)}
	stageAndCommit(t, a, "child", child, func(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
		m.Parent = "parent"
		return a.CommitAsync(ctx, id, m)
	})
	if a.lastReused.Load() == 0 {
		t.Fatal("the child reused none of its parent's chunks")
	}
	if err := a.Delete(ctx, "parent"); err != nil {
		t.Fatal(err)
	}
	commit(t, b, "junk", map[string][]byte{"pages.img": memImage(256)})
	jd, _ := b.readDoc(ctx, "junk")
	if err := b.Delete(ctx, "junk"); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		if n, err := b.Collect(ctx, nil); !errors.Is(err, ErrCollectBusy) {
			t.Fatalf("collect while another node has a pending upload: %d, %v; want ErrCollectBusy", n, err)
		}
		time.Sleep(30 * time.Millisecond)
	}
	setFailing(false)
	a.UploadNow()
	waitDurable(t, a, "child")
	var n int
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		// The hold goes when the upload loop finds the outbox empty.
		if n, err = b.Collect(ctx, nil); !errors.Is(err, ErrCollectBusy) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("collect after the upload: %v", err)
	}
	if n == 0 || bucketChunks(t, b.b)[firstChunk(jd)] {
		t.Fatalf("the collection after the upload deleted %d chunks; a deleted snapshot's are still there", n)
	}
	c, err := New(ctx, Config{Dir: t.TempDir(), Backend: b.b})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	mustOpen(t, c, "child", child)
	t.Logf("%d chunks collected after the upload", n)
}

// LocalCollectLock: shared holds coexist, the exclusive try-lock fails at
// once while one exists, and a shared hold waits for an exclusive one (or
// gives up with its context).
func TestLocalCollectLock(t *testing.T) {
	var l LocalCollectLock
	r1, _, err := l.Shared(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r2, _, err := l.Shared(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok, _ := l.TryExclusive(ctx); ok {
		t.Fatal("exclusive granted while held shared")
	}
	r1()
	r2()
	rx, held, ok, _ := l.TryExclusive(ctx)
	if !ok || held(ctx) != nil {
		t.Fatal("exclusive refused with nothing held")
	}
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, _, err = l.Shared(wctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("shared during exclusive: %v, want the deadline", err)
	}
	rx()
	r, _, err := l.Shared(ctx) // the abandoned wait released what it got
	if err != nil {
		t.Fatal(err)
	}
	r()
	// The abandoned wait's read lock goes on its own goroutine, at once.
	for deadline := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
		if rx, _, ok, _ := l.TryExclusive(ctx); ok {
			rx()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("exclusive refused after every hold was released")
		}
	}
}
