package chunked

import (
	"context"
	"fmt"
)

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
