package chunked

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
	"sync"

	"github.com/torpor/torpor/snapshot"
)

func chunkKey(id string) string { return "chunks/" + id[:2] + "/" + id }

func manifestKey(id string) string { return "manifests/" + id + ".json" }

// doc is the manifest object stored in the backend.
type doc struct {
	Format   int               `json:"format"`
	Chunking string            `json:"chunking"`
	Manifest snapshot.Manifest `json:"manifest"`
	Files    []fileChunks      `json:"chunks"`
	// keys[file][chunk] are the chunk keys (fingerprint), known in memory
	// for snapshots this process committed or verified; not stored.
	keys [][]chunkSum
	// key is the encryption key the manifest is sealed with and its chunks
	// are addressed under (seal.go); nil for a plain manifest. Not stored.
	key *Key
}

type fileChunks struct {
	Name   string     `json:"name"`
	Chunks []chunkRef `json:"chunks"`
}

// chunkRef is one chunk of a file: ID "" is an all-zero chunk (not stored).
type chunkRef struct {
	ID  string `json:"id,omitempty"`
	Len int64  `json:"len"`
	// Stored is the chunk's stored (compressed) size.
	Stored int64 `json:"stored,omitempty"`
}

// treeHash is what a chunked manifest records as a file's SHA256: the sha256 of
// the file's chunk list ("<id or zero> <len>\n" per chunk), which pins the whole
// content through the chunk hashes without a second, serial pass over the file.
func treeHash(refs []chunkRef) string {
	h := sha256.New()
	for _, r := range refs {
		id := r.ID
		if id == "" {
			id = "zero"
		}
		fmt.Fprintf(h, "%s %d\n", id, r.Len)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (s *Store) readDoc(ctx context.Context, id string) (doc, error) {
	var d doc
	if err := checkID(id); err != nil {
		return d, err
	}
	b, err := getAll(ctx, s.outbox, manifestKey(id)) // not uploaded yet?
	if errors.Is(err, fs.ErrNotExist) {
		b, err = getAll(ctx, s.b, manifestKey(id))
	}
	if errors.Is(err, fs.ErrNotExist) {
		return d, fmt.Errorf("snapshot %s: %w", id, snapshot.ErrNotFound)
	}
	if err != nil {
		return d, fmt.Errorf("snapshot %s: manifest: %w", id, err)
	}
	return s.unmarshalDoc(id, b)
}

// checkDoc checks a parsed manifest of snapshot id against itself: format,
// id, and every file's chunk list against its digest.
func checkDoc(id string, d doc) error {
	if d.Format != 1 || d.Manifest.ID != id || len(d.Files) != len(d.Manifest.Files) {
		return &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "inconsistent manifest"}
	}
	for i, fc := range d.Files {
		if fc.Name != d.Manifest.Files[i].Name || treeHash(fc.Chunks) != d.Manifest.Files[i].SHA256 ||
			strings.ContainsAny(fc.Name, "/\x00") || fc.Name == "." || fc.Name == ".." {
			return &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "chunk list of " + fc.Name + " does not match its digest"}
		}
		// The digest is only a hash of the list: check what Open sizes its
		// buffers and files by (a chunk of 2^40 bytes, or a size the chunks do
		// not add up to, must fail here).
		var size int64
		for j, r := range fc.Chunks {
			if r.Len <= 0 || r.Len > maxChunk || (r.ID != "" && !validChunkID(r.ID)) {
				return &snapshot.CorruptError{Snapshot: id, File: "manifest.json",
					Reason: fmt.Sprintf("%s: chunk %d: id %q, %d bytes (want a sha256 id or none, 1 to %d bytes)", fc.Name, j, r.ID, r.Len, maxChunk)}
			}
			size += r.Len
		}
		if size != d.Manifest.Files[i].Bytes {
			return &snapshot.CorruptError{Snapshot: id, File: "manifest.json",
				Reason: fmt.Sprintf("%s: chunks add up to %d bytes, the manifest says %d", fc.Name, size, d.Manifest.Files[i].Bytes)}
		}
	}
	return nil
}

// Manifest implements snapshot.Store. A manifest this process committed or
// opened comes from memory: read and checked from disk, a 512 MiB snapshot's
// (~33,000 chunks, ~3 MB of JSON) took ~30 ms, which every resume paid
// (bench.BenchmarkStore: the proxy's resume 30–36 ms longer than the
// manager's own, 2026-11-30). Manifests never change once committed.
//
// A deferred first commit's manifest is its pending one until its chunks
// are stored (deferred.go).
func (s *Store) Manifest(ctx context.Context, id string) (snapshot.Manifest, error) {
	if dc, ok := s.deferredOf(id); ok {
		return dc.man, nil
	}
	if d, ok := s.docs.get(id); ok {
		return d.Manifest, nil
	}
	d, err := s.readDoc(ctx, id)
	return d.Manifest, err
}

// List implements snapshot.Store.
func (s *Store) List(ctx context.Context) ([]string, error) {
	// Deferred commits before the listings: one that ends meanwhile has put
	// its manifest in the backend first.
	deferred := s.deferredIDs()
	// The outbox first: an upload writes the backend's manifest before it
	// removes the outbox's, so a snapshot moving meanwhile is seen at least once.
	pending, err := s.outbox.List(ctx, "manifests/")
	if err != nil {
		return nil, err
	}
	objs, err := s.b.List(ctx, "manifests/")
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var ids []string
	for _, id := range deferred {
		seen[id] = true
		ids = append(ids, id)
	}
	for _, o := range append(pending, objs...) {
		if id, ok := strings.CutSuffix(path.Base(o.Key), ".json"); ok && checkID(id) == nil && !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids, nil
}

// knownKeys says whether d carries the keys of all its chunks.
func knownKeys(d doc) bool {
	if len(d.keys) != len(d.Files) {
		return false
	}
	for i, fc := range d.Files {
		if len(d.keys[i]) != len(fc.Chunks) {
			return false
		}
	}
	return true
}

// docCache holds the parsed manifests of the last docCacheLen snapshots this
// process committed or opened (immutable once committed), with their chunks'
// keys when known: parsing the manifest of a 512 MiB snapshot (33 k chunks,
// 3 MB of JSON) is part of every warm Open otherwise. mu guards the rest and
// is taken alone.
type docCache struct {
	mu    sync.Mutex
	docs  map[string]doc
	order []string // oldest first
}

const docCacheLen = 16

func (c *docCache) get(id string) (doc, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.docs[id]
	return d, ok
}

func (c *docCache) put(id string, d doc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.docs == nil {
		c.docs = map[string]doc{}
	}
	if _, ok := c.docs[id]; !ok {
		c.order = append(c.order, id)
	}
	c.docs[id] = d
	for len(c.order) > docCacheLen {
		delete(c.docs, c.order[0])
		c.order = c.order[1:]
	}
}

func (c *docCache) forget(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.docs, id)
}
