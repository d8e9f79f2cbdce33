package chunked

import (
	"context"
	"errors"
	"fmt"
	"path"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// packBytes sums the sizes of the pack objects in b.
func packBytes(t *testing.T, b Backend) int64 {
	t.Helper()
	objs, err := b.List(ctx, "packs/")
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, o := range objs {
		n += o.Size
	}
	return n
}

// liveBytes sums the stored sizes of the distinct chunks the snapshots ids
// of s name.
func liveBytes(t *testing.T, s *Store, ids ...string) int64 {
	t.Helper()
	seen := map[string]bool{}
	var n int64
	for _, id := range ids {
		d, err := s.readDoc(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		for _, fc := range d.Files {
			for _, c := range fc.Chunks {
				if c.ID != "" && !seen[c.ID] {
					seen[c.ID] = true
					n += c.Stored
				}
			}
		}
	}
	return n
}

// On a bucket prefix shared by several nodes, a pack most of whose bytes no
// snapshot uses any more is rewritten with its live chunks, as on one node.
// Node A commits S1 (shared bytes X and bytes Y, one pack) and S2 (X again,
// deduplicated, and new bytes Z); nodes B and D open both, so their indexes
// place X and Y in S1's pack. A deletes S1 and collects: S1's pack is
// rewritten with X only. D then commits Y again (stored anew: Y's chunks are
// gone, and D must not name them) and X again (deduplicated against the moved
// chunks); B resumes S2 from the bucket alone (its index still placed X in
// the old pack); a node that never saw any of it opens all three.
func TestClusterRepackPartlyDeadPacks(t *testing.T) {
	srv := s3test.Start(t)
	nodes := clusterStores(t, srv, 4, nil)
	a, b, c, d := nodes[0], nodes[1], nodes[2], nodes[3]
	x, y := memImage(128), memImage(512)
	s1 := map[string][]byte{"shared.img": x, "pages.img": y}
	s2 := map[string][]byte{"shared.img": x, "pages.img": memImage(128)}
	commit(t, a, "s1", s1)
	if m := commit(t, a, "s2", s2); m.NewBytes > int64(len(x)) {
		t.Fatalf("S2 stored %d new bytes: X was not deduplicated", m.NewBytes)
	}
	for _, st := range []*Store{b, d} {
		mustOpen(t, st, "s1", s1)
		mustOpen(t, st, "s2", s2)
	}
	d1, err := a.readDoc(ctx, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Delete(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	before, live := packBytes(t, a.b), liveBytes(t, a, "s2")
	n, err := a.Collect(ctx, nil)
	if err != nil || n == 0 {
		t.Fatalf("collect on A: %d chunks, %v", n, err)
	}
	after := packBytes(t, a.b)
	t.Logf("pack bytes %d before, %d after the collection, for %d live bytes", before, after, live)
	if float64(after) > 1.05*float64(live) {
		t.Fatalf("%d pack bytes for %d live bytes (%d before): the partly dead pack was not rewritten", after, live, before)
	}
	stored := bucketChunks(t, a.b)
	for _, fc := range d1.Files {
		if fc.Name != "pages.img" {
			continue
		}
		for _, r := range fc.Chunks {
			if r.ID != "" && stored[r.ID] {
				t.Fatalf("chunk %s of Y (only S1's) is still in the bucket", r.ID)
			}
		}
	}

	s4 := map[string][]byte{"pages.img": y}
	if m := commit(t, d, "s4", s4); m.NewBytes < int64(len(y))/2 {
		t.Fatalf("D's commit of Y again stored %d new bytes: it named chunks the collection removed", m.NewBytes)
	}
	s3 := map[string][]byte{"shared.img": x, "pages.img": memImage(32)}
	if m := commit(t, d, "s3", s3); m.NewBytes > int64(len(x))/2 {
		t.Fatalf("D's commit of X again stored %d new bytes: not deduplicated against the moved chunks", m.NewBytes)
	}
	dropLocal(t, b)
	mustOpen(t, b, "s2", s2)
	if _, err := b.Verify(ctx, "s2"); err != nil {
		t.Fatalf("verify S2 on B: %v", err)
	}
	for id, want := range map[string]map[string][]byte{"s2": s2, "s3": s3, "s4": s4} {
		mustOpen(t, c, id, want)
		if _, err := c.Verify(ctx, id); err != nil {
			t.Fatalf("verify %s on C: %v", id, err)
		}
	}
	dropLocal(t, a)
	mustOpen(t, a, "s3", s3)
	mustOpen(t, a, "s4", s4)
}

// A collection that rewrites packs on a shared prefix, with other nodes
// opening and committing meanwhile. Node A rewrites two partly dead packs
// (P and Q, each holding shared bytes that snapshot "keep" still names). Once
// the first one's new pack is written and before the old one goes
// (testBeforePackDelete): node B resumes "keep" from the bucket and starts a
// commit naming the shared bytes and bytes only the deleted snapshots had,
// which waits for the collection's lock; node D refreshes its index for an
// open (it now holds the first new pack and the generation, but places the
// second pack's chunks in the old pack, deleted later in the same round).
// Afterwards D resumes "keep": a chunk is missing where its index placed it,
// and it re-lists and reads from the new pack. B's commit, done after the
// collection, deduplicates against the moved chunks and stores the removed
// ones again; a node that never saw any of it opens everything.
func TestClusterRepackWhileOpeningAndCommitting(t *testing.T) {
	srv := s3test.Start(t)
	nodes := clusterStores(t, srv, 4, nil)
	a, b, c, d := nodes[0], nodes[1], nodes[2], nodes[3]
	x1, y1, x2, y2 := memImage(128), memImage(512), memImage(128), memImage(512)
	commit(t, a, "s1", map[string][]byte{"shared.img": x1, "pages.img": y1})
	commit(t, a, "s2", map[string][]byte{"shared.img": x2, "pages.img": y2})
	keep := map[string][]byte{"x1.img": x1, "x2.img": x2, "pages.img": memImage(64)}
	commit(t, a, "keep", keep)
	for _, st := range []*Store{b, d} {
		mustOpen(t, st, "keep", keep)
	}
	for _, id := range []string{"s1", "s2"} {
		if err := a.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	bFiles := map[string][]byte{"x1.img": x1, "x2.img": x2, "y1.img": y1}
	dir, err := b.Stage(ctx, "b-new")
	if err != nil {
		t.Fatal(err)
	}
	if err := writeFiles(dir, bFiles); err != nil {
		t.Fatal(err)
	}
	type result struct {
		m   snapshot.Manifest
		err error
	}
	done := make(chan result, 1)
	var hooked []string
	testBeforePackDelete = func(st *Store, pid string) {
		if st != a {
			return
		}
		hooked = append(hooked, pid)
		if len(hooked) > 1 {
			return
		}
		dropLocal(t, b)
		mustOpen(t, b, "keep", keep)
		d.freshForOpen(ctx)
		go func() {
			m, err := b.Commit(ctx, "b-new", snapshot.Manifest{ID: "b-new", SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()})
			done <- result{m, err}
		}()
	}
	n, err := a.Collect(ctx, nil)
	testBeforePackDelete = nil
	if err != nil || len(hooked) != 2 {
		t.Fatalf("collect on A: %d chunks, %v; %d packs rewritten (%v), want 2", n, err, len(hooked), hooked)
	}
	if live := liveBytes(t, a, "keep"); float64(packBytes(t, a.b)) > 1.05*float64(live) {
		t.Fatalf("%d pack bytes for %d live bytes after the collection", packBytes(t, a.b), live)
	}

	// D's index places a chunk of "keep" in a pack that is gone, and D saw
	// the round's generation: nothing makes it re-list before it reads.
	inBucket := map[string]bool{}
	objs, err := a.b.List(ctx, "packs/")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		inBucket[path.Base(o.Key)] = true
	}
	dk, err := d.readDoc(ctx, "keep")
	if err != nil {
		t.Fatal(err)
	}
	stale := 0
	d.idx.mu.Lock()
	for id := range chunkIDs(dk) {
		if l, ok := d.idx.known.locs[id]; ok && l.Pack != "" && !inBucket[l.Pack] {
			stale++
		}
	}
	d.idx.mu.Unlock()
	if stale == 0 {
		t.Fatal("D's index places no chunk of keep in a deleted pack: the test does not reach the re-list after a missing chunk")
	}
	dropLocal(t, d)
	mustOpen(t, d, "keep", keep)

	var r result
	select {
	case r = <-done:
	case <-time.After(time.Minute):
		t.Fatal("B's commit did not finish after the collection")
	}
	if r.err != nil {
		t.Fatalf("B's commit: %v", r.err)
	}
	t.Logf("B's commit during the collection: %d new of %d logical bytes; D re-read %d chunks", r.m.NewBytes, r.m.LogicalBytes, stale)
	if r.m.NewBytes > int64(len(y1))*3/2 || r.m.NewBytes < int64(len(y1))/2 {
		t.Fatalf("B's commit stored %d new bytes; want about Y1's %d (X1 and X2 deduplicated, Y1 stored again)", r.m.NewBytes, len(y1))
	}
	mustOpen(t, c, "b-new", bFiles)
	mustOpen(t, c, "keep", keep)
	if _, err := c.Verify(ctx, "b-new"); err != nil {
		t.Fatal(err)
	}
}

// watchReads is a Backend whose ranged reads first call before (its error
// fails the read) and whose listings call listed when they return.
type watchReads struct {
	Backend
	before func(ctx context.Context, key string) error
	listed func(prefix string)
}

func (w *watchReads) GetRange(ctx context.Context, key string, off, n int64) ([]byte, error) {
	if err := w.before(ctx, key); err != nil {
		return nil, err
	}
	return w.Backend.GetRange(ctx, key, off, n)
}

func (w *watchReads) List(ctx context.Context, prefix string) ([]Object, error) {
	objs, err := w.Backend.List(ctx, prefix)
	w.listed(prefix)
	return objs, err
}

// One resume can meet several packs rewritten under it by one collection
// round: it finds a chunk missing, re-lists, and while it reads again the
// round moves the next pack it needs. Node A rewrites three partly dead packs
// P1 < P2 < P3 (each holding shared bytes that "keep" names); node D has
// refreshed its index once P1's new pack was written, and resumes "keep"
// meanwhile: its read of P2 lands after P2 is deleted, its re-listing before
// P3's new pack is written, and its second read of P3 after P3 is deleted.
// The resume re-lists and reads again each time, and gets the exact bytes.
func TestClusterOpenAcrossSeveralRepacks(t *testing.T) {
	srv := s3test.Start(t)
	var mu sync.Mutex
	armed := false
	var p2, p3 string
	p2Gone, p3Gone, dListed := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var p2Once, listedOnce sync.Once
	packPuts := 0
	wait := func(ctx context.Context, ch chan struct{}) error {
		select {
		case <-ch:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Second):
			return errors.New("test: timed out")
		}
	}
	nodes, _ := clusterStoresWith(t, srv, 3, func(i int, b Backend) Backend {
		switch i {
		case 0: // A: its third rewritten pack waits for D's re-listing
			return &watchPuts{Backend: b, put: func(key string) error {
				mu.Lock()
				on := armed && strings.HasPrefix(key, "packs/")
				if on {
					packPuts++
				}
				third := on && packPuts == 3
				mu.Unlock()
				if third {
					p2Once.Do(func() { close(p2Gone) })
					return wait(ctx, dListed)
				}
				return nil
			}}
		case 2: // D
			return &watchReads{Backend: b,
				before: func(ctx context.Context, key string) error {
					mu.Lock()
					k2, k3 := p2 != "" && key == packKey(p2), p3 != "" && key == packKey(p3)
					mu.Unlock()
					switch {
					case k2:
						return wait(ctx, p2Gone)
					case k3:
						return wait(ctx, p3Gone)
					}
					return nil
				},
				listed: func(prefix string) {
					select {
					case <-p2Gone:
						if prefix == "index/" {
							listedOnce.Do(func() { close(dListed) })
						}
					default:
					}
				}}
		}
		return b
	})
	a, c, d := nodes[0], nodes[1], nodes[2]
	keep := map[string][]byte{"pages.img": memImage(64)}
	var packs []string
	for i := 1; i <= 3; i++ {
		x, y := memImage(128), memImage(512)
		id := fmt.Sprintf("s%d", i)
		commit(t, a, id, map[string][]byte{"shared.img": x, "pages.img": y})
		keep[fmt.Sprintf("x%d.img", i)] = x
		sd, err := a.readDoc(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		l, _ := a.idx.known.locs[firstChunk(sd)]
		packs = append(packs, l.Pack)
	}
	commit(t, a, "keep", keep)
	mustOpen(t, d, "keep", keep)
	for i := 1; i <= 3; i++ {
		if err := a.Delete(ctx, fmt.Sprintf("s%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	dropLocal(t, d)
	sort.Strings(packs)
	mu.Lock()
	p2, p3 = packs[1], packs[2]
	armed = true
	mu.Unlock()
	opened := make(chan error, 1)
	var hooked []string
	testBeforePackDelete = func(st *Store, pid string) {
		if st != a {
			return
		}
		if hooked = append(hooked, pid); len(hooked) == 1 {
			d.freshForOpen(ctx) // D's index: P1's new pack, P2 and P3; the generation seen
			go func() {
				_, _, err := d.Open(ctx, "keep")
				opened <- err
			}()
		}
	}
	defer func() { testBeforePackDelete = nil }()
	budget := clusterRoundBudget
	clusterRoundBudget = time.Minute
	defer func() { clusterRoundBudget = budget }()
	n, err := a.Collect(ctx, nil)
	testBeforePackDelete = nil
	close(p3Gone)
	if err != nil || len(hooked) != 3 || hooked[0] != packs[0] {
		t.Fatalf("collect on A: %d chunks, %v; rewritten %v, want %v", n, err, hooked, packs)
	}
	select {
	case err := <-opened:
		if err != nil {
			t.Fatalf("D's resume during the collection: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("D's resume did not finish")
	}
	mustOpen(t, d, "keep", keep) // the copy D's resume built
	mustOpen(t, c, "keep", keep)
}
