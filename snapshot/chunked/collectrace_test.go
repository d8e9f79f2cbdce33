package chunked

import (
	"testing"

	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// A node's index of the bucket goes stale when another node collects: node B
// learns where S1's chunks are (it resumes S1), node A deletes S1 and
// collects its packs, then commits S2, which holds some of S1's bytes again
// (chunks every sandbox shares: the same image, the same runtime) and so
// stores those chunks again, in new packs. B resumes S2: every chunk S2 names
// is in the bucket, but B's index still placed the shared ones in S1's
// deleted packs (its cache no longer holds them: at 512 MiB a snapshot
// fills much of it). The cluster benchmark's "chunk … missing" on a resume from
// the bucket (docs/benchmarks/2026-12-01-cluster.md) was this.
func TestClusterResumeAfterAnotherNodeCollected(t *testing.T) {
	srv := s3test.Start(t)
	nodes := clusterStores(t, srv, 3, nil)
	a, b, c := nodes[0], nodes[1], nodes[2]
	shared := memImage(256) // 1 MiB both snapshots hold
	s1 := map[string][]byte{"shared.img": shared, "pages.img": memImage(128)}
	commit(t, a, "s1", s1)
	mustOpen(t, b, "s1", s1) // B locates S1's chunks
	d1, err := a.readDoc(ctx, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Delete(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if n, err := a.Collect(ctx, nil); err != nil || n == 0 {
		t.Fatalf("collect on A: %d chunks, %v", n, err)
	}
	if bucketChunks(t, a.b)[firstChunk(d1)] {
		t.Fatal("S1's packs are still in the bucket")
	}
	s2 := map[string][]byte{"shared.img": shared, "pages.img": memImage(128)}
	commit(t, a, "s2", s2)
	dropLocal(t, b) // S1's chunks left B's cache (a cache holds a few snapshots)
	mustOpen(t, b, "s2", s2)

	// B's diff commit from the snapshot it resumed, and its first commit of
	// the shared bytes, name only chunks that are there: C, which never saw
	// them, opens both.
	s3 := map[string][]byte{"shared.img": shared, "pages.img": mutate(s2["pages.img"], 0.05, 4, 7)}
	commitChild(t, b, "s3", "s2", s3)
	s4 := map[string][]byte{"shared.img": shared}
	commit(t, b, "s4", s4)
	mustOpen(t, c, "s3", s3)
	mustOpen(t, c, "s4", s4)
}

// A listing of the backend that overlaps a collection in the same store (an
// Open that meets a chunk it cannot locate lists every pack index) must not
// put back a pack the collection deleted: the next commit of those bytes
// would deduplicate against it and name chunks that are gone. Here the
// listing runs while the collection has dropped the pack from the index and
// is about to delete it (the pack and its index are still in the backend).
func TestCollectNotUndoneByConcurrentListing(t *testing.T) {
	for _, tc := range []struct {
		name string
		new  func(t *testing.T) []*Store
	}{
		{"fs", func(t *testing.T) []*Store { return []*Store{newFSStore(t)} }},
		{"cluster", func(t *testing.T) []*Store { return clusterStores(t, s3test.Start(t), 2, nil) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nodes := tc.new(t)
			s := nodes[0]
			files := map[string][]byte{"pages.img": memImage(256)}
			commit(t, s, "s1", files)
			if err := s.Delete(ctx, "s1"); err != nil {
				t.Fatal(err)
			}
			listed := 0
			testBeforePackDelete = func(st *Store, pid string) {
				if st != s {
					return
				}
				listed++
				if err := s.loadKnown(ctx); err != nil {
					t.Error(err)
				}
				if err := s.refreshKnown(ctx); err != nil {
					t.Error(err)
				}
			}
			n, err := s.Collect(ctx, nil)
			testBeforePackDelete = nil
			if err != nil || n == 0 || listed == 0 {
				t.Fatalf("collect: %d chunks, %v (%d listings during it)", n, err, listed)
			}
			commit(t, s, "s2", files) // the same bytes again
			dropLocal(t, s)
			mustOpen(t, s, "s2", files)
			if len(nodes) > 1 {
				mustOpen(t, nodes[1], "s2", files)
			}
		})
	}
}

// A resume's refresh of the index can overlap another node's collection:
// node B refreshes for an open while node A's collection has written its
// generation and not yet deleted S1's pack, so B keeps the pack and takes the
// generation as seen. A then commits S2 with S1's bytes (stored again, in
// a new pack) and B resumes S2 without re-listing (the generation
// is unchanged): it meets a chunk missing where its index placed it, and
// re-lists and reads again instead of failing the resume.
func TestClusterResumeRefreshOverlappingCollection(t *testing.T) {
	srv := s3test.Start(t)
	nodes := clusterStores(t, srv, 2, nil)
	a, b := nodes[0], nodes[1]
	shared := memImage(256)
	s1 := map[string][]byte{"shared.img": shared}
	commit(t, a, "s1", s1)
	mustOpen(t, b, "s1", s1)
	if err := a.Delete(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	overlapped := 0
	testBeforePackDelete = func(st *Store, pid string) {
		if st == a {
			overlapped++
			b.freshForOpen(ctx)
		}
	}
	n, err := a.Collect(ctx, nil)
	testBeforePackDelete = nil
	if err != nil || n == 0 || overlapped == 0 {
		t.Fatalf("collect on A: %d chunks, %v (%d refreshes on B during it)", n, err, overlapped)
	}
	// Only S1's bytes: B's index places every chunk (in the deleted pack), so
	// nothing it lacks makes it re-list before it reads.
	s2 := map[string][]byte{"shared.img": shared}
	commit(t, a, "s2", s2)
	dropLocal(t, b)
	mustOpen(t, b, "s2", s2)
	if _, err := b.Verify(ctx, "s2"); err != nil {
		t.Fatal(err)
	}
}
