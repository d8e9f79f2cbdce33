package chunked

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/torpor/torpor/snapshot"
)

// The fuzz targets of the snapshot store's decoders: manifests and pack
// indexes are read back from disk or S3, where anything with write access to
// the bucket (or a torn write) can change them. Seeds are in
// testdata/fuzz/Fuzz*; docs/fuzzing.md says how to run them longer.

// fuzzSnapshot is the snapshot the manifest and index targets commit: a
// deterministic pages.img (random pages, every 7th page zero, a run of 20 zero
// pages that makes an all-zero chunk, a partial page at the end) and a small meta.json, so the committed seeds name its chunks.
const fuzzSnapshot = "fuzz-snap"

func fuzzFiles() map[string][]byte {
	img := make([]byte, 40*pageSize+1000)
	mrand.NewChaCha8([32]byte{'f', 'u', 'z', 'z'}).Read(img)
	for p := 0; p < 40; p += 7 {
		clear(img[p*pageSize : (p+1)*pageSize])
	}
	clear(img[15*pageSize : 35*pageSize])
	return map[string][]byte{"pages.img": img, "meta.json": []byte(`{"engine":"test"}`)}
}

// commitFuzzSnapshot commits fuzzSnapshot into s (one worker: the pack layout,
// and so the seeds' offsets, are the same every time).
func commitFuzzSnapshot(t testing.TB, s *Store) {
	t.Helper()
	dir, err := s.Stage(ctx, fuzzSnapshot)
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range fuzzFiles() {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Commit(ctx, fuzzSnapshot, snapshot.Manifest{ID: fuzzSnapshot, Engine: "test"}); err != nil {
		t.Fatal(err)
	}
}

var quiet = slog.New(slog.DiscardHandler)

func putObject(t testing.TB, b Backend, key string, data []byte) {
	t.Helper()
	if err := b.Put(ctx, key, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
}

// allocBound fails t if fn allocates more than limit bytes (heap, all
// goroutines: fuzz workers run one input at a time).
func allocBound(t *testing.T, limit uint64, fn func()) {
	t.Helper()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > limit {
		t.Fatalf("allocated %d bytes (limit %d)", n, limit)
	}
}

// checkOpened checks an opened copy against the manifest Open returned: every
// file there with its size.
func checkOpened(t *testing.T, dir string, m snapshot.Manifest) {
	t.Helper()
	for _, f := range m.Files {
		st, err := os.Stat(filepath.Join(dir, f.Name))
		if err != nil || st.Size() != f.Bytes {
			t.Fatalf("opened copy: %s: %v (size want %d)", f.Name, err, f.Bytes)
		}
	}
}

// FuzzManifest feeds a snapshot's stored manifest to readDoc and Open. A
// manifest that is refused is a *snapshot.CorruptError naming manifest.json;
// one that is accepted has chunks of 1 to maxChunk bytes that add up to each
// file's size (so no later step allocates or writes more than the manifest's
// own size implies), encodes back to an equal manifest, and opens without a
// panic and without allocating more than a bound set by its length.
func FuzzManifest(f *testing.F) {
	s, err := New(ctx, Config{Dir: f.TempDir(), Workers: 1, Logger: quiet})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	commitFuzzSnapshot(f, s)
	valid, err := getAll(ctx, s.b, manifestKey(fuzzSnapshot))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(valid)
	f.Fuzz(func(t *testing.T, data []byte) {
		s.docs.forget(fuzzSnapshot)
		if err := os.RemoveAll(s.opened(fuzzSnapshot)); err != nil {
			t.Fatal(err)
		}
		putObject(t, s.b, manifestKey(fuzzSnapshot), data)
		d, err := s.readDoc(ctx, fuzzSnapshot)
		if err != nil {
			var ce *snapshot.CorruptError
			if !errors.As(err, &ce) || ce.File != "manifest.json" || ce.Snapshot != fuzzSnapshot {
				t.Fatalf("refused manifest: %v (want a CorruptError naming manifest.json)", err)
			}
			return
		}
		for i, fc := range d.Files {
			var sum int64
			for _, r := range fc.Chunks {
				if r.Len <= 0 || r.Len > maxChunk || (r.ID != "" && !validChunkID(r.ID)) {
					t.Fatalf("accepted chunk %+v of %s", r, fc.Name)
				}
				sum += r.Len
			}
			if sum != d.Manifest.Files[i].Bytes {
				t.Fatalf("accepted %s: chunks add up to %d bytes, the file has %d", fc.Name, sum, d.Manifest.Files[i].Bytes)
			}
		}
		enc, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		putObject(t, s.b, manifestKey(fuzzSnapshot), enc)
		d2, err := s.readDoc(ctx, fuzzSnapshot)
		if err != nil {
			t.Fatalf("re-encoded manifest refused: %v\n%s", err, enc)
		}
		if enc2, _ := json.Marshal(d2); !bytes.Equal(enc, enc2) {
			t.Fatalf("round trip changed the manifest:\n%s\n%s", enc, enc2)
		}
		// Open writes each file (holes for zero chunks) and fetches the
		// chunks it names; what it allocates is bounded by the chunk count.
		allocBound(t, 64<<20+uint64(len(data))*64, func() {
			dir, m, err := s.Open(ctx, fuzzSnapshot)
			if err != nil && bytes.Equal(data, valid) {
				t.Fatalf("the committed manifest does not open: %v", err)
			}
			if err == nil {
				checkOpened(t, dir, m)
			}
		})
	})
}

// FuzzPackIndex replaces the index of the fuzz snapshot's pack and opens the
// snapshot with a store that has forgotten what it knew of the backend (so it
// loads the index as New does). An index entry the store accepts points at 1
// to maxStored bytes inside int64 range; whatever the index says, Open does
// not panic or allocate past a bound, and succeeds only with the right bytes
// (it checks every chunk's sha256).
func FuzzPackIndex(f *testing.F) {
	s, err := New(ctx, Config{Dir: f.TempDir(), Workers: 1, Logger: quiet})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	commitFuzzSnapshot(f, s)
	idx, err := s.b.List(ctx, "index/")
	if err != nil || len(idx) != 1 {
		f.Fatalf("want one pack index, got %v (%v)", idx, err)
	}
	pack := strings.TrimSuffix(filepath.Base(idx[0].Key), ".json")
	valid, err := getAll(ctx, s.b, indexKey(pack))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(valid)
	want := fuzzFiles()
	f.Fuzz(func(t *testing.T, data []byte) {
		putObject(t, s.b, indexKey(pack), data)
		entries, err := readIndex(ctx, s.b, pack)
		if err == nil {
			for _, e := range entries {
				if !validChunkID(e.ID) || e.Off < 0 || e.Len <= 0 || e.Len > maxStored || e.Off > math.MaxInt64-e.Len {
					t.Fatalf("accepted index entry %+v", e)
				}
			}
		} else if !strings.Contains(err.Error(), "pack "+pack+": index") {
			t.Fatalf("error does not name the pack index: %v", err)
		}
		s.idx.mu.Lock()
		s.idx.known, s.idx.loaded, s.idx.suspects = newPackSet(), false, nil
		s.idx.mu.Unlock()
		s.docs.forget(fuzzSnapshot)
		if err := os.RemoveAll(s.opened(fuzzSnapshot)); err != nil {
			t.Fatal(err)
		}
		allocBound(t, 64<<20+uint64(len(data))*64, func() {
			d, m, err := s.Open(ctx, fuzzSnapshot)
			if err != nil && bytes.Equal(data, valid) {
				t.Fatalf("the committed index does not open: %v", err)
			}
			if err == nil {
				for name, content := range want {
					got, err := os.ReadFile(filepath.Join(d, name))
					if err != nil || !bytes.Equal(got, content) {
						t.Fatalf("opened %s differs from what was committed (%v)", name, err)
					}
				}
				checkOpened(t, d, m)
			}
		})
	})
}

// FuzzChunker checks the chunker on any bytes: chunks are whole pages (a
// trailing partial page ends the last), 1 to maxChunk bytes, cut's key is the
// chunk's fingerprint, and chunking segments separately gives the chunks of
// one pass for any span.
func FuzzChunker(f *testing.F) {
	zero := make([]byte, 20*pageSize)
	page := bytes.Repeat([]byte{0xa5}, pageSize)
	f.Add(zero, uint16(1))
	f.Add(append(page, 1, 2, 3), uint16(1))
	f.Add(fuzzFiles()["pages.img"], uint16(3))
	f.Add([]byte{0}, uint16(0))
	f.Fuzz(func(t *testing.T, data []byte, spanPages uint16) {
		if len(data) == 0 {
			return // cut's contract: data is not empty
		}
		want := onePass(data, 0, len(data))
		for i, c := range want {
			last := i == len(want)-1
			if c.n <= 0 || c.n > maxChunk || (!last && c.n%pageSize != 0) {
				t.Fatalf("chunk %d at %d: %d bytes", i, c.off, c.n)
			}
		}
		span := int(spanPages%64) * pageSize
		b := segments(data, span)
		if b[0] != 0 || b[len(b)-1] != len(data) || !slices.IsSorted(b) {
			t.Fatalf("span %d: bounds %v", span, b)
		}
		var got []cutChunk
		for i := 0; i+1 < len(b); i++ {
			got = append(got, onePass(data, b[i], b[i+1])...)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("span %d: segments chunk as %v, one pass as %v", span, got, want)
		}
	})
}

// A manifest's chunk list is checked against its digest, but anyone who can
// write the manifest can recompute that: the sizes it claims must still be
// checked before Open sizes a file or a buffer by them (found by FuzzManifest:
// a zero chunk of 2^40 bytes made Open allocate 1 TiB for its key).
func TestManifestClaimsAreBounded(t *testing.T) {
	s := newFSStore(t)
	commitFuzzSnapshot(t, s)
	d, err := s.readDoc(ctx, fuzzSnapshot)
	if err != nil {
		t.Fatal(err)
	}
	id := d.Files[1].Chunks[0].ID
	cases := map[string]struct {
		chunks []chunkRef
		bytes  int64 // -1: the chunks' sum
		want   string
	}{
		"zero chunk of 2^40 bytes": {[]chunkRef{{Len: 1 << 40}}, -1, "chunk 0: id \"\", 1099511627776 bytes"},
		"chunk of 2^40 bytes":      {[]chunkRef{{ID: id, Len: 1 << 40}}, -1, "1099511627776 bytes"},
		"negative length":          {[]chunkRef{{Len: -4096}, {Len: 8192}}, -1, "-4096 bytes"},
		"id not a sha256":          {[]chunkRef{{ID: "a", Len: 4096}}, -1, `id "a"`},
		"size the chunks miss":     {[]chunkRef{{Len: 4096}}, 4097, "chunks add up to 4096 bytes, the manifest says 4097"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			bad := d
			bad.Files = slices.Clone(d.Files)
			bad.Manifest.Files = slices.Clone(d.Manifest.Files)
			bad.Files[1].Chunks = c.chunks
			bad.Manifest.Files[1].SHA256 = treeHash(c.chunks)
			bad.Manifest.Files[1].Bytes = c.bytes
			if c.bytes < 0 {
				bad.Manifest.Files[1].Bytes = 0
				for _, r := range c.chunks {
					bad.Manifest.Files[1].Bytes += r.Len
				}
			}
			b, _ := json.Marshal(bad)
			putObject(t, s.b, manifestKey(fuzzSnapshot), b)
			s.docs.forget(fuzzSnapshot)
			os.RemoveAll(s.opened(fuzzSnapshot))
			_, _, err := s.Open(ctx, fuzzSnapshot)
			var ce *snapshot.CorruptError
			if !errors.As(err, &ce) || ce.File != "manifest.json" || !strings.Contains(ce.Reason, c.want) {
				t.Fatalf("Open: %v, want a CorruptError of manifest.json saying %q", err, c.want)
			}
		})
	}
}

// A pack index entry of 2^40 bytes made Open allocate that much for the
// ranged read; an offset near 2^63 overflowed the read's end (found by
// FuzzPackIndex). Both are refused when the index is read, naming the pack.
func TestPackIndexClaimsAreBounded(t *testing.T) {
	for name, e := range map[string]indexEntry{
		"2^40 bytes":       {ID: strings.Repeat("ab", 32), Off: 30, Len: 1 << 40},
		"offset overflows": {ID: strings.Repeat("ab", 32), Off: math.MaxInt64 - 10, Len: 4121},
		"id not hex":       {ID: "../../" + strings.Repeat("a", 58), Off: 0, Len: 30},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := NewFS(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			pack := strings.Repeat("0f", 16)
			raw, _ := json.Marshal(packIndex{Chunks: []indexEntry{e}})
			putObject(t, b, indexKey(pack), raw)
			if _, err := readIndex(ctx, b, pack); err == nil || !strings.Contains(err.Error(), "pack "+pack+": index: bad entry") {
				t.Fatalf("readIndex: %v, want the bad entry named", err)
			}
		})
	}
}
