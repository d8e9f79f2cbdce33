package chunked

import (
	"syscall"
)

// Diff commits without hashing what did not change.
//
// A diff hibernate's files are mostly the parent snapshot's bytes: 99.8% of a
// 512 MiB checkpoint after one request (README "Snapshot store"). Hashing every
// chunk with sha256 was 85% of such a commit's CPU (measured: 390 ms of chunking
// for 524 MB on 2 cores). When this process knows the keys of the parent's
// chunks (it committed the parent, or verified or rebuilt its opened copy: each
// key was computed from bytes that were hashed with sha256 or checked against
// their sha256 id), a new chunk whose key (XXH3-128, fingerprint) and length
// equal a parent chunk's of the same file takes that chunk's id without being
// hashed. Only the chunks that changed are hashed and compressed.
//
// What that trusts: two different chunks of one file have equal XXH3-128 keys
// by accident with probability 2^-128 per pair. XXH3 is not built to resist a
// deliberate collision; a guest that crafted a chunk with the key of one of its
// parent's chunks would have its snapshot hold the parent's bytes there, which
// are its own earlier memory: it can harm only its own state, never read or
// change another sandbox's. Every chunk read back is still checked against its
// sha256 id. Until 2026-12-01 the match was a byte comparison with the parent's
// opened copy (mapped); reading that copy was ~6 ms of a 64 MiB diff commit's
// ~38 ms in place (CPU profile, README), and needed the copy on local disk.

// parentKeys indexes a parent snapshot's stored chunks by file and key.
type parentKeys struct {
	files map[string]map[chunkSum]chunkRef
}

// openParent returns the parent's chunk index, or nil when this process does
// not know the keys of its chunks (parent committed or opened before it
// started, and not opened since) or the parent was sealed with another
// encryption key than the store's (or without one, or the store has none).
func (s *Store) openParent(parent string) *parentKeys {
	if parent == "" {
		return nil
	}
	d, ok := s.docs.get(parent)
	if !ok || !knownKeys(d) || d.key != s.key {
		// A parent under another key (or none) has its chunks addressed
		// otherwise: this commit must not name them.
		return nil
	}
	p := &parentKeys{files: make(map[string]map[chunkSum]chunkRef, len(d.Files))}
	for i, fc := range d.Files {
		idx := make(map[chunkSum]chunkRef, len(fc.Chunks))
		for j, r := range fc.Chunks {
			if r.ID != "" {
				idx[d.keys[i][j]] = r
			}
		}
		p.files[fc.Name] = idx
	}
	return p
}

// match returns the parent's chunk of file with key and length n, if any.
func (p *parentKeys) match(file string, key chunkSum, n int) (chunkRef, bool) {
	if p == nil {
		return chunkRef{}, false
	}
	r, ok := p.files[file][key]
	if !ok || r.Len != int64(n) {
		return chunkRef{}, false
	}
	return r, true
}

// unmapLater unmaps a commit's mappings of its staged files on another
// goroutine, once nothing refers to them: tearing down the page tables of ~76
// MiB mappings took 1–2 ms of a 64 MiB diff commit (CPU profile of
// bench.BenchmarkStore, 2026-11-30), time the hibernate's answer need not wait
// for.
func unmapLater(mapped [][]byte) {
	if len(mapped) == 0 {
		return
	}
	go func() {
		for _, b := range mapped {
			_ = syscall.Munmap(b)
		}
	}()
}
