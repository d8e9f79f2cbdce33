package chunked

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Opened copies: open/<id> holds a snapshot's files uncompressed, the ones the
// next resume hands to runsc (warm resume) and the parent a diff hibernate
// compares against. Without a bound they grew with every live snapshot (a
// reviewer's 11 forks of a 64 MiB sandbox kept 781 MiB in open/ against 75 MiB
// of packs). Config.OpenBytes bounds them: once the copies exceed it, the least
// recently used ones are removed; their snapshots resume cold (reassembled from
// the chunks: ~240 ms against ~180 ms at 64 MiB on local disk, measured).

// openGrace is how long a copy stays after its last use whatever the bound:
// Open returns the directory to a restore that opens the files right after
// (a removed file that runsc already opened stays readable; one it has not
// opened yet would be missing).
var openGrace = time.Minute // a variable for tests

type openedCopy struct {
	bytes int64
	used  time.Time
}

type openedSet struct {
	mu     sync.Mutex
	limit  int64 // bytes; 0: no bound
	copies map[string]openedCopy
	// inUse counts, per snapshot, the Opens not yet released (Release):
	// restores that may still read the copy.
	inUse map[string]int
	// trimming: a trimOpened runs.
	trimming bool
}

// scanOpened sets the bound (bytes, 0: none) and records the copies a previous
// process left in open/ (their modification time as last use).
func (s *Store) scanOpened(limit int64) {
	s.openCopies = &openedSet{limit: limit, copies: map[string]openedCopy{}, inUse: map[string]int{}}
	ents, _ := os.ReadDir(filepath.Join(s.dir, "open"))
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		n, used := dirBytes(s.opened(e.Name()))
		s.openCopies.copies[e.Name()] = openedCopy{n, used}
	}
}

// dirBytes sums the sizes of the files in dir and returns the latest mtime.
func dirBytes(dir string) (int64, time.Time) {
	var n int64
	var latest time.Time
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if st, err := e.Info(); err == nil && st.Mode().IsRegular() {
			n += st.Size()
			if st.ModTime().After(latest) {
				latest = st.ModTime()
			}
		}
	}
	return n, latest
}

// useOpened records that snapshot id's opened copy was just written or used
// and, when the copies exceed the bound, trims them in the background (an
// Open or commit never waits for another snapshot's lock).
func (s *Store) useOpened(id string) {
	set := s.openCopies
	n, _ := dirBytes(s.opened(id))
	set.mu.Lock()
	set.copies[id] = openedCopy{n, time.Now()}
	var total int64
	for _, c := range set.copies {
		total += c.bytes
	}
	over := set.limit > 0 && total > set.limit && !set.trimming
	if over {
		set.trimming = true
	}
	set.mu.Unlock()
	if over {
		go s.trimOpened()
	}
}

// trimOpened removes least recently used copies, none used within openGrace,
// while the copies exceed the bound.
func (s *Store) trimOpened() {
	set := s.openCopies
	defer func() {
		set.mu.Lock()
		set.trimming = false
		set.mu.Unlock()
	}()
	for {
		pending := map[string]bool{} // deferred commits' copies are all there is of them
		for _, id := range s.deferredIDs() {
			pending[id] = true
		}
		set.mu.Lock()
		var total int64
		victim, oldest := "", time.Now().Add(-openGrace)
		for cid, c := range set.copies {
			total += c.bytes
			if c.used.Before(oldest) && !pending[cid] {
				victim, oldest = cid, c.used
			}
		}
		set.mu.Unlock()
		if total <= set.limit || victim == "" {
			return
		}
		unlock := s.opening.lock(victim) // not while an Open of it verifies or rebuilds
		set.mu.Lock()
		c, ok := set.copies[victim]
		stale := ok && c.used.Equal(oldest) // not used again meanwhile
		if stale {
			delete(set.copies, victim)
		}
		set.mu.Unlock()
		if stale {
			if err := os.RemoveAll(s.opened(victim)); err != nil {
				s.log.Warn("snapshot store: removing an opened copy over the bound", "snapshot", victim, "err", err)
			} else {
				s.log.Debug("snapshot store: opened copy removed (least recently used, over the bound)", "snapshot", victim, "bytes", c.bytes)
			}
		}
		unlock()
	}
}

// dropOpened forgets snapshot id's opened copy (deleted or set aside).
func (s *Store) dropOpened(id string) {
	s.openCopies.mu.Lock()
	delete(s.openCopies.copies, id)
	s.openCopies.mu.Unlock()
}

// holdOpened counts an Open of snapshot id that its caller has not released
// yet (under id's opening lock, so a Release of another Open sees it).
func (s *Store) holdOpened(id string) {
	s.openCopies.mu.Lock()
	s.openCopies.inUse[id]++
	s.openCopies.mu.Unlock()
}

// Release implements snapshot.Releaser: the restore (or restores) that an
// Open of snapshot id returned its directory to have opened the files. With
// an encryption key, the opened copy is removed once no Open of id is
// unreleased: it is plain text of a sandbox's memory, and a restored
// instance reads the files through descriptors its restore opened
// (snapshot.Store.Open). Without a key the copy stays for a warm resume
// (bounded by Config.OpenBytes). Errors removing the copy are logged; the
// next start removes what is left (Recover).
func (s *Store) Release(id string) {
	set := s.openCopies
	set.mu.Lock()
	if set.inUse[id]--; set.inUse[id] <= 0 {
		delete(set.inUse, id)
	}
	busy := set.inUse[id] > 0
	set.mu.Unlock()
	if s.key == nil || busy {
		return
	}
	unlock := s.opening.lock(id) // not while an Open of it verifies or rebuilds
	defer unlock()
	set.mu.Lock()
	busy = set.inUse[id] > 0 // opened again meanwhile
	if !busy {
		delete(set.copies, id)
	}
	set.mu.Unlock()
	if busy {
		return
	}
	if err := os.RemoveAll(s.opened(id)); err != nil {
		s.log.Warn("snapshot store: removing a plain opened copy after its restore", "snapshot", id, "err", err)
		return
	}
	s.log.Debug("snapshot store: opened copy removed after its restore (encrypted store)", "snapshot", id)
}
