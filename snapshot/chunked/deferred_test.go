package chunked

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/storetest"
)

// waitDeferred waits until s has no deferred first commit left.
func waitDeferred(s *Store) {
	for _, id := range s.deferredIDs() {
		if dc, ok := s.deferredOf(id); ok {
			<-dc.done
		}
	}
}

func newDeferredStore(t *testing.T, dir string) *Store {
	t.Helper()
	quickDeferred(t)
	s, err := New(ctx, Config{Dir: dir, DeferFirstCommits: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// quickDeferred starts deferred chunk commits at once for the rest of test t.
func quickDeferred(t *testing.T) {
	old := deferredDelay
	deferredDelay = 0
	t.Cleanup(func() { deferredDelay = old })
}

func TestConformanceFSDeferred(t *testing.T) {
	settle := func(t *testing.T, st snapshot.Store) { waitDeferred(st.(*Store)) }
	settled := func(f func(t *testing.T, st snapshot.Store, id, file string)) func(t *testing.T, st snapshot.Store, id, file string) {
		return func(t *testing.T, st snapshot.Store, id, file string) {
			settle(t, st)
			f(t, st, id, file)
		}
	}
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newDeferredStore(t, t.TempDir()) },
		storetest.Options{Corrupt: settled(damage(false)), Remove: settled(damage(true)), Settle: settle})
}

// A deferred first commit answers with a provisional manifest and a snapshot
// that lists and opens at once (its copy checked by block sums); its chunks
// follow in the background, OnCommitted reports the final manifest, and a
// diff commit on it waits for them and matches against them.
func TestDeferredFirstCommit(t *testing.T) {
	s := newDeferredStore(t, t.TempDir())
	var mu sync.Mutex
	var committed []snapshot.Manifest
	s.OnCommitted(func(m snapshot.Manifest) {
		mu.Lock()
		committed = append(committed, m)
		mu.Unlock()
	})
	img := memImage(4096) // 16 MiB
	// Hold the chunk commit until the pending state is checked.
	s.deferred.sem <- struct{}{}
	m := commit(t, s, "snap-d", map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel")})
	if m.Chunks != 0 || m.StoredBytes != m.Bytes || m.Bytes != int64(len(img))+6 || len(m.Files) != 2 || len(m.Files[1].BlockXXH3) != 1 {
		t.Fatalf("provisional manifest: %+v", m)
	}
	if _, err := os.Stat(s.pendingPath("snap-d")); err != nil {
		t.Fatalf("no pending manifest on disk: %v", err)
	}
	if ids, err := s.List(ctx); err != nil || len(ids) != 1 || ids[0] != "snap-d" {
		t.Fatalf("list = %v, %v", ids, err)
	}
	if _, err := s.Stage(ctx, "snap-d"); err == nil {
		t.Fatal("staging a pending snapshot's id succeeded")
	}
	mustOpen(t, s, "snap-d", map[string][]byte{"pages.img": img})
	s.Release("snap-d")
	if u, err := s.Usage(ctx); err != nil || u.StoredBytes != m.Bytes || u.Chunks != 0 {
		t.Fatalf("usage while pending: %+v, %v", u, err)
	}
	// A diff commit on the pending parent waits for its chunks.
	child := mutate(img, 0.01, 8, 1)
	childDone := make(chan snapshot.Manifest, 1)
	go func() {
		cm, _ := commitChild(t, s, "snap-e", "snap-d", map[string][]byte{"pages.img": child, "checkpoint.img": []byte("kernel")})
		childDone <- cm
	}()
	select {
	case <-childDone:
		t.Fatal("a diff commit on a pending parent did not wait for its chunks")
	case <-time.After(200 * time.Millisecond):
	}
	<-s.deferred.sem // let the chunk commit run
	cm := <-childDone
	if s.lastReused.Load() == 0 {
		t.Error("the diff commit matched no chunk of its deferred parent")
	}
	if cm.Chunks == 0 || cm.Parent != "snap-d" {
		t.Fatalf("child manifest: %+v", cm)
	}
	waitDeferred(s)
	if _, err := os.Stat(s.pendingPath("snap-d")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("pending manifest left after the chunk commit: %v", err)
	}
	final, err := s.Manifest(ctx, "snap-d")
	if err != nil || final.Chunks == 0 || final.Files[0].SHA256 == "" || final.Bytes != m.Bytes {
		t.Fatalf("final manifest: %+v, %v", final, err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		n := len(committed)
		mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("OnCommitted called %d times, want 1", n)
		}
	}
	if committed[0].ID != "snap-d" || committed[0].StoredBytes != final.StoredBytes {
		t.Fatalf("OnCommitted with %+v", committed[0])
	}
	// From the chunks alone (opened copy gone), both snapshots are whole.
	dropLocal(t, s)
	mustOpen(t, s, "snap-d", map[string][]byte{"pages.img": img})
	mustOpen(t, s, "snap-e", map[string][]byte{"pages.img": child})
}

// A store closed (or crashed) before a deferred commit's chunks were stored
// stores them at the next start; the snapshot opens throughout.
func TestDeferredCommitResumedAfterRestart(t *testing.T) {
	quickDeferred(t)
	dir := t.TempDir()
	s, err := New(ctx, Config{Dir: dir, DeferFirstCommits: true})
	if err != nil {
		t.Fatal(err)
	}
	s.deferred.sem <- struct{}{} // the chunk commit never starts in this process
	img := memImage(2048)
	commit(t, s, "snap-r", map[string][]byte{"pages.img": img})
	s.Close() // cancels the chunk commit waiting for the semaphore
	if _, err := os.Stat(filepath.Join(dir, pendingDir, "snap-r.json")); err != nil {
		t.Fatalf("pending manifest gone after Close: %v", err)
	}
	s2 := newDeferredStore(t, dir)
	if err := s2.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	mustOpen(t, s2, "snap-r", map[string][]byte{"pages.img": img})
	s2.Release("snap-r")
	waitDeferred(s2)
	if m, err := s2.Manifest(ctx, "snap-r"); err != nil || m.Chunks == 0 {
		t.Fatalf("after the restart's chunk commit: %+v, %v", m, err)
	}
	dropLocal(t, s2)
	mustOpen(t, s2, "snap-r", map[string][]byte{"pages.img": img})
}

// Delete of a pending snapshot cancels its chunk commit and leaves nothing;
// a damaged copy of a pending snapshot fails Open as corrupt (there are no
// chunks to rebuild it from).
func TestDeferredDeleteAndDamage(t *testing.T) {
	s := newDeferredStore(t, t.TempDir())
	s.deferred.sem <- struct{}{}
	img := memImage(2048)
	commit(t, s, "snap-x", map[string][]byte{"pages.img": img})
	commit(t, s, "snap-y", map[string][]byte{"pages.img": img})
	if err := s.Delete(ctx, "snap-x"); err != nil {
		t.Fatal(err)
	}
	if ids, _ := s.List(ctx); len(ids) != 1 || ids[0] != "snap-y" {
		t.Fatalf("list after delete = %v", ids)
	}
	for _, p := range []string{s.pendingPath("snap-x"), s.opened("snap-x")} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s left after delete: %v", p, err)
		}
	}
	f, err := os.OpenFile(filepath.Join(s.opened("snap-y"), "pages.img"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{img[100] ^ 1}, 100); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var ce *snapshot.CorruptError
	if _, _, err := s.Open(ctx, "snap-y"); !errors.As(err, &ce) || ce.File != "pages.img" {
		t.Fatalf("open of a damaged pending copy: %v", err)
	}
	if _, err := s.Verify(ctx, "snap-y"); !errors.As(err, &ce) {
		t.Fatalf("verify of a damaged pending copy: %v", err)
	}
	<-s.deferred.sem
}

// A chunk commit waits deferredDelay after its acknowledgement, unless a diff
// commit on its snapshot needs it: then it starts at once.
func TestDeferredDelayHurried(t *testing.T) {
	s := newDeferredStore(t, t.TempDir())
	deferredDelay = time.Hour
	img := memImage(1024)
	commit(t, s, "snap-h", map[string][]byte{"pages.img": img})
	time.Sleep(100 * time.Millisecond)
	if !s.isDeferred("snap-h") {
		t.Fatal("chunks stored before the delay")
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		commitChild(t, s, "snap-h2", "snap-h", map[string][]byte{"pages.img": mutate(img, 0.01, 8, 2)})
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a diff commit on a delayed pending parent did not end within 30 s")
	}
	if s.isDeferred("snap-h") || s.lastReused.Load() == 0 {
		t.Fatalf("parent pending %v, chunks matched %d", s.isDeferred("snap-h"), s.lastReused.Load())
	}
}
