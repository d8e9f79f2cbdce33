package chunked

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Stage implements snapshot.Store.
func (s *Store) Stage(ctx context.Context, id string) (string, error) {
	if err := checkID(id); err != nil {
		return "", err
	}
	pending, err := s.outbox.Exists(ctx, manifestKey(id))
	if err != nil {
		return "", fmt.Errorf("snapshot %s: stage: %w", id, err)
	}
	// An unreachable backend does not stop a stage: an asynchronous commit
	// does not need it, and a synchronous one fails at its first upload. Nor
	// does a slow one hold the hibernate for long (snapshot ids are new).
	sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	ok, err := s.b.Exists(sctx, manifestKey(id))
	cancel()
	if err != nil {
		s.log.Warn("snapshot stage: backend unreachable; not checked for an existing snapshot", "snapshot", id, "err", err)
	}
	if ok || pending || s.isDeferred(id) {
		return "", fmt.Errorf("snapshot %s: already committed", id)
	}
	if err := os.Mkdir(s.staged(id), 0o700); err != nil {
		return "", fmt.Errorf("snapshot %s: stage: %w", id, err)
	}
	return s.staged(id), nil
}

// Abort implements snapshot.Store.
func (s *Store) Abort(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	return os.RemoveAll(s.staged(id))
}

// segment is a run of a staged file (segments) that one commit worker chunks
// and stores; refs and keys are its chunks'.
type segment struct {
	file       int
	start, end int
	refs       []chunkRef
	keys       []chunkSum
}

// storeSegment cuts data[sg.start:sg.end] (a slice of the staged file's
// mapping) into chunks and stores them, filling sg.refs and sg.keys: a chunk
// whose key and length match a chunk of the parent's file (parent.go) takes the
// parent's id (reuse), others are hashed (putChunk). Errors name the offset;
// they come from putChunk or ctx.
func (s *Store) storeSegment(ctx context.Context, st *commitState, pw *packWriter, async bool, par *parentKeys, name string, data []byte, sg *segment) error {
	var matched []parentMatch
	for off := sg.start; off < sg.end; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, key := cut(data[off:sg.end])
		chunk := data[off : off+n]
		if known, ok := par.match(name, key, n); ok {
			matched = append(matched, parentMatch{len(sg.refs), off})
			sg.refs = append(sg.refs, known)
		} else {
			ref, err := s.putChunk(ctx, st, pw, chunk, async, "")
			if err != nil {
				return fmt.Errorf("offset %d: %w", off, err)
			}
			sg.refs = append(sg.refs, ref)
		}
		sg.keys = append(sg.keys, key)
		off += n
	}
	st.reused.Add(int64(len(matched)))
	return s.reuse(ctx, st, pw, async, data, sg, matched)
}

// parentMatch is a chunk of a segment named by a parent chunk: its index in the
// segment's refs and its offset in the file.
type parentMatch struct{ i, off int }

// reuse pins the chunks of sg that took a parent chunk's id (matched) and sets
// their stored sizes, under one lock for the whole segment: one lock and map
// update per chunk was ~2.6 ms of CPU in a 64 MiB diff commit of ~4,800
// chunks (CPU profile of bench.BenchmarkStore, 2026-12-01). A chunk being
// deleted by the GC this moment, or not in the tier (a suspect copy, or one the
// GC removed after the parent committed), goes through putChunk, which waits for
// the deletion and stores it again. Errors come from putChunk.
func (s *Store) reuse(ctx context.Context, st *commitState, pw *packWriter, async bool, data []byte, sg *segment, matched []parentMatch) error {
	if len(matched) == 0 {
		return nil
	}
	var slow []parentMatch
	ids := make([]string, 0, len(matched))
	s.idx.mu.Lock()
	for _, m := range matched {
		ref := &sg.refs[m.i]
		if _, ok := s.idx.deleting[ref.ID]; ok {
			slow = append(slow, m)
			continue
		}
		s.idx.pins[ref.ID]++
		ids = append(ids, ref.ID)
		l, ok := s.idx.storedLocked(ref.ID, async)
		if !ok {
			slow = append(slow, m)
			continue
		}
		ref.Stored = l.Len
	}
	s.idx.mu.Unlock()
	st.mu.Lock()
	st.pinned = append(st.pinned, ids...)
	st.mu.Unlock()
	for _, m := range slow {
		ref := sg.refs[m.i]
		got, err := s.putChunk(ctx, st, pw, data[m.off:m.off+int(ref.Len)], async, ref.ID)
		if err != nil {
			return fmt.Errorf("offset %d: %w", m.off, err)
		}
		sg.refs[m.i] = got
	}
	return nil
}

type commitState struct {
	mu       sync.Mutex
	pinned   []string
	newBytes int64
	reused   atomic.Int64 // chunks named by their key match with a parent chunk
}

// Commit implements snapshot.Store: it returns once the snapshot is in the
// durable backend.
//
// With Config.DeferFirstCommits, a first commit (no parent) of a store
// without a key returns earlier, once the staged files are synced and a
// pending manifest is (deferred.go); the chunks follow in the background.
func (s *Store) Commit(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	if s.deferFirst && m.Parent == "" && s.key == nil {
		return s.commitDeferred(ctx, id, m)
	}
	return s.commit(ctx, id, m, false)
}

// CommitAsync implements snapshot.AsyncStore: it returns once the snapshot is in
// the local outbox (synced); the upload to the backend follows in the background.
func (s *Store) CommitAsync(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	return s.commit(ctx, id, m, true)
}

func (s *Store) commit(ctx context.Context, id string, m snapshot.Manifest, async bool) (snapshot.Manifest, error) {
	return s.commitFrom(ctx, id, m, commitSource{dir: s.staged(id), workers: s.workers}, async)
}

// commitSource is where a commit reads its files: the staging directory,
// which becomes the opened copy once committed, or (opened) a deferred
// first commit's opened copy, which stays where it is (deferred.go).
type commitSource struct {
	dir     string
	workers int
	opened  bool
}

func (s *Store) commitFrom(ctx context.Context, id string, m snapshot.Manifest, src commitSource, async bool) (snapshot.Manifest, error) {
	tStart := time.Now()
	dir := src.dir
	names, err := commitFiles(id, m, dir)
	if err != nil {
		return m, err
	}
	if !async {
		if err := s.ensureKnown(ctx); err != nil {
			return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
		}
	}
	if err := s.awaitDeferred(ctx, m.Parent); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	// Other stores sharing the backend collect only while no commit holds
	// this (collectlock.go); taken before any chunk is found to exist.
	unlock, held, err := s.lockCommit(ctx, async)
	if err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	defer unlock()

	st := &commitState{}
	kick := false
	defer func() {
		s.idx.unpin(st.pinned)
		if kick { // after unpinning: the upload drops what no snapshot needs
			s.kickUpload()
		}
	}()
	d := doc{Format: 1, Chunking: chunkingTag, Files: make([]fileChunks, len(names)), keys: make([][]chunkSum, len(names)), key: s.key}
	par := s.openParent(m.Parent)
	var target Backend = s.b
	set := s.idx.known
	if async {
		target, set = s.outbox, s.idx.outKnown
	}
	pw := s.newPackWriter(target, set)
	pw.direct = par == nil
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var firstErr error
	var errOnce sync.Once
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err; cancel() })
	}
	// The staged files are read through read-only mappings: chunks are slices
	// of them, fingerprinted, hashed and compressed in
	// place, without copying 512 MiB through buffers. Each file is split into
	// segments that the workers chunk and store independently (no hand-off per
	// chunk); the chunks are those of a single pass from offset 0 (segments).
	var mapped [][]byte
	defer func() { unmapLater(mapped) }()
	var segs []*segment
	fileData := make([][]byte, len(names))
	for fi, n := range names {
		d.Files[fi].Name = n
		data, err := mapStaged(filepath.Join(dir, n))
		if err != nil {
			return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
		}
		if data == nil {
			continue
		}
		mapped = append(mapped, data)
		fileData[fi] = data
		b := segments(data, segmentSpan)
		for i := 0; i+1 < len(b); i++ {
			segs = append(segs, &segment{file: fi, start: b[i], end: b[i+1]})
		}
	}
	if par == nil {
		// A first commit adds about every chunk: one per cutModulus pages
		// on average; sized at once, the map is not rehashed as it grows.
		var total int
		for _, data := range fileData {
			total += len(data)
		}
		pw.pending = make(map[string]int64, total/(cutModulus*pageSize))
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	kind := "first"
	if par != nil {
		kind = "diff"
	}
	for w := 0; w < min(src.workers, len(segs)); w++ {
		wg.Add(1)
		go pprof.Do(ctx, pprof.Labels("commit", kind), func(ctx context.Context) {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(segs) {
					return
				}
				sg := segs[i]
				if err := s.storeSegment(ctx, st, pw, async, par, names[sg.file], fileData[sg.file], sg); err != nil {
					fail(fmt.Errorf("file %s %w", names[sg.file], err))
					return
				}
			}
		})
	}
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	if firstErr == nil {
		firstErr = pw.flush(ctx)
	}
	var logical int64
	for _, sg := range segs {
		d.Files[sg.file].Chunks = append(d.Files[sg.file].Chunks, sg.refs...)
		d.keys[sg.file] = append(d.keys[sg.file], sg.keys...)
		logical += int64(sg.end - sg.start)
	}
	if firstErr != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, firstErr)
	}
	tHashed := time.Now()
	if async {
		// Chunks found in the backend may sit in packs a concurrent
		// synchronous commit has not synced yet.
		if err := syncTier(ctx, s.b); err != nil {
			return m, fmt.Errorf("snapshot %s: commit: sync: %w", id, err)
		}
	}
	if err := syncTier(ctx, target); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: sync: %w", id, err)
	}
	tSynced := time.Now()
	m.Files, m.Bytes = nil, 0
	seen := map[string]bool{}
	var stored int64
	nchunks := 0
	for _, fc := range d.Files {
		var size int64
		for _, r := range fc.Chunks {
			size += r.Len
			if r.ID != "" && !seen[r.ID] {
				seen[r.ID] = true
				stored += r.Stored
			}
			nchunks++
		}
		m.Files = append(m.Files, snapshot.File{Name: fc.Name, Bytes: size, SHA256: treeHash(fc.Chunks)})
		m.Bytes += size
	}
	m.LogicalBytes, m.StoredBytes, m.NewBytes, m.Chunks = logical, stored, st.newBytes, nchunks
	d.Manifest = m
	b, err := s.marshalDoc(id, d)
	if err != nil {
		return m, err
	}
	if err := target.Put(ctx, manifestKey(id), bytes.NewReader(b), int64(len(b))); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: manifest: %w", id, err)
	}
	if err := s.afterManifest(ctx, target, id, async, held); err != nil {
		return m, err
	}
	if async {
		// Before the unpin: an outbox clean-up that listed the pending
		// manifests before this one must not act on that list.
		s.idx.mu.Lock()
		s.idx.outGen++
		s.idx.mu.Unlock()
	}
	s.docs.put(id, d)
	kick = async
	s.log.Debug("snapshot commit", "snapshot", id, "async", async, "chunk_ms", tHashed.Sub(tStart).Milliseconds(),
		"sync_ms", tSynced.Sub(tHashed).Milliseconds(), "manifest_ms", time.Since(tSynced).Milliseconds(),
		"chunks", m.Chunks, "from_parent_copy", st.reused.Load(), "new_bytes", m.NewBytes)
	s.lastReused.Store(st.reused.Load())
	// Committed. The staged files become the opened copy (verified on
	// Open) — unless the store encrypts: then no plaintext of a hibernated
	// sandbox stays on disk, and the next Open rebuilds the copy from the
	// chunks (the keys, in memory, still serve the next diff commit).
	if src.opened {
		if s.key != nil { // a key configured since the deferred commit
			s.dropOpened(id)
			_ = os.RemoveAll(dir)
		}
		return m, nil
	}
	_ = os.RemoveAll(s.opened(id))
	if s.key != nil {
		if err := os.RemoveAll(dir); err != nil {
			s.log.Warn("snapshot commit: removing the staged plaintext", "snapshot", id, "err", err)
		}
	} else if err := os.Rename(dir, s.opened(id)); err != nil {
		_ = os.RemoveAll(dir)
	} else {
		s.useOpened(id)
	}
	return m, nil
}

// commitFiles checks a commit's id and manifest and returns the names of the
// regular files in dir, sorted. Errors: a bad id, a manifest of another id,
// dir unreadable or without a file.
func commitFiles(id string, m snapshot.Manifest, dir string) ([]string, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	if m.ID != id {
		return nil, fmt.Errorf("snapshot %s: manifest id %q differs", id, m.ID)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("snapshot %s: commit: no files staged", id)
	}
	sort.Strings(names)
	return names, nil
}

// putChunk stores one chunk through pw unless it is all zeros or already
// stored: in the backend, or with async in the outbox (unless the backend has
// it). id, when set, is data's address (sha256, or keyed: seal.go) already known from its key match with a
// parent chunk (parent.go).
func (s *Store) putChunk(ctx context.Context, st *commitState, pw *packWriter, data []byte, async bool, id string) (chunkRef, error) {
	ref := chunkRef{Len: int64(len(data)), ID: id}
	if id == "" {
		if allZero(data) {
			return ref, nil
		}
		ref.ID = s.key.address(data)
	}
	s.idx.pin(ref.ID)
	st.mu.Lock()
	st.pinned = append(st.pinned, ref.ID)
	st.mu.Unlock()
	s.idx.mu.Lock()
	l, ok := s.idx.storedLocked(ref.ID, async)
	s.idx.mu.Unlock()
	if ok {
		ref.Stored = l.Len
		return ref, nil
	}
	if z, ok := pw.has(ref.ID); ok {
		ref.Stored = z
		return ref, nil
	}
	// A chunk that looks random is framed raw, not compressed (rawframe.go);
	// without a key straight into the pack (one copy of its bytes, not two).
	// Others are compressed into a pooled buffer that the pack copies: a
	// fresh buffer per chunk was a third of a first commit's CPU (allocation,
	// clearing, and the pack's growth by append).
	raw := incompressible(data)
	fill := func(dst []byte) []byte { return appendRawFrame(dst, data) }
	if !raw || s.key != nil {
		buf := compBufs.Get().(*[]byte)
		defer compBufs.Put(buf)
		var comp []byte
		if raw {
			comp = appendRawFrame((*buf)[:0], data)
		} else {
			comp = s.enc.EncodeAll(data, (*buf)[:0])
		}
		*buf = comp[:0]
		if s.key != nil {
			comp = s.key.sealChunk(ref.ID, comp)
		}
		fill = func(dst []byte) []byte { return append(dst, comp...) }
	}
	stored, added, err := pw.addWith(ctx, ref.ID, fill)
	ref.Stored = stored
	if err != nil || !added {
		return ref, err
	}
	st.mu.Lock()
	st.newBytes += ref.Stored
	st.mu.Unlock()
	// Not cached: the committed files stay on this host as the opened copy,
	// which is what the next resume reads; filling the cache here measurably
	// slowed that resume (background writes on two cores, +40–60 ms at 64 MiB).
	return ref, nil
}

// compBufs holds buffers of maxStored bytes for putChunk's compressed chunks.
var compBufs = sync.Pool{New: func() any { b := make([]byte, 0, maxStored); return &b }}

// mapStaged maps the file at path read-only and shared; an empty file is nil.
// The caller unmaps it (syscall.Munmap) once no slice of it is in use.
func mapStaged(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() == 0 {
		return nil, err
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(st.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", path, err)
	}
	return data, nil
}
