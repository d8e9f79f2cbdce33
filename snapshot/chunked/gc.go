package chunked

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"sort"
	"sync"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Delete implements snapshot.Store. The chunks stay until Collect finds them
// unreferenced.
func (s *Store) Delete(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	if err := s.dropDeferred(id); err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	s.docs.forget(id)
	s.dropOpened(id)
	// up.mu: an upload in flight must not write the manifest back afterwards.
	// The backend's manifest goes first: while the backend cannot be reached
	// the snapshot stays whole (one waiting for its upload keeps its outbox
	// manifest, so it is still listed and reported not durable) and the
	// caller can try again; removing the outbox's first left a snapshot that
	// was nowhere yet reported durable.
	s.up.mu.Lock()
	pd, perr := s.readOutboxDoc(ctx, id)
	err := s.b.Delete(ctx, manifestKey(id))
	if err == nil {
		err = s.outbox.Delete(ctx, manifestKey(id))
	}
	s.up.mu.Unlock()
	if err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	s.docs.forget(id) // again: an Open meanwhile may have read it back
	if perr == nil {
		s.dropOutboxChunks(ctx, pd)
	}
	_ = syncTier(ctx, s.b)
	if err := os.RemoveAll(s.opened(id)); err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	if err := os.RemoveAll(s.staged(id)); err != nil {
		return err
	}
	if s.gc.kick != nil {
		select {
		case s.gc.kick <- struct{}{}:
		default:
		}
	}
	return nil
}

// Collect deletes every chunk that no manifest of live references (live == nil:
// every committed snapshot). A snapshot committed while Collect runs keeps its
// chunks (see the package comment). It returns the number of chunks deleted.
//
// With Config.CollectLock (a backend shared with other stores) it first takes
// that lock exclusively, or returns ErrCollectBusy at once when a commit holds
// it; then it re-lists the backend's packs, and collects within
// clusterRoundBudget (the rest is left for the next round). live must then be
// nil: every store's snapshots are live (collectlock.go).
func (s *Store) Collect(ctx context.Context, live []string) (int, error) {
	s.gc.mu.Lock()
	defer s.gc.mu.Unlock()
	round, release, err := s.beginRound(ctx, live)
	if err != nil {
		return 0, err
	}
	defer release()
	n, err := s.collect(ctx, live, round)
	if errors.Is(err, errRoundOver) {
		s.gc.more = true
		return n, nil
	}
	return n, err
}

func (s *Store) collect(ctx context.Context, live []string, round *exclusiveRound) (int, error) {
	s.idx.mu.Lock()
	s.idx.gcActive, s.idx.protected = true, map[string]bool{}
	s.idx.mu.Unlock()
	defer func() {
		s.idx.mu.Lock()
		s.idx.gcActive, s.idx.protected = false, nil
		s.idx.mu.Unlock()
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
	sandboxes := map[string]bool{} // with a live snapshot: their working sets stay
	for _, id := range live {
		d, ok := s.docs.get(id) // a listed snapshot's manifest never changes
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
		sandboxes[d.Manifest.SandboxID] = true
		for _, fc := range d.Files {
			for _, r := range fc.Chunks {
				if r.ID != "" {
					ref[r.ID] = true
				}
			}
		}
	}
	s.collectWorkingSets(ctx, sandboxes)
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
		s.idx.mu.Lock()
		if s.idx.pins[id] > 0 || s.idx.protected[id] {
			s.idx.mu.Unlock()
			continue
		}
		ch := make(chan struct{})
		s.idx.deleting[id] = ch
		l, had := s.idx.known.locs[id]
		if had && l.Pack == "" {
			delete(s.idx.known.locs, id)
		}
		s.idx.removing(looseGone(id))
		s.idx.mu.Unlock()
		err := round.beforeDelete(ctx)
		if err == nil {
			err = s.b.Delete(ctx, o.Key)
		}
		s.idx.mu.Lock()
		s.idx.removed(looseGone(id))
		delete(s.idx.deleting, id)
		close(ch)
		if err != nil && had && l.Pack == "" {
			s.idx.known.locs[id] = l // unsure: still there
		}
		s.idx.mu.Unlock()
		if errors.Is(err, errRoundOver) {
			return n, err
		}
		if err != nil {
			return n, fmt.Errorf("collect: %w", err)
		}
		if s.cache != nil && (!had || l.Pack == "") {
			s.cache.Remove(id)
		}
		n++
	}
	// Packs none of whose chunks is referenced, pinned or protected.
	s.idx.mu.Lock()
	pids := make([]string, 0, len(s.idx.known.packs))
	for pid := range s.idx.known.packs {
		pids = append(pids, pid)
	}
	s.idx.mu.Unlock()
	sort.Strings(pids)
	for _, pid := range pids {
		s.idx.mu.Lock()
		entries, ok := s.idx.known.packs[pid]
		dead := ok
		for _, e := range entries {
			// On a shared backend every copy of a referenced chunk stays:
			// another store may locate it in this one.
			if s.idx.usedIn(e.ID, pid, ref) || (round != nil && ref[e.ID]) {
				dead = false
				break
			}
		}
		if !dead {
			s.idx.mu.Unlock()
			if ok {
				k, err := s.repack(ctx, pid, ref, round)
				n += k
				var stop roundStop
				if errors.As(err, &stop) {
					if errors.Is(err, errRoundOver) {
						return n, err
					}
					return n, fmt.Errorf("collect: pack %s: %w", pid, stop.error)
				}
				if err != nil {
					s.log.Warn("snapshot store: repack", "pack", pid, "err", err)
				}
			}
			continue
		}
		ch := make(chan struct{})
		for _, e := range entries {
			if l, ok := s.idx.known.locs[e.ID]; !ok || l.Pack == pid {
				s.idx.deleting[e.ID] = ch // a copy kept elsewhere stays readable
			}
		}
		dropped := s.idx.known.dropPack(pid)
		s.idx.removing(pid)
		s.idx.mu.Unlock()
		indexGone := false
		err := round.beforeDelete(ctx)
		if err == nil && testBeforePackDelete != nil {
			testBeforePackDelete(s, pid)
		}
		if err == nil {
			indexGone, err = deletePack(ctx, s.b, pid)
		}
		s.idx.mu.Lock()
		s.idx.removed(pid)
		for _, e := range entries {
			if s.idx.deleting[e.ID] == ch {
				delete(s.idx.deleting, e.ID)
			}
		}
		close(ch)
		if err != nil && !indexGone { // unsure: still there
			s.idx.known.packs[pid] = entries
			for _, e := range entries {
				if _, ok := s.idx.known.locs[e.ID]; !ok {
					s.idx.known.locs[e.ID] = chunkLoc{Pack: pid, Off: e.Off, Len: e.Len}
				}
			}
		}
		s.idx.mu.Unlock()
		if errors.Is(err, errRoundOver) {
			return n, err
		}
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
	s.idx.mu.Lock()
	unlocated := ""
	for id := range ref {
		if _, ok := s.idx.known.locs[id]; !ok {
			if _, ok := s.idx.outKnown.locs[id]; !ok {
				unlocated = id
				break
			}
		}
	}
	s.idx.mu.Unlock()
	if unlocated != "" {
		s.log.Warn("snapshot store: a live snapshot references a chunk in no known pack; packs without a readable index are kept",
			"chunk", unlocated)
		return n, nil
	}
	orphans, err := s.orphanPacks(ctx, s.b, s.idx.known)
	if err != nil {
		return n, fmt.Errorf("collect: %w", err)
	}
	for _, pid := range orphans {
		if err := round.beforeDelete(ctx); errors.Is(err, errRoundOver) {
			return n, err
		} else if err != nil {
			return n, fmt.Errorf("collect: %w", err)
		}
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

// usedIn says whether pack pid's copy of chunk id must stay: the chunk is
// pinned or protected, or a live snapshot references it (ref) and this copy is
// the one reads use (its location) or the chunk is suspect (a damaged copy
// somewhere: every copy is kept until a commit stores it again). A second copy
// of a referenced chunk — written by a commit that could not see the first,
// e.g. after a restart while S3 was down — is garbage. The caller holds x.mu.
func (x *index) usedIn(id, pid string, ref map[string]bool) bool {
	if x.pins[id] > 0 || x.protected[id] {
		return true
	}
	if !ref[id] {
		return false
	}
	if _, suspect := x.suspects[id]; suspect {
		return true
	}
	l, ok := x.known.locs[id]
	return !ok || l.Pack == pid
}

// repack rewrites pack pid with only its chunks that ref references or a
// commit has pinned (or had pinned while this collection runs), if those are
// less than repackBelow of it, and deletes the old pack. It returns how many
// chunks it dropped. The caller holds gc.mu.
//
// The chunks to drop are marked deleting and lose their location before
// anything is read, so a commit that needs one meanwhile waits and stores it
// again; the kept ones get their new location before the old pack goes, and a
// resume that located one in the old pack falls back to the new copy
// (fromAlternative).
//
// On a shared backend (round != nil) the new pack keeps every chunk of the old
// one that ref references, also where this store's index locates it in
// another pack: another store's index may locate it in this one. The round's
// lock and budget are checked before anything is written, and the old pack is
// deleted only once the new one is durable, after the checks of any deletion
// but the budget (beforeFinish: the generation is written, so other stores
// refresh their index before they deduplicate or read; collectlock.go). An
// error from the round (roundStop) stops the collection: the old pack then
// stays beside the new one, both whole.
func (s *Store) repack(ctx context.Context, pid string, ref map[string]bool, round *exclusiveRound) (int, error) {
	s.idx.mu.Lock()
	entries := s.idx.known.packs[pid]
	var keep, drop []indexEntry
	var total, live int64
	for _, e := range entries {
		total += e.Len
		if s.idx.usedIn(e.ID, pid, ref) || round != nil && ref[e.ID] {
			keep = append(keep, e)
			live += e.Len
		} else {
			drop = append(drop, e)
		}
	}
	if len(keep) == 0 || len(drop) == 0 || float64(live) >= repackBelow*float64(total) {
		s.idx.mu.Unlock()
		return 0, nil
	}
	ch := make(chan struct{})
	for _, e := range drop {
		if l, ok := s.idx.known.locs[e.ID]; ok && l.Pack == pid {
			s.idx.deleting[e.ID] = ch
			delete(s.idx.known.locs, e.ID)
		} else if !ok {
			s.idx.deleting[e.ID] = ch
		}
	}
	s.idx.mu.Unlock()
	release := func(restore bool) {
		s.idx.mu.Lock()
		defer s.idx.mu.Unlock()
		for _, e := range drop {
			if s.idx.deleting[e.ID] == ch {
				delete(s.idx.deleting, e.ID)
			}
			if _, ok := s.idx.known.locs[e.ID]; restore && !ok {
				s.idx.known.locs[e.ID] = chunkLoc{Pack: pid, Off: e.Off, Len: e.Len}
			}
		}
		close(ch)
	}
	if err := round.inBudget(ctx); err != nil {
		release(true)
		return 0, roundStop{err}
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
	if err := s.writePack(ctx, s.b, s.idx.known, newPackID(), data, moved, false); err != nil {
		release(true)
		return 0, err
	}
	if err := syncTier(ctx, s.b); err != nil {
		release(true)
		return 0, err
	}
	if err := round.beforeFinish(ctx); err != nil {
		release(true)
		return 0, roundStop{err}
	}
	s.idx.mu.Lock()
	s.idx.removing(pid) // a listing meanwhile must not put the old pack back
	s.idx.mu.Unlock()
	if testBeforePackDelete != nil {
		testBeforePackDelete(s, pid)
	}
	indexGone, err := deletePack(ctx, s.b, pid)
	if err != nil && !indexGone {
		s.idx.mu.Lock()
		s.idx.removed(pid)
		s.idx.mu.Unlock()
		release(true)
		return 0, err
	}
	s.idx.mu.Lock()
	s.idx.known.dropPack(pid)
	s.idx.removed(pid)
	s.idx.mu.Unlock()
	release(false)
	if s.cache != nil {
		for _, e := range drop {
			s.idx.mu.Lock()
			_, elsewhere := s.idx.known.locs[e.ID]
			s.idx.mu.Unlock()
			if !elsewhere {
				s.cache.Remove(e.ID)
			}
		}
	}
	s.log.Info("snapshot pack rewritten without its unused chunks", "pack", pid,
		"kept_bytes", live, "dropped_bytes", total-live)
	return len(drop), err
}

// roundStop is an error of the collection round (its lock lost, its budget
// spent, its generation not written) met by repack: the collection stops, as
// it does when one is met before a deletion.
type roundStop struct{ error }

func (e roundStop) Unwrap() error { return e.error }

// collector is the garbage collection's state (Store.gc).
type collector struct {
	// mu makes Collect one at a time. Taken before idx.loadMu and idx.mu.
	mu sync.Mutex
	// With Config.AutoGC: kick wakes gcLoop (Delete), which collects once no
	// kick came for quiet; done is closed when gcLoop has stopped. kick is
	// nil without AutoGC.
	quiet time.Duration
	kick  chan struct{}
	done  chan struct{}
	// cluster: with Config.CollectLock, the lock and what goes with it
	// (collectlock.go); nil without.
	cluster *clusterState
	// more: the last Collect stopped at its round's budget or was skipped
	// (ErrCollectBusy); gcLoop runs another round. Guarded by mu.
	more bool
}

// testBeforePackDelete, when set (tests only), runs in Collect before a pack
// is deleted from the backend: a dead pack once it has left the index, a
// rewritten one (repack) once its new pack is written and its kept chunks
// located there; on a shared backend after the generation is written.
var testBeforePackDelete func(s *Store, pid string)

// gcMaxWait bounds how long deletes keep postponing a collection (gcLoop).
var gcMaxWait = time.Minute

func (s *Store) gcLoop() {
	defer close(s.gc.done)
	for {
		select {
		case <-s.closed:
			return
		case <-s.gc.kick:
		}
		// Wait for a quiet period: deletes come in bursts, next to resumes.
		// But not for ever: every hibernate deletes its predecessor, so a
		// server hibernating every few seconds would never be quiet and its
		// store would only grow; after gcMaxWait it collects anyway.
		deadline := time.After(max(gcMaxWait, s.gc.quiet))
		for quiet := false; !quiet; {
			select {
			case <-s.closed:
				return
			case <-s.gc.kick:
			case <-time.After(s.gc.quiet):
				quiet = true
			case <-deadline:
				quiet = true
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		t := time.Now()
		n, err := s.Collect(ctx, nil)
		cancel()
		s.gc.mu.Lock()
		more := s.gc.more || errors.Is(err, ErrCollectBusy)
		s.gc.more = false
		s.gc.mu.Unlock()
		if more { // skipped or cut short: again after the next quiet period
			select {
			case s.gc.kick <- struct{}{}:
			default:
			}
		}
		if errors.Is(err, ErrCollectBusy) {
			s.log.Debug("snapshot chunk collection skipped: a commit holds the collection lock")
		} else if err != nil {
			s.log.Warn("snapshot chunk collection", "err", err)
		} else if n > 0 {
			s.log.Info("snapshot chunks collected", "deleted", n, "ms", time.Since(t).Milliseconds())
		}
	}
}
