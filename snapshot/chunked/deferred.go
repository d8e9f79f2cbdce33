package chunked

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/snapshot"
)

// Deferred first commits (Config.DeferFirstCommits).
//
// A sandbox's first hibernate has no parent to deduplicate against: its
// commit chunks, hashes and writes every byte of the checkpoint. Done before
// the hibernate is acknowledged, that made a first hibernate slower than the
// plain store's, which only hashes the engine's files and syncs them (issue
// 17; docs/benchmarks). With deferral a first commit is acknowledged at the
// plain store's durability: the staged files are synced, their XXH3 block
// sums computed, the directory becomes the opened copy (open/<id>) and a
// pending manifest is written (pending/<id>.json, atomicfile). The chunk
// commit then runs in the background from the opened copy (one worker, a
// core left to the sandboxes), writes the chunked manifest and removes the
// pending one. Until then the snapshot is listed, its manifest is the pending
// one (LogicalBytes, StoredBytes and NewBytes all its Bytes: it is stored
// whole; Chunks 0; the files' SHA256 empty), Open verifies the opened copy by
// its block sums (it cannot rebuild it: there are no chunks yet), the copy is
// never trimmed, and a diff commit naming it as parent waits for its first
// chunking attempt. A crash or Close leaves the pending manifest; the next
// New starts its chunk commit again (a manifest already in the backend means
// the commit had ended: the pending one is removed). The chunk commit starts
// deferredDelay after the acknowledgement (at once when a diff commit waits
// for it) and checks the copy against the block sums first: a damaged copy
// is logged and never chunked (its Opens fail as corrupt, as any damaged
// snapshot's do). A failed attempt is retried with backoff (1 s doubling to
// a minute) and logged.
//
// Not deferred: diff commits, asynchronous commits (CommitAsync), and stores
// with a Key (plain text of a sandbox's memory must not outlive its commit).

// pendingDir is where pending manifests live, under Config.Dir.
const pendingDir = "pending"

// deferredCommit is one first commit whose chunks are not stored yet.
type deferredCommit struct {
	man    snapshot.Manifest // the pending manifest
	ctx    context.Context   // cancelled by Delete and Close
	cancel context.CancelFunc
	// tried is closed once the first chunking attempt has ended, done once
	// the chunk commit has (or it was cancelled).
	tried, done chan struct{}
	// hurry, closed by a diff commit waiting for this one, ends the
	// deferredDelay at once.
	hurry     chan struct{}
	hurryOnce sync.Once
	// acked is when the commit was acknowledged (or, after a restart, its
	// chunk commit resumed).
	acked time.Time
}

// deferredDelay is how long a chunk commit waits after its acknowledgement
// before it starts: a resume of the sandbox often follows its hibernate at
// once (a request was waiting), and chunking beside its restore on a small
// host slowed that resume by a fifth to two fifths at 64 MiB
// (docs/benchmarks/2026-12-03-deferred-first-commit.md). A diff
// commit on the snapshot ends the wait (awaitDeferred). A variable for tests.
var deferredDelay = 2 * time.Second

type deferredSet struct {
	mu sync.Mutex // a leaf lock (doc.go)
	m  map[string]*deferredCommit
	wg sync.WaitGroup
	// sem lets one chunk commit run at a time.
	sem       chan struct{}
	committed atomic.Pointer[func(snapshot.Manifest)]
}

// OnCommitted sets f to be called with the chunked manifest of every deferred
// first commit once its chunks are stored (its sizes are then the real ones),
// from the background commit's goroutine. It implements
// snapshot.DeferredCommitter.
func (s *Store) OnCommitted(f func(m snapshot.Manifest)) { s.deferred.committed.Store(&f) }

var _ snapshot.DeferredCommitter = (*Store)(nil)

func (s *Store) pendingPath(id string) string {
	return filepath.Join(s.dir, pendingDir, id+".json")
}

// deferredOf returns snapshot id's pending commit, if it has one.
func (s *Store) deferredOf(id string) (*deferredCommit, bool) {
	s.deferred.mu.Lock()
	defer s.deferred.mu.Unlock()
	dc, ok := s.deferred.m[id]
	return dc, ok
}

func (s *Store) isDeferred(id string) bool {
	_, ok := s.deferredOf(id)
	return ok
}

// deferredIDs returns the ids of the pending commits.
func (s *Store) deferredIDs() []string {
	s.deferred.mu.Lock()
	defer s.deferred.mu.Unlock()
	ids := make([]string, 0, len(s.deferred.m))
	for id := range s.deferred.m {
		ids = append(ids, id)
	}
	return ids
}

// commitDeferred acknowledges first commit id once its files are synced and
// its pending manifest is written, and starts its chunk commit. Errors: as
// Commit's, for the staged files (read, sync) and the pending manifest.
func (s *Store) commitDeferred(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	tStart := time.Now()
	dir := s.staged(id)
	names, err := commitFiles(id, m, dir)
	if err != nil {
		return m, err
	}
	files := make([]snapshot.File, len(names))
	errs := make([]error, 2*len(names))
	var wg sync.WaitGroup
	for i, n := range names {
		path := filepath.Join(dir, n)
		st, err := os.Stat(path)
		if err != nil {
			return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
		}
		files[i] = snapshot.File{Name: n, Bytes: st.Size(), BlockBytes: snapshot.BlockSumBytes}
		wg.Add(2)
		go func() { // the sums read the page cache while the sync writes it out
			defer wg.Done()
			files[i].BlockXXH3, errs[2*i] = snapshot.BlockSums(ctx, path, st.Size())
		}()
		go func() {
			defer wg.Done()
			errs[2*i+1] = syncFile(path)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	tSynced := time.Now()
	m.Files, m.Bytes = files, 0
	for _, f := range files {
		m.Bytes += f.Bytes
	}
	m.LogicalBytes, m.StoredBytes, m.NewBytes, m.Chunks = m.Bytes, m.Bytes, m.Bytes, 0
	b, err := json.Marshal(m)
	if err != nil {
		return m, err
	}
	// The staged directory becomes the opened copy first: a crash before the
	// pending manifest leaves a copy without a snapshot, which Recover removes.
	_ = os.RemoveAll(s.opened(id))
	if err := os.Rename(dir, s.opened(id)); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	if err := atomicfile.SyncDir(filepath.Join(s.dir, "open")); err == nil {
		err = atomicfile.WriteFile(s.pendingPath(id), b, 0o600)
	}
	if err != nil {
		_ = os.Rename(s.opened(id), dir) // back to staging: the caller may Abort or retry
		return m, fmt.Errorf("snapshot %s: commit: pending manifest: %w", id, err)
	}
	s.useOpened(id)
	s.startDeferred(id, m)
	s.log.Debug("snapshot commit deferred", "snapshot", id, "sync_ms", tSynced.Sub(tStart).Milliseconds(),
		"manifest_ms", time.Since(tSynced).Milliseconds(), "bytes", m.Bytes)
	return m, nil
}

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// startDeferred registers pending commit id and starts its chunk commit.
func (s *Store) startDeferred(id string, m snapshot.Manifest) {
	ctx, cancel := context.WithCancel(context.Background())
	dc := &deferredCommit{man: m, ctx: ctx, cancel: cancel, tried: make(chan struct{}), done: make(chan struct{}),
		hurry: make(chan struct{}), acked: time.Now()}
	s.deferred.mu.Lock()
	s.deferred.m[id] = dc
	s.deferred.wg.Add(1)
	s.deferred.mu.Unlock()
	go s.runDeferred(id, dc)
}

// runDeferred commits pending snapshot id's chunks from its opened copy,
// retrying until it succeeds or dc is cancelled.
func (s *Store) runDeferred(id string, dc *deferredCommit) {
	defer s.deferred.wg.Done()
	var triedOnce sync.Once
	tried := func() { triedOnce.Do(func() { close(dc.tried) }) }
	finish := func() {
		tried()
		s.deferred.mu.Lock()
		if s.deferred.m[id] == dc {
			delete(s.deferred.m, id)
		}
		s.deferred.mu.Unlock()
		close(dc.done)
	}
	delay := time.NewTimer(deferredDelay)
	defer delay.Stop()
	select {
	case <-delay.C:
	case <-dc.hurry:
	case <-dc.ctx.Done():
		finish()
		return
	}
	wait := time.Second
	for {
		select {
		case s.deferred.sem <- struct{}{}:
		case <-dc.ctx.Done():
			finish()
			return
		}
		start := time.Now()
		// The copy is checked first: a byte that changed on disk since the
		// acknowledgement must fail its Opens, not be chunked as the truth.
		err := s.verifyPending(dc.ctx, id, dc.man)
		var ce *snapshot.CorruptError
		if errors.As(err, &ce) {
			<-s.deferred.sem
			s.log.Error("snapshot commit: a deferred first commit's copy is damaged; not chunked (its Opens fail)",
				"snapshot", id, "err", err)
			tried()
			<-dc.ctx.Done() // until Delete or Close
			finish()
			return
		}
		var man snapshot.Manifest
		if err == nil {
			man, err = s.commitFrom(dc.ctx, id, dc.man, commitSource{dir: s.opened(id), workers: 1, opened: true}, false)
		}
		<-s.deferred.sem
		if err == nil {
			if err := os.Remove(s.pendingPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				s.log.Warn("snapshot commit: removing the pending manifest", "snapshot", id, "err", err)
			} else {
				_ = atomicfile.SyncDir(filepath.Join(s.dir, pendingDir))
			}
			finish()
			// Info: the hibernate's own log line has the pending sizes (every
			// byte new); these are the snapshot's real ones.
			s.log.Info("snapshot commit: deferred chunks stored", "snapshot", id, "ms", time.Since(start).Milliseconds(),
				"chunks", man.Chunks, "stored_bytes", man.StoredBytes, "new_bytes", man.NewBytes,
				"waited_ms", start.Sub(dc.acked).Milliseconds())
			if f := s.deferred.committed.Load(); f != nil {
				(*f)(man)
			}
			return
		}
		tried()
		if dc.ctx.Err() != nil {
			finish()
			return
		}
		s.log.Warn("snapshot commit: storing a deferred first commit's chunks failed; retrying", "snapshot", id,
			"err", err, "retry_in", wait)
		select {
		case <-time.After(wait):
		case <-dc.ctx.Done():
			finish()
			return
		}
		wait = min(2*wait, time.Minute)
	}
}

// awaitDeferred waits, for a diff commit whose parent is parent, until the
// parent's first chunking attempt has ended: a parent still pending after it
// (its chunk commit failed) gives the diff commit nothing to match, which
// then stores every chunk itself. Errors: ctx's.
func (s *Store) awaitDeferred(ctx context.Context, parent string) error {
	if parent == "" {
		return nil
	}
	dc, ok := s.deferredOf(parent)
	if !ok {
		return nil
	}
	if dc.hurry != nil {
		dc.hurryOnce.Do(func() { close(dc.hurry) })
	}
	select {
	case <-dc.tried:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// dropDeferred cancels pending commit id (Delete), waits for its goroutine
// and removes its pending manifest. Unknown ids are not an error.
func (s *Store) dropDeferred(id string) error {
	if dc, ok := s.deferredOf(id); ok && dc.cancel != nil { // not a read-only store's
		dc.cancel()
		<-dc.done
	}
	if err := os.Remove(s.pendingPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// openDeferred is Open of pending snapshot id: its opened copy, checked
// against the pending manifest's block sums. Errors: *snapshot.CorruptError
// when a file is missing, of another size or a block differs (there are no
// chunks to rebuild it from), ctx's.
func (s *Store) openDeferred(ctx context.Context, id string, man snapshot.Manifest) (string, snapshot.Manifest, error) {
	unlock := s.opening.lock(id)
	defer unlock()
	if err := s.verifyPending(ctx, id, man); err != nil {
		return "", man, err
	}
	s.useOpened(id)
	s.holdOpened(id)
	return s.opened(id), man, nil
}

// verifyPending checks pending snapshot id's opened copy against man's block
// sums. Errors: snapshot.VerifyBlockSums's.
func (s *Store) verifyPending(ctx context.Context, id string, man snapshot.Manifest) error {
	for _, f := range man.Files {
		if err := snapshot.VerifyBlockSums(ctx, id, s.opened(id), f); err != nil {
			return err
		}
	}
	return nil
}

// loadDeferred registers the pending manifests a previous process left and,
// unless the store is read-only, starts their chunk commits; one whose
// chunked manifest is in the backend already had ended, and is removed.
func (s *Store) loadDeferred(ctx context.Context, readOnly bool) error {
	s.deferred.m = map[string]*deferredCommit{}
	s.deferred.sem = make(chan struct{}, 1)
	pdir := filepath.Join(s.dir, pendingDir)
	if err := os.MkdirAll(pdir, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(pdir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(e.Name(), ".") || checkID(id) != nil {
			if !readOnly && strings.HasPrefix(e.Name(), ".") {
				_ = os.Remove(filepath.Join(pdir, e.Name())) // an atomicfile temporary
			}
			continue
		}
		b, err := os.ReadFile(filepath.Join(pdir, e.Name()))
		if err != nil {
			return err
		}
		var m snapshot.Manifest
		if err := json.Unmarshal(b, &m); err != nil || m.ID != id {
			s.log.Error("snapshot store: unreadable pending manifest kept aside", "snapshot", id, "err", err)
			continue
		}
		if done, err := s.b.Exists(ctx, manifestKey(id)); err == nil && done {
			if !readOnly {
				_ = os.Remove(filepath.Join(pdir, e.Name()))
			}
			continue
		}
		if readOnly {
			s.deferred.m[id] = &deferredCommit{man: m, tried: make(chan struct{}), done: make(chan struct{})}
			continue
		}
		s.log.Info("snapshot store: resuming a deferred first commit", "snapshot", id)
		s.startDeferred(id, m)
	}
	return nil
}

// closeDeferred stops the chunk commits in progress (Close); their pending
// manifests stay for the next New.
func (s *Store) closeDeferred() {
	s.deferred.mu.Lock()
	for _, dc := range s.deferred.m {
		if dc.cancel != nil {
			dc.cancel()
		}
	}
	s.deferred.mu.Unlock()
	s.deferred.wg.Wait()
}
