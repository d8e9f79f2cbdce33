// Package chunked is the deduplicating snapshot store: every snapshot file is cut
// into content-defined chunks (see chunker.go), each chunk is stored once under
// the sha256 of its content, zstd-compressed, in packs (pack.go) in a durable
// Backend (the local filesystem, or an S3-compatible object store), and a
// manifest lists every file's chunks in order. A second hibernate of the same sandbox writes only the
// chunks that changed (a diff snapshot); forks of one template share chunks.
//
// # Layout
//
// In the backend:
//
//	packs/<p[:2]>/<p>           a pack: zstd frames of chunks; chunk id = sha256(bytes)
//	index/<p>.json              the pack's chunks: id, offset, stored length
//	chunks/<id[:2]>/<id>        a loose chunk (stores written before packs)
//	manifests/<snapshot>.json   the commit record, written last
//
// On local disk under Config.Dir:
//
//	staging/<snapshot>/   a snapshot being written by the engine
//	open/<snapshot>/      plain files of a committed snapshot, what Open returns
//	                      (runsc restore needs plain files); rebuilt from chunks
//	                      whenever missing or failing verification
//	cache/                the chunk cache (Config.CacheBytes, LRU) in front of a
//	                      remote backend
//	outbox/               snapshots committed asynchronously and not yet uploaded:
//	                      a filesystem backend with their new packs and manifests
//
// # Commit and durability
//
// Commit hashes and stores every chunk the backend does not hold yet (into
// packs), makes them durable (fsync for the filesystem backend; an S3 PUT is
// durable when it returns), then writes the manifest. A snapshot exists once its manifest exists;
// a failed Commit leaves the staging directory untouched, so it can be retried.
//
// CommitAsync does the same work against the local outbox instead (chunks the
// backend already holds are not copied) and returns once the outbox is synced:
// the snapshot exists and opens from this host, but Durable reports false. A
// background upload copies the outbox's packs to the backend, then the
// manifest, then removes them from the outbox; a failure is retried from the
// outbox with exponential backoff (1 s doubling to 15 s) for as long as it takes,
// across restarts. A snapshot being uploaded reads its chunks from the outbox;
// one whose outbox copy is lost before the upload is refused by Open, naming the
// missing chunk.
//
// # Verification
//
// Open re-hashes every chunk of the snapshot: from open/<snapshot> when present
// (warm), otherwise while reassembling it from the cache or the backend (cold,
// four parallel fetches). A chunk that fails in the cache is dropped and fetched
// again from the backend; one that fails in the backend fails Open with a
// *snapshot.CorruptError naming the snapshot, the file and the chunk id.
//
// # Garbage collection
//
// Delete removes a manifest; Collect deletes packs none of whose chunks a live
// manifest references (and loose chunks no manifest references). Collect is safe against concurrent Commits in this process: every
// chunk a Commit uses is pinned in memory from before the Commit checks whether
// the chunk exists until its manifest is written, pins released while a
// collection runs stay protected until it ends, and a Commit that needs a chunk
// Collect is deleting waits for the deletion and uploads it again. Several hosts
// sharing one bucket would need a lease on top of this (not built).
package chunked

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/torpor/torpor/snapshot"
)

// Config configures a Store.
type Config struct {
	// Dir holds staging, the opened snapshots and the chunk cache.
	Dir string
	// Backend is the durable tier; nil = a filesystem backend in Dir/store.
	Backend Backend
	// CacheBytes bounds the local chunk cache; 0 = no cache (right for the
	// filesystem backend, which is local already).
	CacheBytes int64
	// Workers is the number of parallel chunk uploads/fetches (default 4 for the
	// filesystem backend, 16 for others).
	Workers int
	// AutoGC runs Collect in the background after Delete, once no Delete came
	// for GCQuiet (default 5 s), so a collection does not compete for the CPU
	// with the resume or hibernate that usually follows a delete. Close stops it.
	AutoGC  bool
	GCQuiet time.Duration
	// UploadRetry is the first delay before a failed asynchronous upload is
	// retried; it doubles up to 15 s (maxUploadRetry). Default 1 s.
	UploadRetry time.Duration
	// OpenBytes bounds the opened copies (open/<id>: each live snapshot's
	// files, uncompressed, kept for warm resumes and as diff parents): above
	// it the least recently used copies not used for a minute are removed
	// (opened.go). 0: no bound.
	OpenBytes int64
	// ReadOnly is for tools that inspect a store a server owns: no background
	// upload runs.
	ReadOnly bool
	Logger   *slog.Logger
}

// Store implements snapshot.Store on chunks.
type Store struct {
	dir     string
	b       Backend
	cache   *Cache
	fill    *cacheFiller // fills cache in the background (nil without a cache)
	workers int
	enc     *zstd.Encoder
	dec     *zstd.Decoder
	log     *slog.Logger

	mu sync.Mutex
	// known: the backend's chunks and packs (loaded from its indexes).
	known *packSet
	// knownLoaded: known holds a full listing of the backend (New could reach it).
	knownLoaded bool
	pins        map[string]int
	deleting    map[string]chan struct{}
	gcActive    bool
	protected   map[string]bool
	opening     map[string]*sync.Mutex

	gcMu    sync.Mutex
	gcQuiet time.Duration
	gcKick  chan struct{}
	gcDone  chan struct{}
	closed  chan struct{}

	// outbox holds asynchronously committed snapshots until they are uploaded;
	// outKnown (under mu) lists its chunks and packs. uploadMu orders an
	// upload's manifest step against Delete.
	outbox   *FS
	outKnown *packSet
	// suspects (under mu): backend copies of chunks found damaged or missing
	// (Store.suspect).
	suspects map[string]chunkLoc
	// outGen (under mu) counts manifests written to the outbox.
	outGen uint64
	// loadMu makes loadKnown single-flight: a Collect never runs beside a
	// load that could merge back a pack it deleted.
	loadMu   sync.Mutex
	uploadMu sync.Mutex
	upKick   chan struct{}
	upDone   chan struct{}
	// docs caches the parsed manifests of the last docCacheLen snapshots this
	// process committed or opened (immutable once committed): parsing the
	// manifest of a 512 MiB snapshot (33 k chunks, 3 MB of JSON) is part of
	// every warm Open otherwise.
	docMu    sync.Mutex
	docs     map[string]doc
	docOrder []string
	// lastReused is the number of chunks the last commit named by their key
	// match with a parent chunk (tests).
	lastReused atomic.Int64

	// upRetry is the first delay before retrying a failed upload (Config.UploadRetry).
	upRetry time.Duration
	// openCopies tracks the opened copies for Config.OpenBytes (opened.go).
	openCopies *openedSet
}

var _ snapshot.Store = (*Store)(nil)
var _ snapshot.Verifier = (*Store)(nil)

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)

func checkID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("snapshot id %q: invalid", id)
	}
	return nil
}

// New opens a store. It lists the backend's chunks once, to know which exist.
func New(ctx context.Context, cfg Config) (*Store, error) {
	abs, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{"staging", "open"} {
		if err := os.MkdirAll(filepath.Join(abs, d), 0o700); err != nil {
			return nil, fmt.Errorf("snapshot store %s: %w", abs, err)
		}
	}
	s := &Store{dir: abs, b: cfg.Backend, workers: cfg.Workers, log: cfg.Logger,
		known: newPackSet(), pins: map[string]int{}, deleting: map[string]chan struct{}{}, opening: map[string]*sync.Mutex{},
		closed: make(chan struct{}), outKnown: newPackSet(),
		upKick: make(chan struct{}, 1), upDone: make(chan struct{}), upRetry: cfg.UploadRetry}
	openLimit := cfg.OpenBytes
	if cfg.ReadOnly {
		openLimit = 0 // the server owning the store trims its copies
	}
	s.scanOpened(openLimit)
	if s.upRetry <= 0 {
		s.upRetry = time.Second
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.b == nil {
		if s.b, err = NewFS(filepath.Join(abs, "store")); err != nil {
			return nil, err
		}
	}
	if s.workers <= 0 {
		// Local disk saturates the CPUs with a few; an object store is latency
		// bound (one request per chunk) and needs more requests in flight.
		s.workers = 4
		if _, local := s.b.(*FS); !local {
			s.workers = 16
		}
	}
	if cfg.CacheBytes > 0 {
		if s.cache, err = NewCache(filepath.Join(abs, "cache"), cfg.CacheBytes); err != nil {
			return nil, err
		}
		s.fill = newCacheFiller(s.cache)
	}
	s.enc, _ = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)))
	s.dec, _ = zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(1<<26))
	if s.outbox, err = NewFS(filepath.Join(abs, "outbox")); err != nil {
		return nil, err
	}
	if err := s.loadOutbox(ctx); err != nil {
		return nil, err
	}
	if s3b, ok := s.b.(*S3); ok && s3b.unreachable {
		s.log.Warn("snapshot store: backend unreachable at start; it is listed before the next upload or synchronous commit")
	} else if err := s.loadKnown(ctx); err != nil {
		if _, local := s.b.(*FS); local {
			return nil, err
		}
		// Start anyway: snapshots open from local copies and commit
		// asynchronously; the listing is retried before the next upload or
		// synchronous commit.
		s.log.Warn("snapshot store: backend unreachable at start", "err", err)
	}
	if !cfg.ReadOnly {
		go s.uploadLoop()
	} else {
		close(s.upDone)
	}
	if cfg.AutoGC {
		s.gcKick = make(chan struct{}, 1)
		s.gcQuiet = cfg.GCQuiet
		if s.gcQuiet <= 0 {
			s.gcQuiet = 5 * time.Second
		}
		s.gcDone = make(chan struct{})
		go s.gcLoop()
	}
	return s, nil
}

// Backend returns the store's durable backend.
func (s *Store) Backend() Backend { return s.b }

// Cache returns the chunk cache (nil without one).
func (s *Store) Cache() *Cache { return s.cache }

// Close stops the background GC. The store is not usable afterwards.
func (s *Store) Close() error {
	select {
	case <-s.closed:
		return nil
	default:
	}
	close(s.closed)
	if s.gcDone != nil {
		<-s.gcDone
	}
	<-s.upDone
	if s.fill != nil {
		s.fill.close()
	}
	return nil
}

// loadKnown reads the backend's pack indexes (and lists its loose chunks) into
// known, merging: entries added meanwhile stay.
func (s *Store) loadKnown(ctx context.Context) error {
	s.loadMu.Lock()
	defer s.loadMu.Unlock()
	set, err := loadPacks(ctx, s.b, s.workers, s.log)
	if err != nil {
		return fmt.Errorf("snapshot store: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, entries := range set.packs {
		if _, ok := s.known.packs[id]; !ok {
			s.known.packs[id] = entries
		}
	}
	for id, l := range set.locs {
		if _, ok := s.known.locs[id]; !ok {
			s.known.locs[id] = l
		}
	}
	for id, alts := range set.alt {
		if _, ok := s.known.alt[id]; !ok {
			s.known.alt[id] = alts
		}
	}
	s.knownLoaded = true
	return nil
}

// ensureKnown lists the backend once if New could not.
func (s *Store) ensureKnown(ctx context.Context) error {
	s.mu.Lock()
	ok := s.knownLoaded
	s.mu.Unlock()
	if ok {
		// A load that started before knownLoaded was set may still run: wait
		// for it (loadMu), so it cannot merge stale entries back later.
		s.loadMu.Lock()
		s.loadMu.Unlock()
		return nil
	}
	return s.loadKnown(ctx)
}

// loadOutbox reads the outbox's packs into outKnown; only New calls it.
func (s *Store) loadOutbox(ctx context.Context) error {
	set, err := loadPacks(ctx, s.outbox, s.workers, s.log)
	if err != nil {
		return fmt.Errorf("snapshot store: outbox: %w", err)
	}
	s.outKnown = set
	return nil
}

func chunkKey(id string) string    { return "chunks/" + id[:2] + "/" + id }
func manifestKey(id string) string { return "manifests/" + id + ".json" }
func (s *Store) staged(id string) string {
	return filepath.Join(s.dir, "staging", id)
}
func (s *Store) opened(id string) string { return filepath.Join(s.dir, "open", id) }

// doc is the manifest object stored in the backend.
type doc struct {
	Format   int               `json:"format"`
	Chunking string            `json:"chunking"`
	Manifest snapshot.Manifest `json:"manifest"`
	Files    []fileChunks      `json:"chunks"`
	// keys[file][chunk] are the chunk keys (fingerprint), known in memory
	// for snapshots this process committed or verified; not stored.
	keys [][]chunkSum
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
	if ok || pending {
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

// pin marks chunk id as used by an in-progress commit, waiting for a deletion of
// it by Collect to finish first.
func (s *Store) pin(id string) {
	s.mu.Lock()
	for {
		ch, ok := s.deleting[id]
		if !ok {
			break
		}
		s.mu.Unlock()
		<-ch
		s.mu.Lock()
	}
	s.pins[id]++
	s.mu.Unlock()
}

func (s *Store) unpin(ids []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		if s.pins[id]--; s.pins[id] <= 0 {
			delete(s.pins, id)
		}
		if s.gcActive {
			s.protected[id] = true
		}
	}
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
	s.mu.Lock()
	for _, m := range matched {
		ref := &sg.refs[m.i]
		if _, ok := s.deleting[ref.ID]; ok {
			slow = append(slow, m)
			continue
		}
		s.pins[ref.ID]++
		ids = append(ids, ref.ID)
		l, ok := s.storedLocked(ref.ID, async)
		if !ok {
			slow = append(slow, m)
			continue
		}
		ref.Stored = l.Len
	}
	s.mu.Unlock()
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
func (s *Store) Commit(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	return s.commit(ctx, id, m, false)
}

// CommitAsync implements snapshot.AsyncStore: it returns once the snapshot is in
// the local outbox (synced); the upload to the backend follows in the background.
func (s *Store) CommitAsync(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	return s.commit(ctx, id, m, true)
}

func (s *Store) commit(ctx context.Context, id string, m snapshot.Manifest, async bool) (snapshot.Manifest, error) {
	tStart := time.Now()
	if err := checkID(id); err != nil {
		return m, err
	}
	if m.ID != id {
		return m, fmt.Errorf("snapshot %s: manifest id %q differs", id, m.ID)
	}
	if !async {
		if err := s.ensureKnown(ctx); err != nil {
			return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
		}
	}
	dir := s.staged(id)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() {
			names = append(names, e.Name())
		}
	}
	if len(names) == 0 {
		return m, fmt.Errorf("snapshot %s: commit: no files staged", id)
	}
	sort.Strings(names)

	st := &commitState{}
	kick := false
	defer func() {
		s.unpin(st.pinned)
		if kick { // after unpinning: the upload drops what no snapshot needs
			s.kickUpload()
		}
	}()
	d := doc{Format: 1, Chunking: chunkingTag, Files: make([]fileChunks, len(names)), keys: make([][]chunkSum, len(names))}
	par := s.openParent(m.Parent)
	var target Backend = s.b
	set := s.known
	if async {
		target, set = s.outbox, s.outKnown
	}
	pw := s.newPackWriter(target, set)
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
	var next atomic.Int64
	var wg sync.WaitGroup
	kind := "first"
	if par != nil {
		kind = "diff"
	}
	for w := 0; w < min(s.workers, len(segs)); w++ {
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
		if sy, ok := s.b.(Syncer); ok {
			if err := sy.Sync(ctx); err != nil {
				return m, fmt.Errorf("snapshot %s: commit: sync: %w", id, err)
			}
		}
	}
	if sy, ok := target.(Syncer); ok {
		if err := sy.Sync(ctx); err != nil {
			return m, fmt.Errorf("snapshot %s: commit: sync: %w", id, err)
		}
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
	b, err := json.Marshal(d)
	if err != nil {
		return m, err
	}
	if err := target.Put(ctx, manifestKey(id), bytes.NewReader(b), int64(len(b))); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: manifest: %w", id, err)
	}
	if async {
		// Before the unpin: an outbox clean-up that listed the pending
		// manifests before this one must not act on that list.
		s.mu.Lock()
		s.outGen++
		s.mu.Unlock()
	}
	s.rememberDoc(id, d)
	kick = async
	s.log.Debug("snapshot commit", "snapshot", id, "async", async, "chunk_ms", tHashed.Sub(tStart).Milliseconds(),
		"sync_ms", tSynced.Sub(tHashed).Milliseconds(), "manifest_ms", time.Since(tSynced).Milliseconds(),
		"chunks", m.Chunks, "from_parent_copy", st.reused.Load(), "new_bytes", m.NewBytes)
	s.lastReused.Store(st.reused.Load())
	// Committed. The staged files become the opened copy (verified on Open).
	_ = os.RemoveAll(s.opened(id))
	if err := os.Rename(dir, s.opened(id)); err != nil {
		_ = os.RemoveAll(dir)
	} else {
		s.useOpened(id)
	}
	return m, nil
}

// storedLocked returns where chunk id is stored for a commit: in the durable
// tier unless that copy is a suspect (Store.suspect: store it again), or with
// async in the outbox. The caller holds s.mu.
func (s *Store) storedLocked(id string, async bool) (chunkLoc, bool) {
	l, ok := s.known.locs[id]
	if bad, suspect := s.suspects[id]; ok && suspect && bad == l {
		ok = false
	}
	if !ok && async {
		l, ok = s.outKnown.locs[id]
	}
	return l, ok
}

// putChunk stores one chunk through pw unless it is all zeros or already
// stored: in the backend, or with async in the outbox (unless the backend has
// it). id, when set, is data's sha256 already known from its key match with a
// parent chunk (parent.go).
func (s *Store) putChunk(ctx context.Context, st *commitState, pw *packWriter, data []byte, async bool, id string) (chunkRef, error) {
	ref := chunkRef{Len: int64(len(data)), ID: id}
	if id == "" {
		if allZero(data) {
			return ref, nil
		}
		ref.ID = sha256Hex(data)
	}
	s.pin(ref.ID)
	st.mu.Lock()
	st.pinned = append(st.pinned, ref.ID)
	st.mu.Unlock()
	s.mu.Lock()
	l, ok := s.storedLocked(ref.ID, async)
	s.mu.Unlock()
	if ok {
		ref.Stored = l.Len
		return ref, nil
	}
	if z, ok := pw.has(ref.ID); ok {
		ref.Stored = z
		return ref, nil
	}
	comp := s.enc.EncodeAll(data, make([]byte, 0, len(data)+64))
	ref.Stored = int64(len(comp))
	added, err := pw.add(ctx, ref.ID, comp)
	if err != nil {
		return ref, err
	}
	if !added {
		return ref, nil
	}
	st.mu.Lock()
	st.newBytes += ref.Stored
	st.mu.Unlock()
	// Not cached: the committed files stay on this host as the opened copy,
	// which is what the next resume reads; filling the cache here measurably
	// slowed that resume (background writes on two cores, +40–60 ms at 64 MiB).
	return ref, nil
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
	if err := json.Unmarshal(b, &d); err != nil {
		return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: err.Error()}
	}
	if d.Format != 1 || d.Manifest.ID != id || len(d.Files) != len(d.Manifest.Files) {
		return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "inconsistent manifest"}
	}
	for i, fc := range d.Files {
		if fc.Name != d.Manifest.Files[i].Name || treeHash(fc.Chunks) != d.Manifest.Files[i].SHA256 ||
			strings.ContainsAny(fc.Name, "/\x00") || fc.Name == "." || fc.Name == ".." {
			return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "chunk list of " + fc.Name + " does not match its digest"}
		}
	}
	return d, nil
}

// Manifest implements snapshot.Store. A manifest this process committed or
// opened comes from memory: read and checked from disk, a 512 MiB snapshot's
// (~33,000 chunks, ~3 MB of JSON) took ~30 ms, which every resume paid
// (bench.BenchmarkStore: the proxy's resume 30–36 ms longer than the
// manager's own, 2026-11-30). Manifests never change once committed.
func (s *Store) Manifest(ctx context.Context, id string) (snapshot.Manifest, error) {
	if d, ok := s.cachedDoc(id); ok {
		return d.Manifest, nil
	}
	d, err := s.readDoc(ctx, id)
	return d.Manifest, err
}

// List implements snapshot.Store.
func (s *Store) List(ctx context.Context) ([]string, error) {
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
	for _, o := range append(pending, objs...) {
		if id, ok := strings.CutSuffix(path.Base(o.Key), ".json"); ok && checkID(id) == nil && !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids, nil
}

// Delete implements snapshot.Store. The chunks stay until Collect finds them
// unreferenced.
func (s *Store) Delete(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	s.forgetDoc(id)
	s.dropOpened(id)
	// uploadMu: an upload in flight must not write the manifest back afterwards.
	// The backend's manifest goes first: while the backend cannot be reached
	// the snapshot stays whole (one waiting for its upload keeps its outbox
	// manifest, so it is still listed and reported not durable) and the
	// caller can try again; removing the outbox's first left a snapshot that
	// was nowhere yet reported durable.
	s.uploadMu.Lock()
	pd, perr := s.readOutboxDoc(ctx, id)
	err := s.b.Delete(ctx, manifestKey(id))
	if err == nil {
		err = s.outbox.Delete(ctx, manifestKey(id))
	}
	s.uploadMu.Unlock()
	if err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	s.forgetDoc(id) // again: an Open meanwhile may have read it back
	if perr == nil {
		s.dropOutboxChunks(ctx, pd)
	}
	if sy, ok := s.b.(Syncer); ok {
		_ = sy.Sync(ctx)
	}
	if err := os.RemoveAll(s.opened(id)); err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	if err := os.RemoveAll(s.staged(id)); err != nil {
		return err
	}
	if s.gcKick != nil {
		select {
		case s.gcKick <- struct{}{}:
		default:
		}
	}
	return nil
}

// Recover implements snapshot.Store: it empties staging and removes opened copies
// and half-built directories of snapshots without a manifest.
func (s *Store) Recover(ctx context.Context) error {
	if err := os.RemoveAll(filepath.Join(s.dir, "staging")); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(s.dir, "staging"), 0o700); err != nil {
		return err
	}
	if fsb, ok := s.b.(*FS); ok {
		fsb.CleanTemp()
	}
	s.outbox.CleanTemp()
	if err := s.cleanOutbox(ctx); err != nil {
		return err
	}
	ids, err := s.List(ctx)
	if err != nil {
		if _, local := s.b.(*FS); local {
			return err
		}
		// Keep every opened copy: without the backend's list, which are dead is
		// unknown, and a copy may be all there is of a pending snapshot.
		s.log.Warn("snapshot store: backend unreachable at start; opened copies kept", "err", err)
		return nil
	}
	live := map[string]bool{}
	for _, id := range ids {
		live[id] = true
	}
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		if !live[e.Name()] {
			_ = os.RemoveAll(filepath.Join(s.dir, "open", e.Name()))
		}
	}
	return nil
}

func (s *Store) openLock(id string) func() {
	s.mu.Lock()
	l, ok := s.opening[id]
	if !ok {
		l = &sync.Mutex{}
		s.opening[id] = l
	}
	s.mu.Unlock()
	l.Lock()
	return l.Unlock
}

// Open implements snapshot.Store.
func (s *Store) Open(ctx context.Context, id string) (string, snapshot.Manifest, error) {
	d, ok := s.cachedDoc(id)
	if !ok {
		var err error
		if d, err = s.readDoc(ctx, id); err != nil {
			return "", d.Manifest, err
		}
		s.rememberDoc(id, d)
	}
	unlock := s.openLock(id)
	defer unlock()
	dir := s.opened(id)
	if _, err := os.Stat(dir); err == nil {
		if keys, err := s.verifyDir(ctx, id, dir, d); err == nil {
			if d.keys == nil {
				d.keys = keys
				s.rememberDoc(id, d)
			}
			s.useOpened(id)
			return dir, d.Manifest, nil
		} else if ctx.Err() != nil {
			return "", d.Manifest, err
		} else {
			// The local copy is only a copy: set it aside (a restore may still
			// read the old files) and rebuild it from the chunks.
			s.log.Warn("snapshot copy failed verification; rebuilding from chunks", "snapshot", id, "err", err)
			s.dropOpened(id)
			trash := filepath.Join(s.dir, "open", ".trash-"+id+"-"+rnd())
			if err := os.Rename(dir, trash); err != nil {
				return "", d.Manifest, err
			}
			_ = os.RemoveAll(trash)
		}
	}
	build := filepath.Join(s.dir, "open", ".build-"+id+"-"+rnd())
	keys, err := s.assemble(ctx, id, build, d, true)
	if err != nil {
		_ = os.RemoveAll(build)
		return "", d.Manifest, err
	}
	if err := os.Rename(build, dir); err != nil {
		_ = os.RemoveAll(build)
		return "", d.Manifest, err
	}
	// The rebuilt copy holds verified chunks whose keys assemble computed
	// from the bytes it wrote: the next commit may match against them.
	if d.keys == nil {
		d.keys = keys
		s.rememberDoc(id, d)
	}
	s.useOpened(id)
	return dir, d.Manifest, nil
}

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

// Verify reads every chunk of snapshot id from the durable backend (not the
// cache, not the opened copy; a snapshot still waiting for its upload reads the
// chunks the backend lacks from the outbox) and checks its hash.
func (s *Store) Verify(ctx context.Context, id string) (snapshot.Manifest, error) {
	d, err := s.readDoc(ctx, id)
	if err != nil {
		return d.Manifest, err
	}
	_, err = s.assemble(ctx, id, "", d, false)
	return d.Manifest, err
}

const docCacheLen = 16

func (s *Store) cachedDoc(id string) (doc, bool) {
	s.docMu.Lock()
	defer s.docMu.Unlock()
	d, ok := s.docs[id]
	return d, ok
}

func (s *Store) rememberDoc(id string, d doc) {
	s.docMu.Lock()
	defer s.docMu.Unlock()
	if s.docs == nil {
		s.docs = map[string]doc{}
	}
	if _, ok := s.docs[id]; !ok {
		s.docOrder = append(s.docOrder, id)
	}
	s.docs[id] = d
	for len(s.docOrder) > docCacheLen {
		delete(s.docs, s.docOrder[0])
		s.docOrder = s.docOrder[1:]
	}
}

func (s *Store) forgetDoc(id string) {
	s.docMu.Lock()
	defer s.docMu.Unlock()
	delete(s.docs, id)
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func rnd() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// A fetch is a run of chunks of one file that one ranged read of one pack
// returns (up to fetchSpan bytes, fetchMax chunks): what makes a cold resume
// from S3 a few hundred requests instead of one per chunk.
const (
	fetchSpan = 4 << 20
	fetchMax  = 512
)

type fetch struct {
	file int
	f    *os.File
	offs []int64 // file offsets
	refs []chunkRef
	tier Backend // nil: the chunk is nowhere known
	locs []chunkLoc
	keys []*chunkSum // with f: where each chunk's key (fingerprint) goes
}

// locate returns the tier holding chunk cid (the outbox first: a snapshot
// waiting for its upload) and where in it.
func (s *Store) locate(cid string) (Backend, chunkLoc, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.outKnown.locs[cid]; ok {
		return s.outbox, l, true
	}
	if l, ok := s.known.locs[cid]; ok {
		return s.b, l, true
	}
	return nil, chunkLoc{}, false
}

// assemble fetches and verifies every chunk of d; with dir != "" it writes the
// files there. useCache selects reading through the chunk cache.
func (s *Store) assemble(ctx context.Context, id, dir string, d doc, useCache bool) ([][]chunkSum, error) {
	var keys [][]chunkSum
	if dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		keys = make([][]chunkSum, len(d.Files))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	fetches := make(chan *fetch, 4*s.workers)
	var firstErr error
	var once sync.Once
	fail := func(err error) { once.Do(func() { firstErr = err; cancel() }) }
	var wg sync.WaitGroup
	for w := 0; w < s.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ft := range fetches {
				if ctx.Err() != nil {
					continue
				}
				if err := s.runFetch(ctx, id, d.Files[ft.file].Name, ft, useCache); err != nil {
					fail(err)
				}
			}
		}()
	}
	func() {
		defer close(fetches)
		reloaded := false
		var cur *fetch
		var lo, hi int64
		emit := func() bool {
			if cur == nil {
				return true
			}
			select {
			case fetches <- cur:
				cur = nil
				return true
			case <-ctx.Done():
				return false
			}
		}
		for fi, fc := range d.Files {
			var f *os.File
			if dir != "" {
				var err error
				f, err = os.OpenFile(filepath.Join(dir, fc.Name), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
				if err != nil {
					fail(err)
					return
				}
				files = append(files, f)
				if err := f.Truncate(d.Manifest.Files[fi].Bytes); err != nil {
					fail(err)
					return
				}
			}
			if keys != nil {
				keys[fi] = make([]chunkSum, len(fc.Chunks))
			}
			var off int64
			for j, r := range fc.Chunks {
				if r.ID == "" {
					if keys != nil {
						keys[fi][j] = zeroKey(r.Len)
					}
					off += r.Len
					continue
				}
				tier, l, ok := s.locate(r.ID)
				if !ok && !reloaded {
					// The backend could not be listed at start: list it now.
					reloaded = true
					if err := s.ensureKnown(ctx); err != nil {
						fail(fmt.Errorf("snapshot %s: %w", id, err))
						return
					}
					tier, l, ok = s.locate(r.ID)
				}
				joins := cur != nil && ok && cur.tier == tier && l.Pack != "" && cur.locs[0].Pack == l.Pack &&
					cur.file == fi && len(cur.refs) < fetchMax && max(hi, l.Off+l.Len)-min(lo, l.Off) <= fetchSpan
				if !joins {
					if !emit() {
						return
					}
					cur = &fetch{file: fi, f: f, tier: tier}
					lo, hi = l.Off, l.Off+l.Len
				}
				lo, hi = min(lo, l.Off), max(hi, l.Off+l.Len)
				cur.offs = append(cur.offs, off)
				cur.refs = append(cur.refs, r)
				cur.locs = append(cur.locs, l)
				if keys != nil {
					cur.keys = append(cur.keys, &keys[fi][j])
				}
				if l.Pack == "" || tier == nil {
					if !emit() {
						return
					}
				}
				off += r.Len
			}
		}
		emit()
	}()
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	return keys, ctx.Err()
}

// runFetch gets the chunks of ft (from the cache when allowed and valid, else
// with one ranged read of their pack), verifies them and writes them to ft.f.
func (s *Store) runFetch(ctx context.Context, snap, file string, ft *fetch, useCache bool) error {
	corrupt := func(i int, reason string) error {
		return &snapshot.CorruptError{Snapshot: snap, File: file,
			Reason: fmt.Sprintf("chunk %s at offset %d: %s", ft.refs[i].ID, ft.offs[i], reason)}
	}
	missing := func(i int) error {
		if ok, _ := s.outbox.Exists(ctx, manifestKey(snap)); ok {
			return corrupt(i, "missing: the snapshot is not durable yet (its upload is pending) and neither its local copy nor the backend has this chunk")
		}
		return corrupt(i, "missing")
	}
	out := make([][]byte, len(ft.refs))
	var miss []int
	for i, r := range ft.refs {
		if useCache && s.cache != nil {
			if comp, ok := s.cache.Get(r.ID); ok {
				if data, err := s.decode(comp, r); err == nil {
					out[i] = data
					continue
				}
				s.cache.Remove(r.ID)
			}
		}
		miss = append(miss, i)
	}
	if len(miss) > 0 && ft.tier == nil {
		return missing(miss[0])
	}
	var span []byte
	var lo int64
	var spanErr error // the pack's range is missing from the backend
	if len(miss) > 0 && ft.locs[0].Pack != "" {
		hi := int64(0)
		lo = ft.locs[miss[0]].Off
		for _, i := range miss {
			lo, hi = min(lo, ft.locs[i].Off), max(hi, ft.locs[i].Off+ft.locs[i].Len)
		}
		var err error
		if span, err = ft.tier.GetRange(ctx, packKey(ft.locs[0].Pack), lo, hi-lo); err != nil {
			if !isMissing(err) {
				return fmt.Errorf("snapshot %s: chunk %s: %w", snap, ft.refs[miss[0]].ID, err)
			}
			span = nil
			if ft.tier == Backend(s.b) {
				spanErr = err
			} // else the outbox lost it: the backend, chunk by chunk
		}
	}
	for _, i := range miss {
		r, l := ft.refs[i], ft.locs[i]
		var comp []byte
		var err error
		switch {
		case span != nil:
			comp = span[l.Off-lo : l.Off-lo+l.Len]
		case spanErr != nil:
			err = spanErr
		case l.Pack == "": // a loose chunk (stores written before packs)
			comp, err = readStored(ctx, ft.tier, r.ID, l)
			if isMissing(err) && ft.tier != Backend(s.b) {
				comp, err = s.fromBackend(ctx, r.ID)
			}
		default: // the outbox lost the pack
			comp, err = s.fromBackend(ctx, r.ID)
		}
		if err != nil && !isMissing(err) {
			return fmt.Errorf("snapshot %s: chunk %s: %w", snap, r.ID, err)
		}
		var data []byte
		if err == nil {
			data, err = s.decode(comp, r)
			if err != nil && ft.tier != Backend(s.b) {
				// A damaged outbox copy: the backend may hold the chunk too.
				if c, berr := s.fromBackend(ctx, r.ID); berr == nil {
					comp = c
					data, err = s.decode(comp, r)
				}
			}
		}
		if err != nil && ft.tier == Backend(s.b) {
			// Another copy of the chunk, if the backend has one; else the next
			// commit that has the chunk's bytes stores it again (suspect).
			if d, c, ok := s.fromAlternative(ctx, r, l); ok {
				data, comp, err = d, c, nil
			} else {
				s.suspect(r.ID, l)
			}
		}
		if isMissing(err) {
			if spanErr != nil { // the rest of the run is in the same lost range
				for _, j := range miss {
					s.suspect(ft.refs[j].ID, ft.locs[j])
				}
			}
			return missing(i)
		}
		if err != nil {
			return corrupt(i, err.Error())
		}
		out[i] = data
		if useCache && s.cache != nil {
			s.fill.put(r.ID, bytes.Clone(comp)) // comp may share a span of the pack
		}
	}
	if ft.f != nil {
		for i, data := range out {
			if _, err := ft.f.WriteAt(data, ft.offs[i]); err != nil {
				return err
			}
			if ft.keys != nil {
				*ft.keys[i] = fingerprint(data)
			}
		}
	}
	return nil
}

// suspect records that the backend's copy of chunk cid at l is damaged or
// missing. The location stays (the damage may be mended, or the error
// transient: the next resume tries it again), but the next commit that has the
// chunk's bytes (a hibernate of a sandbox still holding them) stores it again
// instead of deduplicating against it. The new copy becomes the chunk's
// location and the old one an alternative, which repairs every snapshot that
// references the chunk, as manifests name chunks, not places. Kept in memory
// only: after a restart a read that fails tries the alternatives.
func (s *Store) suspect(cid string, l chunkLoc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cur, ok := s.known.locs[cid]; !ok || cur != l {
		return
	}
	if s.suspects == nil {
		s.suspects = map[string]chunkLoc{}
	}
	if _, seen := s.suspects[cid]; !seen {
		s.log.Warn("snapshot store: damaged or missing chunk; the next commit that has its bytes stores it again",
			"chunk", cid, "pack", l.Pack)
	}
	s.suspects[cid] = l
}

// fromAlternative reads chunk r from a copy in the backend other than bad (an
// alternative, or its current location if it moved since it was looked up)
// and verifies it; that copy becomes the chunk's location.
func (s *Store) fromAlternative(ctx context.Context, r chunkRef, bad chunkLoc) (data, comp []byte, ok bool) {
	s.mu.Lock()
	alts := append([]chunkLoc(nil), s.known.alt[r.ID]...)
	if cur, ok := s.known.locs[r.ID]; ok && cur != bad {
		alts = append(alts, cur) // moved meanwhile (repack)
	}
	s.mu.Unlock()
	for _, a := range alts {
		if a == bad {
			continue
		}
		c, err := readStored(ctx, s.b, r.ID, a)
		if err != nil {
			continue
		}
		d, err := s.decode(c, r)
		if err != nil {
			continue
		}
		s.mu.Lock()
		if cur, ok := s.known.locs[r.ID]; ok && cur == bad {
			s.known.locs[r.ID] = a
			kept := s.known.alt[r.ID][:0]
			for _, x := range s.known.alt[r.ID] {
				if x != a {
					kept = append(kept, x)
				}
			}
			s.known.alt[r.ID] = append(kept, bad)
		}
		s.mu.Unlock()
		return d, c, true
	}
	return nil, nil, false
}

// fromBackend reads a chunk's stored bytes from the backend (not the outbox).
func (s *Store) fromBackend(ctx context.Context, cid string) ([]byte, error) {
	s.mu.Lock()
	l, ok := s.known.locs[cid]
	s.mu.Unlock()
	if !ok {
		return nil, fs.ErrNotExist
	}
	return readStored(ctx, s.b, cid, l)
}

func (s *Store) decode(comp []byte, ref chunkRef) ([]byte, error) {
	data, err := s.dec.DecodeAll(comp, make([]byte, 0, ref.Len))
	if err != nil {
		return nil, fmt.Errorf("undecodable: %v", err)
	}
	if int64(len(data)) != ref.Len {
		return nil, fmt.Errorf("size %d != %d", len(data), ref.Len)
	}
	if sum := sha256Hex(data); sum != ref.ID {
		return nil, fmt.Errorf("sha256 mismatch: got %s", sum)
	}
	return data, nil
}

// verifyDir checks the opened copy of a snapshot chunk by chunk, in parallel,
// and returns the chunks' keys (fingerprint).
//
// When this process already knows the keys (it committed or verified the
// snapshot: the usual warm resume), each chunk of the copy is checked against
// its key, the chunk's XXH3-128 (fingerprint), which misses damage with
// probability 2^-128 per chunk; taken at commit anyway, and the store's part of
// a warm 64 MiB resume went from 6–10 ms with the earlier CRC-32C-per-page keys
// to 4–6 ms (bench.BenchmarkStore, 2026-12-01). Else each chunk
// is checked against its id (sha256, ~150 ms for 512 MiB) and the keys are
// computed on the way. Chunks read from the cache or the backend are always
// checked against their sha256 ids (assemble).
func (s *Store) verifyDir(ctx context.Context, id, dir string, d doc) ([][]chunkSum, error) {
	known := knownKeys(d)
	type vt struct {
		f   *os.File
		off int64
		ref chunkRef
		fn  string
		key *chunkSum
		// want is the chunk's known key when known.
		want chunkSum
	}
	keys := make([][]chunkSum, len(d.Files))
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var all []vt
	for i, fc := range d.Files {
		f, err := os.Open(filepath.Join(dir, fc.Name))
		if err != nil {
			return nil, &snapshot.CorruptError{Snapshot: id, File: fc.Name, Reason: "missing"}
		}
		files = append(files, f)
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		if st.Size() != d.Manifest.Files[i].Bytes {
			return nil, &snapshot.CorruptError{Snapshot: id, File: fc.Name, Reason: fmt.Sprintf("size %d != %d", st.Size(), d.Manifest.Files[i].Bytes)}
		}
		keys[i] = make([]chunkSum, len(fc.Chunks))
		var off int64
		for j, r := range fc.Chunks {
			t := vt{f: f, off: off, ref: r, fn: fc.Name, key: &keys[i][j]}
			if known {
				t.want = d.keys[i][j]
			}
			all = append(all, t)
			off += r.Len
		}
	}
	// Each worker takes a contiguous share of the chunks and reads runs of
	// neighbouring chunks with one ReadAt of up to verifySpan bytes.
	const verifySpan = 1 << 20
	errs := make([]error, s.workers)
	var wg sync.WaitGroup
	for w := 0; w < s.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, verifySpan+maxChunk)
			lo, hi := w*len(all)/s.workers, (w+1)*len(all)/s.workers
			for i := lo; i < hi; {
				j, n := i, int64(0)
				for j < hi && all[j].f == all[i].f && n < verifySpan {
					n += all[j].ref.Len
					j++
				}
				span := buf[:n]
				if _, err := all[i].f.ReadAt(span, all[i].off); err != nil {
					errs[w] = err
					return
				}
				for ; i < j; i++ {
					t := all[i]
					b := span[:t.ref.Len]
					span = span[t.ref.Len:]
					*t.key = fingerprint(b)
					ok, check := false, "sha256"
					switch {
					case known:
						ok, check = *t.key == t.want, "fingerprint"
					case t.ref.ID == "":
						ok = allZero(b)
					default:
						ok = sha256Hex(b) == t.ref.ID
					}
					if !ok {
						errs[w] = &snapshot.CorruptError{Snapshot: id, File: t.fn, Reason: fmt.Sprintf("chunk %s at offset %d: %s mismatch", t.ref.ID, t.off, check)}
						return
					}
				}
				if ctx.Err() != nil {
					errs[w] = ctx.Err()
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return keys, nil
}

// Usage implements snapshot.UsageReporter: the durable tier's figures come
// from the store's index of packs (no request to it), the local ones from a
// walk of the store's directories.
func (s *Store) Usage(ctx context.Context) (snapshot.Usage, error) {
	var u snapshot.Usage
	// A store that could not list its backend at start knows nothing of it
	// yet: list it now, or report the figures as unknown (an error), not 0.
	lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	err := s.ensureKnown(lctx)
	cancel()
	if err != nil {
		return u, fmt.Errorf("durable tier not listed yet (figures unknown): %w", err)
	}
	s.mu.Lock()
	u.Chunks, u.ChunkBytes = s.known.storedBytes()
	u.Packs = len(s.known.packs)
	u.StoredBytes = s.known.tierBytes()
	s.mu.Unlock()
	if u.PendingUploadBytes, err = snapshot.DirBytes(filepath.Join(s.dir, "outbox")); err != nil {
		return u, err
	}
	u.LocalBytes = u.PendingUploadBytes
	for _, d := range []string{"open", "cache", "staging"} {
		n, err := snapshot.DirBytes(filepath.Join(s.dir, d))
		if err != nil {
			return u, err
		}
		u.LocalBytes += n
	}
	return u, nil
}

// Collect deletes every chunk that no manifest of live references (live == nil:
// every committed snapshot). A snapshot committed while Collect runs keeps its
// chunks (see the package comment). It returns the number of chunks deleted.
func (s *Store) Collect(ctx context.Context, live []string) (int, error) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	s.mu.Lock()
	s.gcActive, s.protected = true, map[string]bool{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.gcActive, s.protected = false, nil
		s.mu.Unlock()
	}()
	if live == nil {
		var err error
		if live, err = s.List(ctx); err != nil {
			return 0, err
		}
	}
	if err := s.ensureKnown(ctx); err != nil {
		return 0, fmt.Errorf("collect: %w", err) // the packs are not all known
	}
	ref := map[string]bool{}
	for _, id := range live {
		d, ok := s.cachedDoc(id) // a listed snapshot's manifest never changes
		var err error
		if !ok {
			d, err = s.readDoc(ctx, id)
		}
		if errors.Is(err, snapshot.ErrNotFound) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("collect: %w", err) // never delete on uncertainty
		}
		for _, fc := range d.Files {
			for _, r := range fc.Chunks {
				if r.ID != "" {
					ref[r.ID] = true
				}
			}
		}
	}
	// Loose chunks (stores written before packs).
	objs, err := s.b.List(ctx, "chunks/")
	if err != nil {
		return 0, fmt.Errorf("collect: %w", err)
	}
	n := 0
	for _, o := range objs {
		id := path.Base(o.Key)
		if ref[id] {
			continue
		}
		s.mu.Lock()
		if s.pins[id] > 0 || s.protected[id] {
			s.mu.Unlock()
			continue
		}
		ch := make(chan struct{})
		s.deleting[id] = ch
		l, had := s.known.locs[id]
		if had && l.Pack == "" {
			delete(s.known.locs, id)
		}
		s.mu.Unlock()
		err := s.b.Delete(ctx, o.Key)
		s.mu.Lock()
		delete(s.deleting, id)
		close(ch)
		if err != nil && had && l.Pack == "" {
			s.known.locs[id] = l // unsure: still there
		}
		s.mu.Unlock()
		if err != nil {
			return n, fmt.Errorf("collect: %w", err)
		}
		if s.cache != nil && (!had || l.Pack == "") {
			s.cache.Remove(id)
		}
		n++
	}
	// Packs none of whose chunks is referenced, pinned or protected.
	s.mu.Lock()
	pids := make([]string, 0, len(s.known.packs))
	for pid := range s.known.packs {
		pids = append(pids, pid)
	}
	s.mu.Unlock()
	sort.Strings(pids)
	for _, pid := range pids {
		s.mu.Lock()
		entries, ok := s.known.packs[pid]
		dead := ok
		for _, e := range entries {
			if s.usedIn(e.ID, pid, ref) {
				dead = false
				break
			}
		}
		if !dead {
			s.mu.Unlock()
			if ok {
				k, err := s.repack(ctx, pid, ref)
				if err != nil {
					s.log.Warn("snapshot store: repack", "pack", pid, "err", err)
				}
				n += k
			}
			continue
		}
		ch := make(chan struct{})
		for _, e := range entries {
			if l, ok := s.known.locs[e.ID]; !ok || l.Pack == pid {
				s.deleting[e.ID] = ch // a copy kept elsewhere stays readable
			}
		}
		dropped := s.known.dropPack(pid)
		s.mu.Unlock()
		indexGone, err := deletePack(ctx, s.b, pid)
		s.mu.Lock()
		for _, e := range entries {
			if s.deleting[e.ID] == ch {
				delete(s.deleting, e.ID)
			}
		}
		close(ch)
		if err != nil && !indexGone { // unsure: still there
			s.known.packs[pid] = entries
			for _, e := range entries {
				if _, ok := s.known.locs[e.ID]; !ok {
					s.known.locs[e.ID] = chunkLoc{Pack: pid, Off: e.Off, Len: e.Len}
				}
			}
		}
		s.mu.Unlock()
		if err != nil {
			return n, fmt.Errorf("collect: pack %s: %w", pid, err)
		}
		if s.cache != nil {
			for _, id := range dropped {
				s.cache.Remove(id)
			}
		}
		n += len(entries)
	}
	// Packs without an index: left by a crash between a pack and its index —
	// or with an index that is unreadable, in which case a live snapshot may
	// need what is in them: they are deleted only when every chunk a live
	// manifest references has a known location.
	s.mu.Lock()
	unlocated := ""
	for id := range ref {
		if _, ok := s.known.locs[id]; !ok {
			if _, ok := s.outKnown.locs[id]; !ok {
				unlocated = id
				break
			}
		}
	}
	s.mu.Unlock()
	if unlocated != "" {
		s.log.Warn("snapshot store: a live snapshot references a chunk in no known pack; packs without a readable index are kept",
			"chunk", unlocated)
		return n, nil
	}
	orphans, err := s.orphanPacks(ctx, s.b, s.known)
	if err != nil {
		return n, fmt.Errorf("collect: %w", err)
	}
	for _, pid := range orphans {
		if _, err := deletePack(ctx, s.b, pid); err != nil {
			return n, fmt.Errorf("collect: pack %s: %w", pid, err)
		}
	}
	return n, nil
}

// repackBelow is the share of a pack's stored bytes still in use below which
// Collect rewrites the pack with only those chunks: a sandbox hibernated again
// and again leaves packs holding a few live chunks each (measured by a
// new-user trial: 80 cycles of one sandbox, 2.4× the live bytes stored).
const repackBelow = 0.5

// repack rewrites pack pid with only its chunks that ref references or a
// commit has pinned (or had pinned while this collection runs), if those are
// less than repackBelow of it, and deletes the old pack. It returns how many
// chunks it dropped. The caller holds gcMu.
//
// The chunks to drop are marked deleting and lose their location before
// anything is read, so a commit that needs one meanwhile waits and stores it
// again; the kept ones get their new location before the old pack goes, and a
// resume that located one in the old pack falls back to the new copy
// (fromAlternative).
// usedIn says whether pack pid's copy of chunk id must stay: the chunk is
// pinned or protected, or a live snapshot references it (ref) and this copy is
// the one reads use (its location) or the chunk is suspect (a damaged copy
// somewhere: every copy is kept until a commit stores it again). A second copy
// of a referenced chunk — written by a commit that could not see the first,
// e.g. after a restart while S3 was down — is garbage. The caller holds mu.
func (s *Store) usedIn(id, pid string, ref map[string]bool) bool {
	if s.pins[id] > 0 || s.protected[id] {
		return true
	}
	if !ref[id] {
		return false
	}
	if _, suspect := s.suspects[id]; suspect {
		return true
	}
	l, ok := s.known.locs[id]
	return !ok || l.Pack == pid
}

func (s *Store) repack(ctx context.Context, pid string, ref map[string]bool) (int, error) {
	s.mu.Lock()
	entries := s.known.packs[pid]
	var keep, drop []indexEntry
	var total, live int64
	for _, e := range entries {
		total += e.Len
		if s.usedIn(e.ID, pid, ref) {
			keep = append(keep, e)
			live += e.Len
		} else {
			drop = append(drop, e)
		}
	}
	if len(keep) == 0 || len(drop) == 0 || float64(live) >= repackBelow*float64(total) {
		s.mu.Unlock()
		return 0, nil
	}
	ch := make(chan struct{})
	for _, e := range drop {
		if l, ok := s.known.locs[e.ID]; ok && l.Pack == pid {
			s.deleting[e.ID] = ch
			delete(s.known.locs, e.ID)
		} else if !ok {
			s.deleting[e.ID] = ch
		}
	}
	s.mu.Unlock()
	release := func(restore bool) {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, e := range drop {
			if s.deleting[e.ID] == ch {
				delete(s.deleting, e.ID)
			}
			if _, ok := s.known.locs[e.ID]; restore && !ok {
				s.known.locs[e.ID] = chunkLoc{Pack: pid, Off: e.Off, Len: e.Len}
			}
		}
		close(ch)
	}
	// Copy the kept chunks, checked, into a new pack (one read of the old one).
	var end int64
	for _, e := range entries {
		end = max(end, e.Off+e.Len)
	}
	old, err := s.b.GetRange(ctx, packKey(pid), 0, end)
	if err != nil {
		release(true)
		return 0, err
	}
	var data []byte
	var moved []indexEntry
	for _, e := range keep {
		comp := old[e.Off : e.Off+e.Len]
		if err := s.checkStored(comp, e.ID); err != nil {
			release(true)
			return 0, fmt.Errorf("chunk %s: %w", e.ID, err) // damaged: leave the pack as it is
		}
		moved = append(moved, indexEntry{ID: e.ID, Off: int64(len(data)), Len: e.Len})
		data = append(data, comp...)
	}
	if err := s.writePack(ctx, s.b, s.known, newPackID(), data, moved); err != nil {
		release(true)
		return 0, err
	}
	if sy, ok := s.b.(Syncer); ok {
		if err := sy.Sync(ctx); err != nil {
			release(true)
			return 0, err
		}
	}
	indexGone, err := deletePack(ctx, s.b, pid)
	if err != nil && !indexGone {
		release(true)
		return 0, err
	}
	s.mu.Lock()
	s.known.dropPack(pid)
	s.mu.Unlock()
	release(false)
	if s.cache != nil {
		for _, e := range drop {
			s.mu.Lock()
			_, elsewhere := s.known.locs[e.ID]
			s.mu.Unlock()
			if !elsewhere {
				s.cache.Remove(e.ID)
			}
		}
	}
	s.log.Info("snapshot pack rewritten without its unused chunks", "pack", pid,
		"kept_bytes", live, "dropped_bytes", total-live)
	return len(drop), err
}

// gcMaxWait bounds how long deletes keep postponing a collection (gcLoop).
var gcMaxWait = time.Minute

func (s *Store) gcLoop() {
	defer close(s.gcDone)
	for {
		select {
		case <-s.closed:
			return
		case <-s.gcKick:
		}
		// Wait for a quiet period: deletes come in bursts, next to resumes.
		// But not for ever: every hibernate deletes its predecessor, so a
		// server hibernating every few seconds would never be quiet and its
		// store would only grow; after gcMaxWait it collects anyway.
		deadline := time.After(max(gcMaxWait, s.gcQuiet))
		for quiet := false; !quiet; {
			select {
			case <-s.closed:
				return
			case <-s.gcKick:
			case <-time.After(s.gcQuiet):
				quiet = true
			case <-deadline:
				quiet = true
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		t := time.Now()
		n, err := s.Collect(ctx, nil)
		cancel()
		if err != nil {
			s.log.Warn("snapshot chunk collection", "err", err)
		} else if n > 0 {
			s.log.Info("snapshot chunks collected", "deleted", n, "ms", time.Since(t).Milliseconds())
		}
	}
}
