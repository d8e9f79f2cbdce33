package chunked

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sync/atomic"
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
	// Workers is the number of parallel chunk uploads/fetches (default 4 for a
	// local backend, 16 for a Remote one such as S3).
	Workers int
	// AutoGC runs Collect in the background after Delete, once no Delete came
	// for GCQuiet (default 5 s), so a collection does not compete for the CPU
	// with the resume or hibernate that usually follows a delete. Close stops it.
	AutoGC  bool
	GCQuiet time.Duration
	// CollectLock, when set, says other stores (other nodes) commit to and
	// collect in the same backend, and is the lock they all share: commits
	// hold it shared, Collect exclusively (collectlock.go). nil: this store
	// is the backend's only user.
	CollectLock CollectLock
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
	// Key, when set, encrypts what the store writes from now on (seal.go):
	// chunks and manifests are sealed before they reach the backend or the
	// outbox, and a commit removes its staged plaintext instead of keeping
	// it as the opened copy. Snapshots written without a key stay readable.
	Key *Key
	// OldKeys open snapshots sealed with an earlier key (rotation: new
	// snapshots are sealed with Key only).
	OldKeys []*Key
	// DeferFirstCommits acknowledges a first commit (no parent) once its
	// files and a pending manifest are synced, and stores its chunks in the
	// background (deferred.go). Ignored with a Key and by CommitAsync.
	DeferFirstCommits bool
}

// Store implements snapshot.Store on chunks. Its fields are grouped by the
// job that owns them; doc.go lists every lock, what it guards and the order
// in which locks may be taken.
type Store struct {
	// Set by New, read-only afterwards.
	dir     string
	b       Backend
	outbox  *FS // asynchronously committed snapshots until uploaded (upload.go)
	workers int
	enc     *zstd.Encoder
	dec     *zstd.Decoder
	log     *slog.Logger
	closed  chan struct{} // closed by Close: the background loops stop
	// key seals new chunks and manifests (nil: written plain); keys opens
	// them, by key id: key and the old keys (seal.go).
	key  *Key
	keys map[string]*Key

	// idx is what the store knows of the chunks in the backend and the
	// outbox, and the pins by which commits and Collect stay out of each
	// other's way (index.go).
	idx index

	// Open's state (open.go): a lock per snapshot being opened, the opened
	// copies (opened.go) and the chunk cache in front of the backend.
	opening    snapshotLocks
	openCopies *openedSet
	cache      *Cache
	fill       *cacheFiller // fills cache in the background (nil without a cache)
	// docs holds the parsed manifests of the snapshots last committed or
	// opened, with their chunks' keys: what a diff commit matches against
	// (parent.go) and a warm Open checks with (manifest.go).
	docs docCache

	// up is the background upload's state (upload.go).
	up uploader
	// gc is the garbage collection's state (gc.go).
	gc collector
	// streams are the streaming opens being served (stream.go).
	streams streams

	// deferFirst is Config.DeferFirstCommits; deferred the first commits
	// whose chunks are not stored yet (deferred.go).
	deferFirst bool
	deferred   deferredSet

	// lastReused is the number of chunks the last commit named by their key
	// match with a parent chunk (tests).
	lastReused atomic.Int64
}

var _ snapshot.Store = (*Store)(nil)
var _ snapshot.Verifier = (*Store)(nil)
var _ snapshot.Streamer = (*Store)(nil)

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
	s := &Store{dir: abs, b: cfg.Backend, workers: cfg.Workers, log: cfg.Logger, closed: make(chan struct{}),
		idx: newIndex(), key: cfg.Key, keys: map[string]*Key{}, deferFirst: cfg.DeferFirstCommits,
		opening: snapshotLocks{locks: map[string]*snapshotLock{}},
		up:      uploader{kick: make(chan struct{}, 1), done: make(chan struct{}), retry: cfg.UploadRetry}}
	for _, k := range append([]*Key{cfg.Key}, cfg.OldKeys...) {
		if k != nil {
			s.keys[k.id] = k
		}
	}
	openLimit := cfg.OpenBytes
	if cfg.ReadOnly {
		openLimit = 0 // the server owning the store trims its copies
	}
	removeStaleStreams(abs)
	s.scanOpened(openLimit)
	if s.up.retry <= 0 {
		s.up.retry = time.Second
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
		if _, remote := s.b.(Remote); remote {
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
	remote, isRemote := s.b.(Remote)
	if isRemote && remote.UnreachableAtOpen() {
		s.log.Warn("snapshot store: backend unreachable at start; it is listed before the next upload or synchronous commit")
	} else if err := s.loadKnown(ctx); err != nil {
		if !isRemote {
			return nil, err
		}
		// Start anyway: snapshots open from local copies and commit
		// asynchronously; the listing is retried before the next upload or
		// synchronous commit.
		s.log.Warn("snapshot store: backend unreachable at start", "err", err)
	}
	if err := s.loadDeferred(ctx, cfg.ReadOnly); err != nil {
		return nil, fmt.Errorf("snapshot store %s: pending commits: %w", abs, err)
	}
	// Before the upload loop: its first round (a restart's pending uploads)
	// takes the collection lock, and must not see a store without one.
	if cfg.CollectLock != nil {
		s.gc.cluster = &clusterState{lock: cfg.CollectLock}
	}
	if !cfg.ReadOnly {
		go s.uploadLoop()
	} else {
		close(s.up.done)
	}
	if cfg.AutoGC {
		s.gc.kick = make(chan struct{}, 1)
		s.gc.quiet = cfg.GCQuiet
		if s.gc.quiet <= 0 {
			s.gc.quiet = 5 * time.Second
		}
		s.gc.done = make(chan struct{})
		go s.gcLoop()
	}
	return s, nil
}

// Backend returns the store's durable backend.
func (s *Store) Backend() Backend { return s.b }

// Cache returns the chunk cache (nil without one).
func (s *Store) Cache() *Cache { return s.cache }

// Close stops the background collection, upload and cache filling. The store is
// not usable afterwards.
func (s *Store) Close() error {
	select {
	case <-s.closed:
		return nil
	default:
	}
	close(s.closed)
	s.closeStreams()
	s.closeDeferred()
	if s.gc.done != nil {
		<-s.gc.done
	}
	<-s.up.done
	s.releasePending(nil)
	if s.fill != nil {
		s.fill.close()
	}
	return nil
}

func (s *Store) staged(id string) string {
	return filepath.Join(s.dir, "staging", id)
}

// StagedDir is the directory Stage makes for snapshot id (Dir/staging/id),
// whether or not it exists; Recover removes every entry of its parent.
func (s *Store) StagedDir(id string) string { return s.staged(id) }

func (s *Store) opened(id string) string { return filepath.Join(s.dir, "open", id) }

// Recover implements snapshot.Store: it empties staging (the checkpoints of
// hibernates a crash cut: plain text; the caller commits those it can
// first) and removes opened copies and half-built directories of snapshots
// without a manifest — with an encryption key every opened copy (plain
// text; no restore runs before Recover, and each later one rebuilds its
// copy).
func (s *Store) Recover(ctx context.Context) error {
	if err := os.RemoveAll(filepath.Join(s.dir, "staging")); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(s.dir, "staging"), 0o700); err != nil {
		return err
	}
	if s.key != nil { // but the copies of pending commits: they are all there is
		s.removeOpened(func(name string) bool { return !s.isDeferred(name) })
	}
	if tc, ok := s.b.(TempCleaner); ok {
		tc.CleanTemp()
	}
	s.outbox.CleanTemp()
	if err := s.cleanOutbox(ctx); err != nil {
		return err
	}
	ids, err := s.List(ctx)
	if err != nil {
		if _, remote := s.b.(Remote); !remote {
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
	s.removeOpened(func(name string) bool { return !live[name] })
	return nil
}

// removeOpened removes the entries of open/ (opened copies, half-built and
// set-aside directories) whose name dead accepts; a removal that fails is
// logged.
func (s *Store) removeOpened(dead func(name string) bool) {
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		if !dead(e.Name()) {
			continue
		}
		s.dropOpened(e.Name())
		if err := os.RemoveAll(filepath.Join(s.dir, "open", e.Name())); err != nil {
			s.log.Warn("snapshot store: removing an opened copy at start", "entry", e.Name(), "err", err)
		}
	}
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
	s.idx.mu.Lock()
	u.Chunks, u.ChunkBytes = s.idx.known.storedBytes()
	u.Packs = len(s.idx.known.packs)
	u.StoredBytes = s.idx.known.tierBytes()
	s.idx.mu.Unlock()
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
	// A deferred first commit is stored as its opened copy until its chunks
	// are (deferred.go): stored bytes, not a local extra.
	for _, id := range s.deferredIDs() {
		if dc, ok := s.deferredOf(id); ok {
			u.StoredBytes += dc.man.Bytes
			u.LocalBytes = max(0, u.LocalBytes-dc.man.Bytes)
		}
	}
	return u, nil
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
