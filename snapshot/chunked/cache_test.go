package chunked

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

func cacheChunk(i, n int) (string, []byte) {
	b := bytes.Repeat([]byte{byte(i)}, n)
	b = append(b, fmt.Sprint(i)...)
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:]), b
}

// TestCacheFilesHoldManyChunks: an older build's chunk files are dropped at
// start-up; a batch of chunks goes into one file, read back chunk by chunk, found again by a new Cache on the same directory (a restart),
// evicted a file at a time past the limit, and a damaged file is dropped at
// start-up rather than served.
func TestCacheFilesHoldManyChunks(t *testing.T) {
	dir := t.TempDir()
	// A chunk file of an older build (one file per chunk, named by its id).
	oldID, oldBytes := cacheChunk(99, 1000)
	if err := os.MkdirAll(filepath.Join(dir, oldID[:2]), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, oldID[:2], oldID), oldBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := NewCache(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var batch []cacheItem
	for i := 0; i < 10; i++ {
		id, b := cacheChunk(i, 10_000)
		batch = append(batch, cacheItem{id, b})
	}
	c.putMany(batch)
	files := func() []string {
		var out []string
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				out = append(out, p)
			}
			return nil
		})
		return out
	}
	if f := files(); len(f) != 1 {
		t.Fatalf("10 chunks in %d files, want 1 (the older build's chunk file dropped): %v", len(f), f)
	}
	if _, ok := c.Get(oldID); ok {
		t.Fatal("an older build's chunk file is served")
	}
	check := func(c *Cache, i int) {
		t.Helper()
		id, want := cacheChunk(i, 10_000)
		got, ok := c.Get(id)
		if !ok || !bytes.Equal(got, want) {
			t.Fatalf("chunk %d: ok=%v, %d bytes, want %d", i, ok, len(got), len(want))
		}
	}
	for i := 0; i < 10; i++ {
		check(c, i)
	}
	c2, err := NewCache(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, n := c2.Used(); n != 10 {
		t.Fatalf("after a restart: %d chunks, want 10", n)
	}
	check(c2, 7)

	// Removing every chunk of a file removes the file.
	for i := 0; i < 10; i++ {
		id, _ := cacheChunk(i, 10_000)
		c2.Remove(id)
	}
	if f := files(); len(f) != 0 {
		t.Fatalf("files left after every chunk was removed: %v", f)
	}

	// Past the limit, the least recently used file goes with its chunks.
	for round := 0; round < 3; round++ {
		var batch []cacheItem
		for i := 0; i < 4; i++ {
			id, b := cacheChunk(100*round+i, 100_000)
			batch = append(batch, cacheItem{id, b})
		}
		c2.putMany(batch) // 400 kB a file; the limit holds two
	}
	if used, n := c2.Used(); used > 1<<20 || n != 8 {
		t.Fatalf("after 3 files of 4 chunks, limit 1 MiB: %d bytes, %d chunks", used, n)
	}
	if id, _ := cacheChunk(0, 100_000); func() bool { _, ok := c2.Get(id); return ok }() {
		t.Fatal("the oldest file's chunk is still served")
	}

	// A damaged header: the file is removed at start-up.
	f := files()
	if err := os.WriteFile(f[0], []byte("torpor-cache-1\n\xff\xff"), 0o600); err != nil {
		t.Fatal(err)
	}
	c3, err := NewCache(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, n := c3.Used(); n != 4 {
		t.Fatalf("after damaging one of two files: %d chunks, want 4", n)
	}
	if _, err := os.Stat(f[0]); !os.IsNotExist(err) {
		t.Fatalf("damaged file kept: %v", err)
	}
}
