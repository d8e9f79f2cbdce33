package chunked

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/torpor/torpor/snapshot"
)

// snapshotLocks holds one lock per snapshot id, taken by an Open of the
// snapshot while it verifies or rebuilds the opened copy, and by trimOpened
// before it removes that copy. An entry lives while someone holds or waits
// for its lock: the map holds only the snapshots being opened (or trimmed)
// this moment. mu guards locks and every entry's users; it is held only for
// the map update, never while waiting for an entry's lock.
type snapshotLocks struct {
	mu    sync.Mutex
	locks map[string]*snapshotLock
}

type snapshotLock struct {
	sync.Mutex
	users int // holders and waiters (snapshotLocks.mu)
}

// lock takes snapshot id's lock; the returned func releases it, once.
func (l *snapshotLocks) lock(id string) (unlock func()) {
	l.mu.Lock()
	e, ok := l.locks[id]
	if !ok {
		e = &snapshotLock{}
		l.locks[id] = e
	}
	e.users++
	l.mu.Unlock()
	e.Lock()
	return func() {
		e.Unlock()
		l.mu.Lock()
		if e.users--; e.users == 0 {
			delete(l.locks, id)
		}
		l.mu.Unlock()
	}
}

// len is the number of snapshots whose lock is held or waited for (tests).
func (l *snapshotLocks) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.locks)
}

// Open implements snapshot.Store.
func (s *Store) Open(ctx context.Context, id string) (string, snapshot.Manifest, error) {
	if dc, ok := s.deferredOf(id); ok {
		return s.openDeferred(ctx, id, dc.man)
	}
	d, err := s.openDoc(ctx, id)
	if err != nil {
		return "", d.Manifest, err
	}
	unlock := s.opening.lock(id)
	defer unlock()
	dir := s.opened(id)
	if _, err := os.Stat(dir); err == nil {
		if keys, err := s.verifyDir(ctx, id, dir, d); err == nil {
			if d.keys == nil {
				d.keys = keys
				s.docs.put(id, d)
			}
			s.useOpened(id)
			s.holdOpened(id)
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
	s.freshForOpen(ctx)
	build := filepath.Join(s.dir, "open", ".build-"+id+"-"+rnd())
	keys, err := s.assemble(ctx, id, build, d, true)
	for n := 0; err != nil && n < maxMissingRereads && s.refreshAfterMissing(ctx, err); n++ {
		_ = os.RemoveAll(build)
		keys, err = s.assemble(ctx, id, build, d, true)
	}
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
		s.docs.put(id, d)
	}
	s.useOpened(id)
	s.holdOpened(id)
	return dir, d.Manifest, nil
}

// openDoc is snapshot id's manifest for an Open: from the cache of parsed
// manifests, else read (and then cached). Errors are readDoc's.
func (s *Store) openDoc(ctx context.Context, id string) (doc, error) {
	if d, ok := s.docs.get(id); ok {
		return d, nil
	}
	d, err := s.readDoc(ctx, id)
	if err == nil {
		s.docs.put(id, d)
	}
	return d, err
}

// Verify reads every chunk of snapshot id from the durable backend (not the
// cache, not the opened copy; a snapshot still waiting for its upload reads the
// chunks the backend lacks from the outbox) and checks its hash.
//
// A deferred first commit's chunks are not stored yet: its opened copy is
// checked against the pending manifest's block sums instead (deferred.go).
func (s *Store) Verify(ctx context.Context, id string) (snapshot.Manifest, error) {
	if dc, ok := s.deferredOf(id); ok {
		_, m, err := s.openDeferred(ctx, id, dc.man)
		if err == nil {
			s.Release(id)
		}
		return m, err
	}
	d, err := s.readDoc(ctx, id)
	if err != nil {
		return d.Manifest, err
	}
	s.freshForOpen(ctx)
	_, err = s.assemble(ctx, id, "", d, false)
	for n := 0; err != nil && n < maxMissingRereads && s.refreshAfterMissing(ctx, err); n++ {
		_, err = s.assemble(ctx, id, "", d, false)
	}
	return d.Manifest, err
}

type fetch struct {
	file int
	f    *os.File
	offs []int64 // file offsets
	refs []chunkRef
	tier Backend // nil: the chunk is nowhere known
	locs []chunkLoc
	keys []*chunkSum // with f: where each chunk's key (fingerprint) goes
	size int64       // the chunks' bytes, decoded (at most fetchSpan but for a lone chunk)
}

// assemble fetches and verifies every chunk of d; with dir != "" it writes the
// files there. useCache selects reading through the chunk cache.
func (s *Store) assemble(ctx context.Context, id, dir string, d doc, useCache bool) ([][]chunkSum, error) {
	p, err := s.plan(ctx, id, dir, d, fetchSpan)
	defer p.close()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
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
				if err := s.runFetch(ctx, id, d.Files[ft.file].Name, d.key, ft, useCache); err != nil {
					fail(err)
				}
			}
		}()
	}
	for _, ft := range p.fetches {
		if ctx.Err() != nil {
			break
		}
		fetches <- ft
	}
	close(fetches)
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	return p.keys, ctx.Err()
}

// fetchPlan is how a snapshot's chunks are fetched: the fetches, in file
// order, and with a directory the files they write.
type fetchPlan struct {
	files   []*os.File // with a directory: one per file of the doc, opened read-write
	fetches []*fetch
	keys    [][]chunkSum // with a directory: each chunk's key, filled by its fetch
	// of[file][chunk] is the index in fetches of the fetch holding the
	// chunk, -1 for an all-zero chunk (never fetched: the file is created
	// at its size, so it reads zeros).
	of [][]int32
}

func (p *fetchPlan) close() {
	if p == nil {
		return
	}
	for _, f := range p.files {
		f.Close()
	}
}

// plan groups the chunks of d into fetches of up to span bytes (runs of
// neighbouring chunks of one pack) and, with dir != "", creates the files
// there at their sizes. The returned plan is never nil; close it.
func (s *Store) plan(ctx context.Context, id, dir string, d doc, span int64) (*fetchPlan, error) {
	p := &fetchPlan{of: make([][]int32, len(d.Files))}
	if dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return p, err
		}
		p.keys = make([][]chunkSum, len(d.Files))
	}
	reloaded := false
	var cur *fetch
	var lo, hi int64
	emit := func() {
		if cur != nil {
			p.fetches = append(p.fetches, cur)
			cur = nil
		}
	}
	for fi, fc := range d.Files {
		var f *os.File
		if dir != "" {
			var err error
			f, err = os.OpenFile(filepath.Join(dir, fc.Name), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
			if err != nil {
				return p, err
			}
			p.files = append(p.files, f)
			if err := f.Truncate(d.Manifest.Files[fi].Bytes); err != nil {
				return p, err
			}
			p.keys[fi] = make([]chunkSum, len(fc.Chunks))
		}
		p.of[fi] = make([]int32, len(fc.Chunks))
		var off int64
		for j, r := range fc.Chunks {
			if r.ID == "" {
				if p.keys != nil {
					p.keys[fi][j] = zeroKey(r.Len)
				}
				p.of[fi][j] = -1
				off += r.Len
				continue
			}
			tier, l, ok := s.locate(r.ID)
			if !ok && !reloaded {
				// The backend could not be listed at start, or another
				// writer of the bucket (another node of a cluster) added
				// packs since: list it now.
				reloaded = true
				if err := s.reloadKnown(ctx); err != nil {
					return p, fmt.Errorf("snapshot %s: %w", id, err)
				}
				tier, l, ok = s.locate(r.ID)
			}
			joins := cur != nil && ok && cur.tier == tier && l.Pack != "" && cur.locs[0].Pack == l.Pack &&
				cur.file == fi && len(cur.refs) < fetchMax && max(hi, l.Off+l.Len)-min(lo, l.Off) <= span &&
				cur.size+r.Len <= span
			if !joins {
				emit()
				cur = &fetch{file: fi, f: f, tier: tier}
				lo, hi = l.Off, l.Off+l.Len
			}
			lo, hi = min(lo, l.Off), max(hi, l.Off+l.Len)
			p.of[fi][j] = int32(len(p.fetches))
			cur.offs = append(cur.offs, off)
			cur.refs = append(cur.refs, r)
			cur.locs = append(cur.locs, l)
			cur.size += r.Len
			if p.keys != nil {
				cur.keys = append(cur.keys, &p.keys[fi][j])
			}
			if l.Pack == "" || tier == nil {
				emit()
			}
			off += r.Len
		}
	}
	emit()
	return p, ctx.Err()
}

// runFetch gets the chunks of ft (from the cache when allowed and valid, else
// with one ranged read of their pack), verifies them (addresses under key k,
// the manifest's) and writes them to ft.f.
func (s *Store) runFetch(ctx context.Context, snap, file string, k *Key, ft *fetch, useCache bool) error {
	corrupt := func(i int, reason string) error {
		return &snapshot.CorruptError{Snapshot: snap, File: file,
			Reason: fmt.Sprintf("chunk %s at offset %d: %s", ft.refs[i].ID, ft.offs[i], reason)}
	}
	missing := func(i int) error {
		if ok, _ := s.outbox.Exists(ctx, manifestKey(snap)); ok {
			return corrupt(i, "missing: the snapshot is not durable yet (its upload is pending) and neither its local copy nor the backend has this chunk")
		}
		return chunkMissing{CorruptError: corrupt(i, "missing").(*snapshot.CorruptError),
			id: ft.refs[i].ID, tier: ft.tier, at: ft.locs[i]}
	}
	// Each chunk decodes into its own slot of one buffer, side by side, so
	// neighbours in the file are written with one write (writeRuns).
	var total int64
	for _, r := range ft.refs {
		total += r.Len
	}
	dec, release := getFetchBuf(total)
	defer release()
	slots, pos := make([][]byte, len(ft.refs)), make([]int64, len(ft.refs))
	for i, at := 0, int64(0); i < len(ft.refs); i++ {
		slots[i], pos[i] = dec[at:at:at+ft.refs[i].Len], at
		at += ft.refs[i].Len
	}
	out := make([][]byte, len(ft.refs))
	var miss []int
	for i, r := range ft.refs {
		if useCache && s.cache != nil {
			if comp, ok := s.cache.Get(r.ID); ok {
				if data, err := s.decodeInto(slots[i], comp, r, k); err == nil {
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
		var releaseSpan func()
		if span, releaseSpan, err = readSpan(ctx, ft.tier, packKey(ft.locs[0].Pack), lo, hi-lo); err == nil {
			defer releaseSpan()
		} else {
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
			data, err = s.decodeInto(slots[i], comp, r, k)
			if err != nil && ft.tier != Backend(s.b) {
				// A damaged outbox copy: the backend may hold the chunk too.
				if c, berr := s.fromBackend(ctx, r.ID); berr == nil {
					comp = c
					data, err = s.decodeInto(slots[i], comp, r, k)
				}
			}
		}
		if err != nil && ft.tier == Backend(s.b) {
			// Another copy of the chunk, if the backend has one; else the next
			// commit that has the chunk's bytes stores it again (suspect).
			if d, c, ok := s.fromAlternative(ctx, r, l, k); ok {
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
		if err := writeRuns(ft, out, dec, pos); err != nil {
			return err
		}
		if ft.keys != nil {
			for i, data := range out {
				*ft.keys[i] = fingerprint(data)
			}
		}
	}
	return nil
}

// fromAlternative reads chunk r from a copy in the backend other than bad (an
// alternative, or its current location if it moved since it was looked up)
// and verifies it; that copy becomes the chunk's location.
func (s *Store) fromAlternative(ctx context.Context, r chunkRef, bad chunkLoc, k *Key) (data, comp []byte, ok bool) {
	s.idx.mu.Lock()
	alts := append([]chunkLoc(nil), s.idx.known.alt[r.ID]...)
	if cur, ok := s.idx.known.locs[r.ID]; ok && cur != bad {
		alts = append(alts, cur) // moved meanwhile (repack)
	}
	s.idx.mu.Unlock()
	for _, a := range alts {
		if a == bad {
			continue
		}
		c, err := readStored(ctx, s.b, r.ID, a)
		if err != nil {
			continue
		}
		d, err := s.decode(c, r, k)
		if err != nil {
			continue
		}
		s.idx.mu.Lock()
		if cur, ok := s.idx.known.locs[r.ID]; ok && cur == bad {
			s.idx.known.locs[r.ID] = a
			kept := s.idx.known.alt[r.ID][:0]
			for _, x := range s.idx.known.alt[r.ID] {
				if x != a {
					kept = append(kept, x)
				}
			}
			s.idx.known.alt[r.ID] = append(kept, bad)
		}
		s.idx.mu.Unlock()
		return d, c, true
	}
	return nil, nil, false
}

// fromBackend reads a chunk's stored bytes from the backend (not the outbox).
func (s *Store) fromBackend(ctx context.Context, cid string) ([]byte, error) {
	s.idx.mu.Lock()
	l, ok := s.idx.known.locs[cid]
	s.idx.mu.Unlock()
	if !ok {
		return nil, fs.ErrNotExist
	}
	return readStored(ctx, s.b, cid, l)
}

// decode returns the bytes of chunk ref from its stored form comp (opened
// when sealed, decompressed) and checks them against ref's address under k,
// the key of the manifest naming it (nil: sha256). Errors say what failed.
func (s *Store) decode(comp []byte, ref chunkRef, k *Key) ([]byte, error) {
	return s.decodeInto(make([]byte, 0, ref.Len), comp, ref, k)
}

// decodeInto is decode appending to dst (given empty, with room for ref.Len
// bytes: then nothing is allocated).
func (s *Store) decodeInto(dst, comp []byte, ref chunkRef, k *Key) ([]byte, error) {
	z, _, err := s.unsealChunk(comp, ref.ID)
	if err != nil {
		return nil, err
	}
	data, err := s.dec.DecodeAll(z, dst)
	if err != nil {
		return nil, fmt.Errorf("undecodable: %v", err)
	}
	if int64(len(data)) != ref.Len {
		return nil, fmt.Errorf("size %d != %d", len(data), ref.Len)
	}
	if sum := k.address(data); sum != ref.ID {
		return nil, fmt.Errorf("%s mismatch: got %s", addressName(k), sum)
	}
	return data, nil
}

// addressName names the hash chunk addresses are under k: "sha256", or
// "keyed hash" (HMAC-SHA256, seal.go).
func addressName(k *Key) string {
	if k == nil {
		return "sha256"
	}
	return "keyed hash"
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
					ok, check := false, addressName(d.key)
					switch {
					case known:
						ok, check = *t.key == t.want, "fingerprint"
					case t.ref.ID == "":
						ok = allZero(b)
					default:
						ok = d.key.address(b) == t.ref.ID
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
