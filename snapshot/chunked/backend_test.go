package chunked

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// PutDirect stores exactly the bytes given, aligned or not, with or without a
// partial last block, and leaves the object for Sync like Put (in the dirty
// list, no temporary file behind); the pack buffers it is given start at a
// block boundary. The objects written direct have an fsync started at once,
// which Sync waits for and forgets.
func TestPutDirect(t *testing.T) {
	b, err := NewFS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pb := packBufs.Get().(*[]byte)
	defer packBufs.Put(pb)
	if !blockAligned(*pb) || cap(*pb) != packBufCap {
		t.Fatalf("pack buffer: aligned %v, capacity %d", blockAligned(*pb), cap(*pb))
	}
	for i, n := range []int{1, directAlign - 1, directAlign, 3*directAlign + 100, packTarget + 12345} {
		data := append((*pb)[:0], make([]byte, n)...)
		fill(data)
		for _, unaligned := range []bool{false, true} {
			src := data
			if unaligned {
				src = data[1:]
			}
			key := fmt.Sprintf("packs/ab/%d-%v", i, unaligned)
			if err := b.PutDirect(ctx, key, src); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(filepath.Join(b.Dir(), key))
			if err != nil || !bytes.Equal(got, src) {
				t.Fatalf("%d bytes (unaligned %v): read back %d bytes, err %v", len(src), unaligned, len(got), err)
			}
		}
	}
	b.mu.Lock()
	dirty, early := len(b.dirty), len(b.early)
	b.mu.Unlock()
	if dirty != 10 || early != 3 {
		t.Fatalf("%d objects left for Sync, %d early fsyncs; want 10 and 3 (aligned, a block or more)", dirty, early)
	}
	if err := b.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	dirty, early = len(b.dirty), len(b.early)
	b.mu.Unlock()
	if dirty != 0 || early != 0 {
		t.Fatalf("after Sync: %d objects, %d early fsyncs left", dirty, early)
	}
	if ents, _ := os.ReadDir(filepath.Join(b.Dir(), ".tmp")); len(ents) != 0 {
		t.Fatalf("%d temporary files left", len(ents))
	}
}
