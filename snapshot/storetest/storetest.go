// Package storetest is the conformance suite every snapshot.Store implementation
// runs: commit and open, corruption detection naming the file, crash debris
// removed by Recover, delete, and concurrent use on different ids.
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Options adapts the suite to a store whose system of record is not the
// directory Open returns (a chunked store keeps chunks and rebuilds that
// directory from them, so damaging the directory alone is repaired, not an error).
type Options struct {
	// Corrupt flips a byte of the stored content of file in committed snapshot id.
	// Default: flip a byte in the middle of the file in the directory Open returned.
	Corrupt func(t *testing.T, s snapshot.Store, id, file string)
	// Remove deletes stored content of file in committed snapshot id.
	// Default: remove the file from the directory Open returned.
	Remove func(t *testing.T, s snapshot.Store, id, file string)
	// Async commits every snapshot with CommitAsync (the store must be a
	// snapshot.AsyncStore) and waits until Durable reports true, so every case
	// runs on snapshots that went through the background upload.
	Async bool
	// Settle, when set, waits until what a store does after a commit
	// returned is done (snapshot/chunked's deferred first commits store
	// their chunks in the background): Usage calls it after each commit, so
	// its figures are the settled ones. The other cases run on snapshots as
	// Commit left them.
	Settle func(t *testing.T, s snapshot.Store)
}

// Run runs the suite against stores made by newStore (a fresh, empty store per call).
func Run(t *testing.T, newStore func(t *testing.T) snapshot.Store) {
	RunWith(t, newStore, Options{})
}

// RunWith is Run with store-specific ways to damage a snapshot.
func RunWith(t *testing.T, newStore func(t *testing.T) snapshot.Store, o Options) {
	ctx := context.Background()
	if o.Corrupt == nil {
		o.Corrupt = func(t *testing.T, s snapshot.Store, id, file string) {
			dir, _, err := s.Open(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(dir, file)
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 0x01
			os.WriteFile(p, b, 0o600)
		}
	}
	if o.Remove == nil {
		o.Remove = func(t *testing.T, s snapshot.Store, id, file string) {
			dir, _, _ := s.Open(ctx, id)
			os.Remove(filepath.Join(dir, file))
		}
	}
	write := func(t *testing.T, s snapshot.Store, id string, files map[string][]byte) snapshot.Manifest {
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
		man := snapshot.Manifest{ID: id, SandboxID: "sbx-test", Engine: "test", CreatedAt: time.Now()}
		if !o.Async {
			m, err := s.Commit(ctx, id, man)
			if err != nil {
				t.Fatal(err)
			}
			return m
		}
		as := s.(snapshot.AsyncStore)
		m, err := as.CommitAsync(ctx, id, man)
		if err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			ok, err := as.Durable(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("snapshot %s: not durable 60 s after CommitAsync", id)
			}
		}
		return m
	}
	files := func() map[string][]byte {
		big := make([]byte, 3<<20+17)
		rand.Read(big)
		return map[string][]byte{"checkpoint.img": []byte("kernel state"), "pages.img": big}
	}

	t.Run("CommitOpen", func(t *testing.T) {
		s := newStore(t)
		f := files()
		m := write(t, s, "snap-a", f)
		if m.Bytes != int64(len(f["checkpoint.img"])+len(f["pages.img"])) || len(m.Files) != 2 {
			t.Fatalf("manifest sizes: %+v", m)
		}
		dir, m2, err := s.Open(ctx, "snap-a")
		if err != nil {
			t.Fatal(err)
		}
		if m2.Bytes != m.Bytes {
			t.Fatalf("manifest differs after open")
		}
		for n, want := range f {
			got, err := os.ReadFile(filepath.Join(dir, n))
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("file %s differs after open (%v)", n, err)
			}
		}
		ids, err := s.List(ctx)
		if err != nil || len(ids) != 1 || ids[0] != "snap-a" {
			t.Fatalf("list = %v, %v", ids, err)
		}
		if _, err := s.Stage(ctx, "snap-a"); err == nil {
			t.Fatal("staging a committed id succeeded")
		}
	})

	t.Run("Usage", func(t *testing.T) {
		s := newStore(t)
		ur, ok := s.(snapshot.UsageReporter)
		if !ok {
			t.Skip("the store does not report its usage")
		}
		usage := func() snapshot.Usage {
			t.Helper()
			u, err := ur.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return u
		}
		if u := usage(); u.StoredBytes != 0 || u.ChunkBytes != 0 || u.PendingUploadBytes != 0 {
			t.Fatalf("empty store: %+v", u)
		}
		f := files() // random bytes: they do not compress
		settle := func() {
			if o.Settle != nil {
				o.Settle(t, s)
			}
		}
		m := write(t, s, "snap-u1", f)
		settle()
		u1 := usage()
		if u1.StoredBytes < m.Bytes*99/100 || u1.StoredBytes > m.Bytes+64<<10 {
			t.Errorf("one snapshot of %d incompressible bytes: stored %d", m.Bytes, u1.StoredBytes)
		}
		if u1.LocalBytes < 0 || u1.ChunkBytes > u1.StoredBytes || (!o.Async && u1.PendingUploadBytes != 0) {
			t.Errorf("one synchronous snapshot: %+v", u1)
		}
		write(t, s, "snap-u2", f) // the same bytes again
		settle()
		u2 := usage()
		switch {
		case u1.Chunks > 0 && u2.StoredBytes > u1.StoredBytes+u1.StoredBytes/10:
			t.Errorf("a deduplicating store grew from %d to %d bytes for a second copy of the same files", u1.StoredBytes, u2.StoredBytes)
		case u1.Chunks == 0 && u2.StoredBytes < 2*m.Bytes:
			t.Errorf("two plain copies of %d bytes: stored %d", m.Bytes, u2.StoredBytes)
		}
	})

	t.Run("FlippedByteNamed", func(t *testing.T) {
		s := newStore(t)
		write(t, s, "snap-b", files())
		if _, _, err := s.Open(ctx, "snap-b"); err != nil {
			t.Fatal(err)
		}
		o.Corrupt(t, s, "snap-b", "pages.img")
		_, _, err := s.Open(ctx, "snap-b")
		var ce *snapshot.CorruptError
		if !errors.As(err, &ce) || ce.Snapshot != "snap-b" || ce.File != "pages.img" {
			t.Fatalf("open of corrupt snapshot: %v", err)
		}
	})

	t.Run("MissingFileNamed", func(t *testing.T) {
		s := newStore(t)
		write(t, s, "snap-c", files())
		o.Remove(t, s, "snap-c", "checkpoint.img")
		_, _, err := s.Open(ctx, "snap-c")
		var ce *snapshot.CorruptError
		if !errors.As(err, &ce) || ce.File != "checkpoint.img" {
			t.Fatalf("open with missing file: %v", err)
		}
	})

	t.Run("UncommittedInvisible", func(t *testing.T) {
		s := newStore(t)
		dir, err := s.Stage(ctx, "snap-d")
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, "pages.img"), []byte("half"), 0o600)
		if _, _, err := s.Open(ctx, "snap-d"); !errors.Is(err, snapshot.ErrNotFound) {
			t.Fatalf("open of staged snapshot: %v", err)
		}
		if err := s.Recover(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Stage(ctx, "snap-d"); err != nil {
			t.Fatalf("stage after recover: %v", err)
		}
		if err := s.Abort(ctx, "snap-d"); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("Delete", func(t *testing.T) {
		s := newStore(t)
		write(t, s, "snap-e", files())
		if err := s.Delete(ctx, "snap-e"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.Open(ctx, "snap-e"); !errors.Is(err, snapshot.ErrNotFound) {
			t.Fatalf("open after delete: %v", err)
		}
		if err := s.Delete(ctx, "snap-e"); err != nil {
			t.Fatalf("second delete: %v", err)
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		s := newStore(t)
		for _, id := range []string{"", "../x", "a/b", ".staging"} {
			if _, err := s.Stage(ctx, id); err == nil {
				t.Errorf("stage %q succeeded", id)
			}
		}
		if _, err := s.Commit(ctx, "snap-none", snapshot.Manifest{ID: "snap-none"}); err == nil {
			t.Error("commit of unstaged id succeeded")
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		s := newStore(t)
		var wg sync.WaitGroup
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				id := fmt.Sprintf("snap-p%d", i)
				write(t, s, id, files())
				if _, _, err := s.Open(ctx, id); err != nil {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
		ids, _ := s.List(ctx)
		if len(ids) != 8 {
			t.Fatalf("list after concurrent commits: %v", ids)
		}
	})
}
