package chunked

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// gatedReads is a filesystem backend whose reads of packs wait for a token
// from gate (or fail with fail's error when fail returns one).
type gatedReads struct {
	*FS
	gate chan struct{}
	fail func(off int64) error
	mu   sync.Mutex
	n    int // pack reads done
}

func (g *gatedReads) GetRangeInto(ctx context.Context, key string, off int64, buf []byte) error {
	if strings.HasPrefix(key, "packs/") {
		select {
		case <-g.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		if g.fail != nil {
			if err := g.fail(off); err != nil {
				return err
			}
		}
		g.mu.Lock()
		g.n++
		g.mu.Unlock()
	}
	return g.FS.GetRangeInto(ctx, key, off, buf)
}

// newGatedStore is a store on a filesystem backend whose pack reads pass
// until the test replaces g.gate (closed) with an open channel.
func newGatedStore(t *testing.T) (*Store, *FS, *gatedReads) {
	t.Helper()
	fsb, err := NewFS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedReads{FS: fsb, gate: make(chan struct{})}
	close(g.gate)
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: g})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, fsb, g
}

func needFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
}

// liveStream is the store's only live stream.
func liveStream(t *testing.T, s *Store) *stream {
	t.Helper()
	s.streams.mu.Lock()
	defer s.streams.mu.Unlock()
	if len(s.streams.live) != 1 {
		t.Fatalf("%d live streams, want 1", len(s.streams.live))
	}
	for st := range s.streams.live {
		return st
	}
	return nil
}

// waitUnmounted waits until the store serves no stream.
func waitUnmounted(t *testing.T, s *Store) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		s.streams.mu.Lock()
		n := len(s.streams.live)
		s.streams.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d streams still mounted", n)
		}
	}
}

// A streamed open serves the snapshot while it fetches it: a read of the
// memory file's last page, issued first, is answered with the right bytes
// after a few pack reads, while most of the file is still to come (its
// fetch moved to the front); every byte then reads as committed; once
// released and closed the mount goes and the fetched files are the opened
// copy. The pages read before Resumed are recorded, and a store on another
// host (a new directory on the same backend) fetches them right after the
// small files.
func TestStreamServesBeforeFetched(t *testing.T) {
	needFUSE(t)
	s, fsb, g := newGatedStore(t)
	img := memImage(32 << 20 / pageSize)
	small := []byte(strings.Repeat("kernel state ", 1000))
	commit(t, s, "snap-s", map[string][]byte{"pages.img": img, "checkpoint.img": small})
	dropLocal(t, s)
	s.docs.forget("snap-s")
	g.gate = make(chan struct{})

	o, err := s.OpenStream(ctx, "snap-s")
	if err != nil {
		t.Fatal(err)
	}
	if !o.Streaming {
		t.Fatal("a cold open did not stream")
	}
	st := liveStream(t, s)
	total := len(st.plan.fetches)
	if total < 12 {
		t.Fatalf("%d fetches: the test needs a file of many", total)
	}
	f, err := os.Open(filepath.Join(o.Dir, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	last := make([]byte, pageSize)
	off := int64(len(img) - pageSize)
	got := make(chan error, 1)
	go func() { _, err := f.ReadAt(last, off); got <- err }()
	tokens := 0
	var readErr error
feed:
	for {
		select {
		case readErr = <-got:
			break feed
		case g.gate <- struct{}{}:
			tokens++
		case <-time.After(10 * time.Second):
			t.Fatalf("the read of the last page did not return after %d pack reads", tokens)
		}
	}
	if readErr != nil || !bytes.Equal(last, img[off:]) {
		t.Fatalf("the last page read before its turn: err %v, equal %v", readErr, bytes.Equal(last, img[off:]))
	}
	if tokens > total/2 {
		t.Errorf("the last page took %d of %d pack reads: its fetch was not moved to the front", tokens, total)
	}
	o.Resumed()
	close(g.gate)
	whole, err := os.ReadFile(filepath.Join(o.Dir, "pages.img"))
	if err != nil || !bytes.Equal(whole, img) {
		t.Fatalf("pages.img through the stream: err %v, equal %v", err, bytes.Equal(whole, img))
	}
	if b, err := os.ReadFile(filepath.Join(o.Dir, "checkpoint.img")); err != nil || !bytes.Equal(b, small) {
		t.Fatalf("checkpoint.img through the stream: %v", err)
	}
	if err := os.WriteFile(filepath.Join(o.Dir, "pages.img"), []byte("x"), 0o600); err == nil {
		t.Fatal("a served file was writable")
	}
	o.Release()
	time.Sleep(50 * time.Millisecond)
	s.streams.mu.Lock()
	mounted := len(s.streams.live)
	s.streams.mu.Unlock()
	if mounted != 1 {
		t.Fatal("the mount went while a descriptor of it was open")
	}
	f.Close()
	waitUnmounted(t, s)
	if _, err := os.Stat(o.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the mount point stayed: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(s.opened("snap-s"), "pages.img")); err != nil || !bytes.Equal(b, img) {
		t.Fatalf("the opened copy after the stream: %v", err)
	}
	// A warm open now: no stream.
	if w, err := s.OpenStream(ctx, "snap-s"); err != nil || w.Streaming || w.Dir != s.opened("snap-s") {
		t.Fatalf("warm OpenStream: %+v, %v", w, err)
	} else {
		w.Release()
	}

	// The recorded working set starts with the last page's chunk.
	var ws workingSet
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		b, err := getAll(ctx, fsb, workingSetKey("sbx-t"))
		if err == nil {
			if err := json.Unmarshal(b, &ws); err != nil {
				t.Fatal(err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no working set recorded: %v", err)
		}
	}
	d, _ := s.docs.get("snap-s")
	refs := d.Files[biggest(d)].Chunks
	if len(ws.Chunks) == 0 || ws.Chunks[0] != refs[len(refs)-1].ID || ws.File != "pages.img" || ws.Snapshot != "snap-s" {
		t.Fatalf("working set %s %d chunks, first %v; want the last chunk first", ws.File, len(ws.Chunks), ws.Chunks[:min(1, len(ws.Chunks))])
	}

	// Another host: the hint puts the last page's fetch right after the small file's.
	s2, err := New(ctx, Config{Dir: t.TempDir(), Backend: fsb})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	o2, err := s2.OpenStream(ctx, "snap-s")
	if err != nil || !o2.Streaming {
		t.Fatalf("OpenStream on a second store: %+v %v", o2, err)
	}
	st2 := liveStream(t, s2)
	if st2.hinted == 0 {
		t.Fatal("the second host used no working set")
	}
	lastFetch := st2.plan.of[st2.big][len(refs)-1]
	nSmall := 0
	for _, ft := range st2.plan.fetches {
		if ft.file != st2.big {
			nSmall++
		}
	}
	if st2.order[nSmall] != lastFetch {
		t.Fatalf("fetch order %v: the hinted fetch %d is not right after the %d small ones", st2.order[:nSmall+1], lastFetch, nSmall)
	}
	if b, err := os.ReadFile(filepath.Join(o2.Dir, "pages.img")); err != nil || !bytes.Equal(b, img) {
		t.Fatalf("pages.img on the second host: %v", err)
	}
	o2.Release()
	waitUnmounted(t, s2)
}

// A fetch that fails fails the reads waiting on it (EIO), never returns
// zeros; the stream then leaves no opened copy and no mount behind.
func TestStreamFailedFetchIsEIO(t *testing.T) {
	needFUSE(t)
	s, _, g := newGatedStore(t)
	img := memImage(16 << 20 / pageSize)
	commit(t, s, "snap-f", map[string][]byte{"pages.img": img, "checkpoint.img": []byte("state")})
	dropLocal(t, s)
	g.fail = func(off int64) error {
		if off > 0 {
			return errors.New("backend: connection reset")
		}
		return nil
	}
	o, err := s.OpenStream(ctx, "snap-f")
	if err != nil || !o.Streaming {
		t.Fatalf("OpenStream: %+v %v", o, err)
	}
	_, err = os.ReadFile(filepath.Join(o.Dir, "pages.img"))
	if err == nil {
		t.Fatal("a read of bytes that could not be fetched succeeded")
	}
	o.Release()
	waitUnmounted(t, s)
	if _, err := os.Stat(s.opened("snap-f")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a failed stream left an opened copy: %v", err)
	}
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		t.Errorf("left in open/: %s", e.Name())
	}
	// The store still opens it when the backend answers again.
	g.fail = nil
	mustOpen(t, s, "snap-f", map[string][]byte{"pages.img": img})
	var _ snapshot.Streamer = s
}

// A snapshot deleted while it streams still serves its restore to the end,
// and leaves no opened copy behind.
func TestStreamDeletedWhileFetching(t *testing.T) {
	needFUSE(t)
	s, _, g := newGatedStore(t)
	img := memImage(8 << 20 / pageSize)
	commit(t, s, "snap-d", map[string][]byte{"pages.img": img})
	dropLocal(t, s)
	g.gate = make(chan struct{})
	o, err := s.OpenStream(ctx, "snap-d")
	if err != nil || !o.Streaming {
		t.Fatalf("OpenStream: %+v %v", o, err)
	}
	f, err := os.Open(filepath.Join(o.Dir, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := s.Delete(ctx, "snap-d"); err != nil {
		t.Fatal(err)
	}
	close(g.gate)
	o.Release()
	b := make([]byte, len(img))
	if _, err := f.ReadAt(b, 0); err != nil || !bytes.Equal(b, img) {
		t.Fatalf("reading a deleted snapshot's stream: %v", err)
	}
	f.Close()
	waitUnmounted(t, s)
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		t.Errorf("left in open/ after a deleted snapshot's stream: %s", e.Name())
	}
}

// The next snapshot of a sandbox (a diff hibernate after a streamed resume)
// streams with the working set recorded at that resume: a read far ahead of
// the fetches in file order is recorded, the loader-like sequential reads
// are not, and the next snapshot's stream fetches the recorded chunks it
// still has right after the small files.
func TestStreamNextSnapshotUsesWorkingSet(t *testing.T) {
	needFUSE(t)
	s, fsb, g := newGatedStore(t)
	img := memImage(64 << 20 / pageSize)
	commit(t, s, "snap-p", map[string][]byte{"pages.img": img, "checkpoint.img": []byte("state")})
	dropLocal(t, s)
	g.gate = make(chan struct{})
	o, err := s.OpenStream(ctx, "snap-p")
	if err != nil || !o.Streaming {
		t.Fatalf("OpenStream: %+v %v", o, err)
	}
	f, err := os.Open(filepath.Join(o.Dir, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	const far = 48 << 20
	got := make(chan error, 1)
	b := make([]byte, 64<<10)
	go func() { _, err := f.ReadAt(b, far); got <- err }()
	for waiting := true; waiting; {
		select {
		case err := <-got:
			if err != nil || !bytes.Equal(b, img[far:far+len(b)]) {
				t.Fatalf("read: %v", err)
			}
			waiting = false
		case g.gate <- struct{}{}:
		}
	}
	close(g.gate)
	if _, err := f.ReadAt(b, 0); err != nil { // the start: sequential, not recorded
		t.Fatal(err)
	}
	o.Resumed()
	f.Close()
	o.Release()
	waitUnmounted(t, s)
	var ws workingSet
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		raw, err := getAll(ctx, fsb, workingSetKey("sbx-t"))
		if err == nil {
			if err := json.Unmarshal(raw, &ws); err != nil {
				t.Fatal(err)
			}
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("no working set for sbx-t: %v", err)
		}
	}
	d, _ := s.docs.get("snap-p")
	refs := d.Files[biggest(d)].Chunks
	if len(ws.Chunks) == 0 || ws.Chunks[0] == refs[0].ID {
		t.Fatalf("working set: %d chunks; want the far read's chunks and not the first chunk", len(ws.Chunks))
	}
	for _, c := range ws.Chunks {
		if c == refs[0].ID {
			t.Fatal("the sequential read of the file's start was recorded as the working set")
		}
	}
	child := mutate(img, 0.05, 8, 7)
	commitChild(t, s, "snap-c", "snap-p", map[string][]byte{"pages.img": child, "checkpoint.img": []byte("state 2")})
	if err := s.Delete(ctx, "snap-p"); err != nil { // as after a hibernate: the record is the sandbox's
		t.Fatal(err)
	}
	dropLocal(t, s)
	o2, err := s.OpenStream(ctx, "snap-c")
	if err != nil || !o2.Streaming {
		t.Fatalf("OpenStream of the child: %+v %v", o2, err)
	}
	st := liveStream(t, s)
	if st.hinted == 0 {
		t.Fatal("the next snapshot's stream used none of the recorded working set")
	}
	t.Logf("working set %d chunks; %d of them hinted the next snapshot's stream", len(ws.Chunks), st.hinted)
	if got, err := os.ReadFile(filepath.Join(o2.Dir, "pages.img")); err != nil || !bytes.Equal(got, child) {
		t.Fatalf("child pages.img: %v", err)
	}
	o2.Release()
	waitUnmounted(t, s)
	// Once the sandbox has no snapshot, a collection removes its record.
	if err := s.Delete(ctx, "snap-c"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Collect(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := getAll(ctx, fsb, workingSetKey("sbx-t")); !isMissing(err) {
		t.Fatalf("the working set of a sandbox with no snapshot survived a collection: %v", err)
	}
}
