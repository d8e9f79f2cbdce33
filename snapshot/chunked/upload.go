package chunked

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Asynchronous upload: CommitAsync leaves a snapshot in the outbox (a local
// filesystem backend under Dir/outbox); uploadLoop moves it to the durable
// backend. See the package comment for the contract.

// maxUploadRetry caps the backoff between failed upload attempts: once S3 is
// back, a pending snapshot becomes durable within this long (a 60 s cap once
// kept a reviewer waiting 32 s after an outage), and an attempt while S3 is
// down costs one failed request.
const maxUploadRetry = 15 * time.Second

var _ snapshot.AsyncStore = (*Store)(nil)

// uploader is the background upload's state (Store.up).
type uploader struct {
	// mu orders an upload's manifest step (backend manifest written, outbox
	// manifest removed) against Delete's removal of both; held across those
	// backend requests, and taken with no other store lock held.
	mu sync.Mutex
	// kick wakes uploadLoop (kickUpload); done is closed when it has stopped.
	kick chan struct{}
	done chan struct{}
	// retry is the first delay before a failed upload is tried again
	// (Config.UploadRetry).
	retry time.Duration
	// uploaded, when set (OnUploaded), is told each snapshot id whose
	// manifest has reached the backend.
	uploaded atomic.Pointer[func(id string)]
}

// OnUploaded sets f to be called (from the upload loop, synchronously: f
// should not block for long) with the id of every snapshot whose upload has
// ended: its manifest is in the backend and gone from the outbox, so Durable
// reports true. The manager records it durable in the database then
// (metadata.Snapshots.SetSnapshotUploaded), which is what other nodes read.
func (s *Store) OnUploaded(f func(id string)) { s.up.uploaded.Store(&f) }

// Durable implements snapshot.AsyncStore: false while id waits in the outbox.
func (s *Store) Durable(ctx context.Context, id string) (bool, error) {
	if err := checkID(id); err != nil {
		return false, err
	}
	pending, err := s.outbox.Exists(ctx, manifestKey(id))
	return !pending && err == nil, err
}

// Pending returns the ids of snapshots committed asynchronously and not yet
// uploaded, sorted.
func (s *Store) Pending(ctx context.Context) ([]string, error) {
	objs, err := s.outbox.List(ctx, "manifests/")
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, o := range objs {
		if id, ok := strings.CutSuffix(path.Base(o.Key), ".json"); ok && checkID(id) == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids, nil
}

// UploadNow asks the background upload to try again at once (tests and
// operators use it after fixing the backend, instead of waiting out the backoff).
func (s *Store) UploadNow() { s.kickUpload() }

func (s *Store) kickUpload() {
	select {
	case s.up.kick <- struct{}{}:
	default:
	}
}

// uploadLoop uploads pending snapshots whenever kicked, at start-up, and after a
// failure with exponential backoff from up.retry to maxUploadRetry.
func (s *Store) uploadLoop() {
	defer close(s.up.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-s.closed
		cancel()
	}()
	wait := s.up.retry
	for {
		n, err := s.uploadPending(ctx)
		var retry <-chan time.Time
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			s.log.Warn("snapshot upload failed; retrying from the local copy", "err", err, "retry_in", wait.String())
			retry = time.After(wait)
			wait = min(2*wait, maxUploadRetry)
		default:
			if n > 0 {
				s.log.Info("snapshots uploaded", "count", n)
			}
			wait = s.up.retry
		}
		select {
		case <-s.closed:
			return
		case <-s.up.kick:
		case <-retry:
		}
	}
}

// testBeforeUpload, when set (tests only), runs before each snapshot's upload.
var testBeforeUpload func(id string)

// uploadPending uploads every pending snapshot, oldest first; it stops at the
// first failure. It returns how many it uploaded.
func (s *Store) uploadPending(ctx context.Context) (int, error) {
	ids, err := s.Pending(ctx)
	if err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		s.releasePending(ctx) // nothing left that other stores' collections cannot see
		s.sweepOutbox(ctx)
		return 0, nil
	}
	if err := s.ensureKnown(ctx); err != nil {
		return 0, err
	}
	// On a shared backend: held until the outbox is empty (also after a
	// restart), and shared for the uploads themselves (collectlock.go).
	if err := s.holdForPending(ctx); err != nil {
		return 0, err
	}
	unlock, held, err := s.lockCommit(ctx, false)
	if err != nil {
		return 0, err
	}
	defer unlock()
	type item struct {
		id string
		d  doc
	}
	var items []item
	for _, id := range ids {
		d, err := s.readOutboxDoc(ctx, id)
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return 0, err
		}
		items = append(items, item{id, d})
	}
	sort.SliceStable(items, func(i, j int) bool {
		return items[i].d.Manifest.CreatedAt.Before(items[j].d.Manifest.CreatedAt)
	})
	n := 0
	for _, it := range items {
		if testBeforeUpload != nil {
			testBeforeUpload(it.id)
		}
		if err := held(ctx); err != nil {
			return n, fmt.Errorf("snapshot %s: upload: %w", it.id, err)
		}
		if err := s.upload(ctx, it.id, it.d); err != nil {
			// A snapshot deleted while it uploaded loses its outbox chunks
			// under the upload ("chunk …: not in the outbox"): not a failure,
			// and no reason to hold back the others behind a backoff.
			if pending, xerr := s.outbox.Exists(ctx, manifestKey(it.id)); xerr == nil && !pending {
				s.log.Debug("snapshot deleted during its upload", "snapshot", it.id, "err", err)
				continue
			}
			return n, fmt.Errorf("snapshot %s: upload: %w", it.id, err)
		}
		n++
	}
	s.releasePending(ctx)
	s.sweepOutbox(ctx)
	return n, nil
}

// upload copies the packs (and loose chunks) of pending snapshot id holding
// chunks the backend lacks from the outbox, makes them durable, writes the
// manifest, and only then removes the snapshot from the outbox.
func (s *Store) upload(ctx context.Context, id string, d doc) error {
	var packs, loose []string
	seen := map[string]bool{}
	s.idx.mu.Lock()
	for _, fc := range d.Files {
		for _, r := range fc.Chunks {
			if r.ID == "" || seen[r.ID] {
				continue
			}
			seen[r.ID] = true
			if _, ok := s.idx.known.locs[r.ID]; ok {
				continue
			}
			l, ok := s.idx.outKnown.locs[r.ID]
			switch {
			case !ok:
				s.idx.mu.Unlock()
				return fmt.Errorf("chunk %s: not in the outbox", r.ID)
			case l.Pack == "":
				loose = append(loose, r.ID)
			case !seen["pack:"+l.Pack]:
				seen["pack:"+l.Pack] = true
				packs = append(packs, l.Pack)
			}
		}
	}
	s.idx.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type item struct{ pack, chunk string }
	items := make(chan item)
	var wg sync.WaitGroup
	var once sync.Once
	var firstErr error
	for w := 0; w < s.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for it := range items {
				if ctx.Err() != nil {
					continue
				}
				var err error
				if it.pack != "" {
					err = s.uploadPack(ctx, it.pack)
				} else {
					err = s.uploadChunk(ctx, it.chunk)
				}
				if err != nil {
					once.Do(func() { firstErr = err; cancel() })
				}
			}
		}()
	}
	for _, p := range packs {
		if ctx.Err() == nil {
			items <- item{pack: p}
		}
	}
	for _, c := range loose {
		if ctx.Err() == nil {
			items <- item{chunk: c}
		}
	}
	close(items)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := syncTier(ctx, s.b); err != nil {
		return err
	}
	b, err := s.marshalDoc(id, d)
	if err != nil {
		return err
	}
	s.up.mu.Lock()
	pending, err := s.outbox.Exists(ctx, manifestKey(id))
	if err == nil && pending { // not deleted meanwhile
		if err = s.b.Put(ctx, manifestKey(id), bytes.NewReader(b), int64(len(b))); err == nil {
			err = s.outbox.Delete(ctx, manifestKey(id))
		}
	}
	s.up.mu.Unlock()
	if err != nil {
		return err
	}
	if f := s.up.uploaded.Load(); f != nil && pending {
		(*f)(id)
	}
	s.dropOutboxChunks(ctx, d)
	return nil
}

// uploadPack copies one pack and its index from the outbox to the backend
// (same pack id), checking every chunk on the way: a damaged local copy is not
// uploaded.
func (s *Store) uploadPack(ctx context.Context, pid string) error {
	s.idx.mu.Lock()
	entries, ok := s.idx.outKnown.packs[pid]
	s.idx.mu.Unlock()
	if !ok {
		return fmt.Errorf("pack %s: not in the outbox", pid)
	}
	data, err := getAll(ctx, s.outbox, packKey(pid))
	if err != nil {
		return fmt.Errorf("pack %s: the outbox copy: %w", pid, err)
	}
	for _, e := range entries {
		if e.Off+e.Len > int64(len(data)) {
			return fmt.Errorf("pack %s: the outbox copy is truncated", pid)
		}
		if err := s.checkStored(data[e.Off:e.Off+e.Len], e.ID); err != nil {
			return fmt.Errorf("pack %s: chunk %s: the outbox copy is damaged: %w", pid, e.ID, err)
		}
	}
	// A new pack id in the backend: an earlier attempt may have left a pack
	// there under pid (without its index) that Collect is deleting as garbage.
	return s.writePack(ctx, s.b, s.idx.known, newPackID(), data, entries, false)
}

// uploadChunk copies one loose chunk (an outbox written before packs) from the
// outbox to the backend, checking its content on the way.
func (s *Store) uploadChunk(ctx context.Context, cid string) error {
	comp, err := getAll(ctx, s.outbox, chunkKey(cid))
	if err != nil {
		return fmt.Errorf("chunk %s: the outbox copy: %w", cid, err)
	}
	if err := s.checkStored(comp, cid); err != nil {
		return fmt.Errorf("chunk %s: the outbox copy is damaged: %w", cid, err)
	}
	if err := s.b.Put(ctx, chunkKey(cid), bytes.NewReader(comp), int64(len(comp))); err != nil {
		return fmt.Errorf("chunk %s: %w", cid, err)
	}
	s.idx.mu.Lock()
	if _, ok := s.idx.known.locs[cid]; !ok {
		s.idx.known.locs[cid] = chunkLoc{Len: int64(len(comp))}
	}
	s.idx.mu.Unlock()
	return nil
}

func (s *Store) readOutboxDoc(ctx context.Context, id string) (doc, error) {
	b, err := getAll(ctx, s.outbox, manifestKey(id))
	if err != nil {
		return doc{}, err
	}
	d, err := s.unmarshalDoc(id, b)
	var ce *snapshot.CorruptError
	if errors.As(err, &ce) {
		ce.Reason = "outbox copy: " + ce.Reason
	}
	return d, err
}

// dropOutboxChunks removes the outbox packs (and loose chunks) holding d's
// chunks unless another pending snapshot references one of their chunks or a
// commit in progress has pinned one.
func (s *Store) dropOutboxChunks(ctx context.Context, d doc) {
	gen := s.outGeneration()
	still := s.outboxRefs(ctx)
	if still == nil {
		return // unsure: keep everything
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.outGen != gen {
		return // a snapshot committed meanwhile may use these packs; sweepOutbox retries
	}
	done := map[string]bool{}
	for _, fc := range d.Files {
		for _, r := range fc.Chunks {
			if l, ok := s.idx.outKnown.locs[r.ID]; ok && !done[l.Pack] {
				done[l.Pack] = l.Pack != ""
				s.dropOutboxLocked(ctx, r.ID, l, still)
			}
		}
	}
}

// dropOutboxLocked removes the outbox pack holding chunk cid at l (or the
// loose chunk) if nothing needs any chunk in it. The caller holds idx.mu, so no
// commit can pick a chunk up between the check and the removal.
func (s *Store) dropOutboxLocked(ctx context.Context, cid string, l chunkLoc, still map[string]bool) {
	if l.Pack == "" {
		if cid == "" || still[cid] || s.idx.pins[cid] > 0 {
			return
		}
		if err := s.outbox.Delete(ctx, chunkKey(cid)); err == nil {
			delete(s.idx.outKnown.locs, cid)
		}
		return
	}
	entries, ok := s.idx.outKnown.packs[l.Pack]
	if !ok || s.idx.outKnown.writing[l.Pack] {
		return
	}
	for _, e := range entries {
		if still[e.ID] || s.idx.pins[e.ID] > 0 {
			return
		}
	}
	if gone, _ := deletePack(ctx, s.outbox, l.Pack); gone {
		s.idx.outKnown.dropPack(l.Pack)
	}
}

// outboxRefs is the set of chunks the pending manifests reference; nil when
// one cannot be read.
func (s *Store) outboxRefs(ctx context.Context) map[string]bool {
	refs, _ := s.outboxRefsErr(ctx)
	return refs
}

// outboxRefsErr is outboxRefs with the reason it is nil: the outbox's listing
// or the first pending manifest that cannot be read (a *snapshot.KeyError
// when it is sealed with a key the store lacks).
func (s *Store) outboxRefsErr(ctx context.Context) (map[string]bool, error) {
	ids, err := s.Pending(ctx)
	if err != nil {
		return nil, err
	}
	refs := map[string]bool{}
	for _, id := range ids {
		d, err := s.readOutboxDoc(ctx, id)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, fc := range d.Files {
			for _, r := range fc.Chunks {
				if r.ID != "" {
					refs[r.ID] = true
				}
			}
		}
	}
	return refs, nil
}

// outGeneration reads outGen: a drop of outbox packs acts only if no manifest
// reached the outbox between listing the pending manifests and the drop.
func (s *Store) outGeneration() uint64 {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	return s.idx.outGen
}

// sweepOutbox removes the outbox packs no pending snapshot needs any more: an
// upload's own clean-up keeps a pack while a commit has one of its chunks
// pinned, and this catches it later.
func (s *Store) sweepOutbox(ctx context.Context) {
	gen := s.outGeneration()
	still := s.outboxRefs(ctx)
	if still == nil {
		return
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.outGen != gen {
		return // that commit kicks the upload loop, which sweeps again
	}
	s.dropOutboxAllLocked(ctx, still)
}

// dropOutboxAllLocked drops every outbox pack and loose chunk nothing needs.
func (s *Store) dropOutboxAllLocked(ctx context.Context, still map[string]bool) {
	for pid, entries := range s.idx.outKnown.packs {
		if len(entries) > 0 {
			s.dropOutboxLocked(ctx, entries[0].ID, chunkLoc{Pack: pid}, still)
		}
	}
	for cid, l := range s.idx.outKnown.locs {
		if l.Pack == "" {
			s.dropOutboxLocked(ctx, cid, l, still)
		}
	}
}

// cleanOutbox removes outbox packs and chunks no pending manifest references,
// and packs without an index (left by a crash mid-commit or mid-cleanup). Only
// at start-up: no commit is in progress.
func (s *Store) cleanOutbox(ctx context.Context) error {
	still, err := s.outboxRefsErr(ctx)
	if err != nil {
		return fmt.Errorf("snapshot store: outbox: a pending manifest is unreadable: %w", err)
	}
	orphans, err := s.orphanPacks(ctx, s.outbox, s.idx.outKnown)
	if err != nil {
		return fmt.Errorf("snapshot store: outbox: %w", err)
	}
	for _, pid := range orphans {
		_ = s.outbox.Delete(ctx, packKey(pid))
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	s.dropOutboxAllLocked(ctx, still)
	return nil
}
