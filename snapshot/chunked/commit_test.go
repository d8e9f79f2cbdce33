package chunked

import (
	"bytes"
	"fmt"
	"testing"
)

// firstCommitFiles is a staged snapshot with what a first commit meets: random
// pages with zero pages among them (memImage), compressible text, a run
// repeated within the file (chunks this commit stores twice), and a small file.
func firstCommitFiles() map[string][]byte {
	img := memImage(24 << 20 / pageSize)
	copy(img[16<<20:], img[2<<20:6<<20])
	text := bytes.Repeat([]byte("checkpoint state: sandbox heap, page tables and file descriptors\n"), 40000)
	return map[string][]byte{
		"pages.img":      append(img, text...),
		"checkpoint.img": text[:300000],
		"pages_meta.img": []byte("meta"),
	}
}

// A first commit by many workers, whose packs fill in whatever order the
// workers reach them, writes the same manifest as one by a single worker: the
// same chunks in the same order with the same ids and stored sizes, the same
// file hashes and byte counts, the same new bytes. Plain and with a key; both
// snapshots then open from their packs alone (no opened copy) with the staged
// bytes, several commits after the first (the pack and compression buffers
// are reused).
func TestParallelCommitSameManifest(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		t.Run(fmt.Sprintf("key=%v", keyed), func(t *testing.T) {
			var k *Key
			if keyed {
				k = newKey(t)
			}
			files := firstCommitFiles()
			var docs []doc
			var stores []*Store
			for _, workers := range []int{1, 8} {
				s, err := New(ctx, Config{Dir: t.TempDir(), Key: k, Workers: workers})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { s.Close() })
				for i := range 3 {
					commit(t, s, fmt.Sprintf("warm-%d", i), map[string][]byte{"pages.img": memImage(1 << 20 / pageSize)})
				}
				commit(t, s, "first", files)
				d, err := s.readDoc(ctx, "first")
				if err != nil {
					t.Fatal(err)
				}
				docs = append(docs, d)
				stores = append(stores, s)
			}
			seq, par := docs[0], docs[1]
			if len(seq.Files) != 3 || len(seq.Files[1].Chunks) < 1000 {
				t.Fatalf("sequential commit: %d files, %d chunks of pages.img; want 3 files and many chunks", len(seq.Files), len(seq.Files[1].Chunks))
			}
			for i, f := range seq.Files {
				pf := par.Files[i]
				if f.Name != pf.Name || len(f.Chunks) != len(pf.Chunks) {
					t.Fatalf("file %d: sequential %s with %d chunks, parallel %s with %d", i, f.Name, len(f.Chunks), pf.Name, len(pf.Chunks))
				}
				for j, c := range f.Chunks {
					if c != pf.Chunks[j] {
						t.Fatalf("%s chunk %d: sequential %+v, parallel %+v", f.Name, j, c, pf.Chunks[j])
					}
				}
			}
			sm, pm := seq.Manifest, par.Manifest
			if fmt.Sprint(sm.Files) != fmt.Sprint(pm.Files) || sm.Bytes != pm.Bytes || sm.LogicalBytes != pm.LogicalBytes ||
				sm.StoredBytes != pm.StoredBytes || sm.NewBytes != pm.NewBytes || sm.Chunks != pm.Chunks {
				t.Fatalf("manifests differ:\nsequential %+v\nparallel   %+v", sm, pm)
			}
			if sm.NewBytes >= sm.LogicalBytes {
				t.Fatalf("new bytes %d of %d logical: want the zero pages, the repeated run and the text saved", sm.NewBytes, sm.LogicalBytes)
			}
			for _, s := range stores {
				dropLocal(t, s)
				mustOpen(t, s, "first", files)
			}
		})
	}
}
