package chunked

import (
	"context"
	"fmt"
	"sync"
)

// index is what a store knows of where chunks are, in the backend (known) and
// in the outbox (outKnown), loaded from their pack indexes (pack.go) and kept
// up to date by commits, uploads and Collect; and the state by which commits
// and Collect stay out of each other's way (pins, deleting, protected; see
// the package comment's Garbage collection). mu guards every field but
// loadMu. The commit path takes mu for every chunk it stores and once per
// segment it reuses from a parent: keep what it does under mu short.
type index struct {
	// loadMu makes loadKnown single-flight: a Collect never runs beside a
	// load that could merge back a pack it deleted. Taken before mu.
	loadMu sync.Mutex

	mu sync.Mutex
	// known: the backend's chunks and packs.
	known *packSet
	// loaded: known holds a full listing of the backend (New, or
	// ensureKnown later, could reach it).
	loaded bool
	// outKnown: the outbox's chunks and packs.
	outKnown *packSet
	// outGen counts manifests written to the outbox (outGeneration).
	outGen uint64
	// suspects: backend copies of chunks found damaged or missing
	// (Store.suspect); nil until the first.
	suspects map[string]chunkLoc

	// pins counts the in-progress commits using each chunk (pin).
	pins map[string]int
	// deleting holds the chunks Collect is deleting; the channel is closed
	// when the deletion is over (a commit that needs one waits for it).
	deleting map[string]chan struct{}
	// gcActive: a Collect runs; protected then holds the chunks unpinned
	// since it started, which it must not delete either.
	gcActive  bool
	protected map[string]bool

	// gone holds what Collect takes out of known (pack ids, and loose
	// chunks as looseGone(id)) from then until no listing of the backend
	// can have seen it: true while it is being deleted, false once deleted
	// but a listing that started before is still running (loading). A
	// listing merges none of it back: the next commit would deduplicate
	// against chunks that are gone (TestCollectNotUndoneByConcurrentListing).
	gone    map[string]bool
	loading bool
}

// looseGone is the key of loose chunk id in index.gone.
func looseGone(id string) string { return "chunk:" + id }

// beginLoad and endLoad bracket a listing of the backend (loadKnown,
// refreshKnown; the caller holds loadMu, not mu).
func (x *index) beginLoad() {
	x.mu.Lock()
	x.loading = true
	x.mu.Unlock()
}

func (x *index) endLoad() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.loading = false
	for k, deleting := range x.gone {
		if !deleting {
			delete(x.gone, k)
		}
	}
}

// removing records that Collect took key (a pack id or looseGone(id)) out of
// known and is deleting it; removed, that the deletion is over (done or
// failed). The caller holds mu.
func (x *index) removing(key string) { x.gone[key] = true }

func (x *index) removed(key string) {
	if x.loading {
		x.gone[key] = false
	} else {
		delete(x.gone, key)
	}
}

func newIndex() index {
	return index{known: newPackSet(), outKnown: newPackSet(), pins: map[string]int{}, deleting: map[string]chan struct{}{}, gone: map[string]bool{}}
}

// loadKnown reads the backend's pack indexes (and lists its loose chunks) into
// known, merging: entries added meanwhile stay.
func (s *Store) loadKnown(ctx context.Context) error {
	s.idx.loadMu.Lock()
	defer s.idx.loadMu.Unlock()
	s.idx.beginLoad()
	defer s.idx.endLoad()
	set, err := loadPacks(ctx, s.b, s.workers, s.log)
	if err != nil {
		return fmt.Errorf("snapshot store: %w", err)
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	gone := s.idx.gone
	for id, entries := range set.packs {
		if _, ok := s.idx.known.packs[id]; !ok && !gone[id] {
			s.idx.known.packs[id] = entries
		}
	}
	for id, l := range set.locs {
		if l.Pack != "" && gone[l.Pack] || l.Pack == "" && gone[looseGone(id)] {
			continue
		}
		if _, ok := s.idx.known.locs[id]; !ok {
			s.idx.known.locs[id] = l
		}
	}
	for id, alts := range set.alt {
		if _, ok := s.idx.known.alt[id]; !ok {
			kept := alts[:0:0]
			for _, a := range alts {
				if !gone[a.Pack] {
					kept = append(kept, a)
				}
			}
			if len(kept) > 0 {
				s.idx.known.alt[id] = kept
			}
		}
	}
	s.idx.loaded = true
	return nil
}

// reloadKnown lists the backend again for an open that met a chunk its index
// does not place: on a shared backend as refreshKnown (packs other stores
// deleted leave the index, so a chunk stored again elsewhere takes its new
// place), else as loadKnown.
func (s *Store) reloadKnown(ctx context.Context) error {
	if s.gc.cluster != nil {
		return s.refreshKnown(ctx)
	}
	return s.loadKnown(ctx)
}

// ensureKnown lists the backend once if New could not.
func (s *Store) ensureKnown(ctx context.Context) error {
	s.idx.mu.Lock()
	ok := s.idx.loaded
	s.idx.mu.Unlock()
	if ok {
		// A load that started before loaded was set may still run: wait
		// for it (loadMu), so it cannot merge stale entries back later.
		s.idx.loadMu.Lock()
		s.idx.loadMu.Unlock()
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
	s.idx.outKnown = set
	return nil
}

// pin marks chunk id as used by an in-progress commit, waiting for a deletion of
// it by Collect to finish first.
func (x *index) pin(id string) {
	x.mu.Lock()
	for {
		ch, ok := x.deleting[id]
		if !ok {
			break
		}
		x.mu.Unlock()
		<-ch
		x.mu.Lock()
	}
	x.pins[id]++
	x.mu.Unlock()
}

func (x *index) unpin(ids []string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, id := range ids {
		if x.pins[id]--; x.pins[id] <= 0 {
			delete(x.pins, id)
		}
		if x.gcActive {
			x.protected[id] = true
		}
	}
}

// storedLocked returns where chunk id is stored for a commit: in the durable
// tier unless that copy is a suspect (Store.suspect: store it again), or with
// async in the outbox. The caller holds x.mu.
func (x *index) storedLocked(id string, async bool) (chunkLoc, bool) {
	l, ok := x.known.locs[id]
	if bad, suspect := x.suspects[id]; ok && suspect && bad == l {
		ok = false
	}
	if !ok && async {
		l, ok = x.outKnown.locs[id]
	}
	return l, ok
}

// locate returns the tier holding chunk cid (the outbox first: a snapshot
// waiting for its upload) and where in it.
func (s *Store) locate(cid string) (Backend, chunkLoc, bool) {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if l, ok := s.idx.outKnown.locs[cid]; ok {
		return s.outbox, l, true
	}
	if l, ok := s.idx.known.locs[cid]; ok {
		return s.b, l, true
	}
	return nil, chunkLoc{}, false
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
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if cur, ok := s.idx.known.locs[cid]; !ok || cur != l {
		return
	}
	if s.idx.suspects == nil {
		s.idx.suspects = map[string]chunkLoc{}
	}
	if _, seen := s.idx.suspects[cid]; !seen {
		s.log.Warn("snapshot store: damaged or missing chunk; the next commit that has its bytes stores it again",
			"chunk", cid, "pack", l.Pack)
	}
	s.idx.suspects[cid] = l
}
