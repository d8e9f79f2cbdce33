package chunked

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"path"
	"strings"
	"sync"
	"unsafe"
)

// Packs: a commit appends its new (compressed) chunks to pack objects of about
// packTarget bytes instead of writing one object per chunk, and writes beside
// each pack an index listing its chunks and their byte ranges. Measured on the
// benchmark host (2026-11-30): one file per chunk cost 25–500 µs per chunk on
// ext4 (create, rename, later fsync; slowest while deleted files are
// discarded), so a first 512 MiB snapshot (33 k chunks) took 7 s and a 64 MiB
// one 3.7 s, and a diff commit spent most of its time creating ~170 files; on
// S3 every chunk was a request (~2,000 requests/s). Chunks keep their sha256
// ids and manifests list ids only: where a chunk lives is the indexes'
// business, loaded at start-up into the store's index (index.go), so packs
// can be rewritten without touching a manifest.
//
//	packs/<pack[:2]>/<pack>   concatenated zstd frames
//	index/<pack>.json         {"chunks":[{"id":…,"off":…,"len":…}…]}, written after the pack
//
// A pack whose index is missing (a crash between the two) is garbage; Collect
// deletes it unless a commit is writing it. A pack is deleted when none of its
// chunks is referenced by a live manifest (or pinned by a commit); one that is
// mostly garbage is rewritten with only its live chunks (repack, gc.go).
const packTarget = 8 << 20

// chunkLoc is where a chunk's stored bytes are: bytes [Off, Off+Len) of pack
// Pack, or (Pack "") the loose object chunks/<id[:2]>/<id> of stores written
// before packs.
type chunkLoc struct {
	Pack string
	Off  int64
	Len  int64
}

func packKey(id string) string  { return "packs/" + id[:2] + "/" + id }
func indexKey(id string) string { return "index/" + id + ".json" }

// packIndex is an index object.
type packIndex struct {
	Chunks []indexEntry `json:"chunks"`
}

type indexEntry struct {
	ID  string `json:"id"`
	Off int64  `json:"off"`
	Len int64  `json:"len"`
}

// packSet is what a store knows about one tier's packs (the backend's, or the
// outbox's): where each chunk is, and each pack's chunks. Methods need the
// store's idx.mu.
type packSet struct {
	locs  map[string]chunkLoc     // chunk id -> location
	packs map[string][]indexEntry // pack id -> its chunks
	// alt holds other copies of a chunk (two commits that stored it at once,
	// or a copy written again after the first was found damaged): a read
	// that fails on locs[id] tries them.
	alt map[string][]chunkLoc
	// writing lists packs a commit or upload is writing (pack object possibly
	// there, index not yet): never garbage.
	writing map[string]bool
}

func newPackSet() *packSet {
	return &packSet{locs: map[string]chunkLoc{}, packs: map[string][]indexEntry{}, alt: map[string][]chunkLoc{},
		writing: map[string]bool{}}
}

// addPack records a pack and points its chunks at it; a chunk's earlier copy
// elsewhere becomes an alternative.
func (p *packSet) addPack(id string, entries []indexEntry) {
	p.packs[id] = entries
	for _, e := range entries {
		if cur, ok := p.locs[e.ID]; ok && cur.Pack != id {
			p.alt[e.ID] = append(p.alt[e.ID], cur)
		}
		p.locs[e.ID] = chunkLoc{Pack: id, Off: e.Off, Len: e.Len}
	}
}

// dropPack forgets a pack and the chunk locations that point into it (an
// alternative copy takes a dropped location's place); it returns the chunk ids
// left without any location.
func (p *packSet) dropPack(id string) []string {
	var dropped []string
	for _, e := range p.packs[id] {
		alts := p.alt[e.ID][:0]
		for _, a := range p.alt[e.ID] {
			if a.Pack != id {
				alts = append(alts, a)
			}
		}
		if l, ok := p.locs[e.ID]; ok && l.Pack == id {
			if len(alts) > 0 {
				p.locs[e.ID], alts = alts[len(alts)-1], alts[:len(alts)-1]
			} else {
				delete(p.locs, e.ID)
				dropped = append(dropped, e.ID)
			}
		}
		if len(alts) == 0 {
			delete(p.alt, e.ID)
		} else {
			p.alt[e.ID] = alts
		}
	}
	delete(p.packs, id)
	return dropped
}

// tierBytes sums what the tier holds in chunks: every pack's entries (dead
// chunks GC has not repacked away included) and the loose chunks.
func (p *packSet) tierBytes() int64 {
	var n int64
	for _, entries := range p.packs {
		for _, e := range entries {
			n += e.Len
		}
	}
	for _, l := range p.locs {
		if l.Pack == "" {
			n += l.Len
		}
	}
	return n
}

// storedBytes sums the stored sizes of the chunks located in this tier.
func (p *packSet) storedBytes() (chunks int, bytes int64) {
	for _, l := range p.locs {
		chunks++
		bytes += l.Len
	}
	return chunks, bytes
}

// loadPacks reads a tier's indexes and loose chunks (stores written before
// packs) into a new packSet.
//
// An index that cannot be read or parsed (a crash before the commit synced it:
// no manifest can reference its chunks, as a manifest is written after the
// sync) is skipped with a warning; its pack is then garbage for Collect.
func loadPacks(ctx context.Context, b Backend, workers int, log *slog.Logger) (*packSet, error) {
	p := newPackSet()
	loose, err := b.List(ctx, "chunks/")
	if err != nil {
		return nil, fmt.Errorf("list chunks: %w", err)
	}
	for _, o := range loose {
		p.locs[path.Base(o.Key)] = chunkLoc{Len: o.Size}
	}
	idx, err := b.List(ctx, "index/")
	if err != nil {
		return nil, fmt.Errorf("list pack indexes: %w", err)
	}
	type loaded struct {
		id      string
		entries []indexEntry
		err     error
	}
	out := make([]loaded, len(idx))
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < max(1, workers); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				id, ok := strings.CutSuffix(path.Base(idx[i].Key), ".json")
				if !ok || !validPackID(id) {
					out[i].err = fmt.Errorf("unexpected object %s", idx[i].Key)
					continue
				}
				out[i].id = id
				out[i].entries, out[i].err = readIndex(ctx, b, id)
			}
		}()
	}
	for i := range idx {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, l := range out {
		switch {
		case l.err == nil:
			p.addPack(l.id, l.entries)
		case errors.Is(l.err, fs.ErrNotExist): // deleted since the listing
		case l.id != "" && !errors.Is(l.err, errUnreachable):
			log.Warn("snapshot store: unreadable pack index skipped; its pack is garbage", "pack", l.id, "err", l.err)
		default:
			return nil, l.err
		}
	}
	return p, nil
}

// errUnreachable marks an index that could not be fetched (as opposed to one
// that was fetched and is damaged).
var errUnreachable = errors.New("unreachable")

func readIndex(ctx context.Context, b Backend, id string) ([]indexEntry, error) {
	raw, err := getAll(ctx, b, indexKey(id))
	if err != nil {
		return nil, fmt.Errorf("pack %s: index: %w: %w", id, errUnreachable, err)
	}
	var x packIndex
	if err := json.Unmarshal(raw, &x); err != nil {
		return nil, fmt.Errorf("pack %s: index: %w", id, err)
	}
	for _, e := range x.Chunks {
		// Len bounds the read of the chunk (a buffer of Len bytes): an index
		// claiming a terabyte chunk must fail here, not at the allocation.
		if !validChunkID(e.ID) || e.Off < 0 || e.Len <= 0 || e.Len > maxStored || e.Off > math.MaxInt64-e.Len {
			return nil, fmt.Errorf("pack %s: index: bad entry %+v (want a sha256 id, offset >= 0, 1 to %d bytes)", id, e, maxStored)
		}
	}
	return x.Chunks, nil
}

// maxStored bounds a chunk's stored (zstd) size: zstd's worst case for an
// incompressible chunk of maxChunk bytes is a few hundred bytes more.
const maxStored = maxChunk + maxChunk/2

// validChunkID says whether id is a chunk id: 64 lowercase hex digits (sha256).
func validChunkID(id string) bool {
	if len(id) != 64 {
		return false
	}
	for _, c := range []byte(id) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func validPackID(id string) bool {
	if len(id) != 32 {
		return false
	}
	_, err := hex.DecodeString(id)
	return err == nil
}

func newPackID() string {
	return rnd() + rnd() + rnd()[:8]
}

// packWriter gathers one commit's new chunks into packs for one tier. It is
// safe for concurrent use by the commit's workers.
type packWriter struct {
	s      *Store
	target Backend
	set    *packSet

	// direct writes packs with directPutter where the backend has it: set
	// for a commit without a parent, which writes a pack per 8 MiB of memory.
	// Its packs then reach the disk as they are written, without a copy
	// into the page cache (the commit's largest CPU cost after sha256) and
	// without waiting for the final Sync. A diff commit's few packs go
	// through the page cache, as before.
	direct bool

	mu      sync.Mutex
	cur     *openPack
	pending map[string]int64 // chunk ids added by this commit -> stored size
}

type openPack struct {
	id      string
	buf     []byte
	entries []indexEntry
}

func (s *Store) newPackWriter(target Backend, set *packSet) *packWriter {
	return &packWriter{s: s, target: target, set: set, pending: map[string]int64{}}
}

// addWith appends a chunk's stored bytes, those fill appends to the
// current pack's buffer, under the writer's lock (so a raw frame is built in
// the pack, its bytes copied once), and writes the pack once it reaches
// packTarget. stored is their length; added is false when this commit
// already added the chunk (stored is then that copy's length).
func (w *packWriter) addWith(ctx context.Context, id string, fill func(dst []byte) []byte) (stored int64, added bool, err error) {
	w.mu.Lock()
	if z, ok := w.pending[id]; ok {
		w.mu.Unlock()
		return z, false, nil
	}
	if w.cur == nil {
		w.cur = &openPack{id: newPackID(), buf: (*packBufs.Get().(*[]byte))[:0]}
	}
	p := w.cur
	off := len(p.buf)
	p.buf = fill(p.buf)
	stored = int64(len(p.buf) - off)
	w.pending[id] = stored
	p.entries = append(p.entries, indexEntry{ID: id, Off: int64(off), Len: stored})
	if len(p.buf) < packTarget {
		w.mu.Unlock()
		return stored, true, nil
	}
	w.cur = nil
	w.mu.Unlock()
	return stored, true, w.write(ctx, p)
}

// has returns the stored size of a chunk this commit already added.
func (w *packWriter) has(id string) (int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	z, ok := w.pending[id]
	return z, ok
}

// flush writes the last, partly filled pack.
func (w *packWriter) flush(ctx context.Context) error {
	w.mu.Lock()
	p := w.cur
	w.cur = nil
	w.mu.Unlock()
	if p == nil {
		return nil
	}
	return w.write(ctx, p)
}

// write stores a pack, then its index, then makes its chunks known. After a
// successful Put the pack's buffer goes back to packBufs (the request is over;
// after a failed one an HTTP transport may still be reading it).
func (w *packWriter) write(ctx context.Context, p *openPack) error {
	err := w.s.writePack(ctx, w.target, w.set, p.id, p.buf, p.entries, w.direct)
	if err == nil && cap(p.buf) == packBufCap {
		b := p.buf[:0]
		packBufs.Put(&b)
	}
	p.buf = nil
	return err
}

// packBufCap is the capacity of a pack buffer: a pack is written once it
// reaches packTarget, so one more chunk never makes it grow.
const packBufCap = packTarget + maxStored

// packBufs holds the buffers of packs being filled (packWriter), each
// starting at a directAlign boundary (FS.PutDirect).
var packBufs = sync.Pool{New: func() any {
	raw := make([]byte, packBufCap+directAlign)
	off := (directAlign - int(uintptr(unsafe.Pointer(&raw[0]))%directAlign)) % directAlign
	b := raw[off : off : off+packBufCap]
	return &b
}}

// writePack stores pack id (data, then its index) in target and records it in
// set; with direct, through target's directPutter if it has one. Until it is
// recorded the pack is marked as being written, so Collect does not take it for
// garbage.
func (s *Store) writePack(ctx context.Context, target Backend, set *packSet, id string, data []byte, entries []indexEntry, direct bool) error {
	s.idx.mu.Lock()
	set.writing[id] = true
	s.idx.mu.Unlock()
	defer func() {
		s.idx.mu.Lock()
		delete(set.writing, id)
		s.idx.mu.Unlock()
	}()
	var err error
	if dp, ok := target.(directPutter); ok && direct {
		err = dp.PutDirect(ctx, packKey(id), data)
	} else {
		err = target.Put(ctx, packKey(id), bytes.NewReader(data), int64(len(data)))
	}
	if err != nil {
		return fmt.Errorf("pack %s: %w", id, err)
	}
	ix, err := json.Marshal(packIndex{Chunks: entries})
	if err != nil {
		return err
	}
	if err := target.Put(ctx, indexKey(id), bytes.NewReader(ix), int64(len(ix))); err != nil {
		return fmt.Errorf("pack %s: index: %w", id, err)
	}
	s.idx.mu.Lock()
	set.addPack(id, entries)
	if set == s.idx.known {
		for _, e := range entries {
			delete(s.idx.suspects, e.ID) // a new copy: the location now
		}
	}
	s.idx.mu.Unlock()
	return nil
}

// deletePack removes a pack's index, then the pack (a crash or error in
// between leaves a pack without index: garbage Collect removes). indexGone
// reports whether the index was removed: from then on the pack must not be
// used.
func deletePack(ctx context.Context, b Backend, id string) (indexGone bool, err error) {
	if err := b.Delete(ctx, indexKey(id)); err != nil {
		return false, err
	}
	return true, b.Delete(ctx, packKey(id))
}

// checkStored checks that comp is the stored form of chunk id's bytes: a
// zstd frame of bytes whose sha256 is id, or one sealed with a key of the
// store (seal.go) of bytes whose keyed hash under that key is id.
func (s *Store) checkStored(comp []byte, id string) error {
	z, k, err := s.unsealChunk(comp, id)
	if err != nil {
		return err
	}
	plain, err := s.dec.DecodeAll(z, nil)
	if err != nil {
		return fmt.Errorf("undecodable: %v", err)
	}
	if k.address(plain) != id {
		return errors.New(addressName(k) + " mismatch")
	}
	return nil
}

// readStored returns the stored bytes of a chunk at loc in tier b.
func readStored(ctx context.Context, b Backend, id string, loc chunkLoc) ([]byte, error) {
	if loc.Pack == "" {
		return getAll(ctx, b, chunkKey(id))
	}
	return b.GetRange(ctx, packKey(loc.Pack), loc.Off, loc.Len)
}

// orphanPacks lists the packs of tier b that have no index and are not being
// written. The caller holds no lock.
func (s *Store) orphanPacks(ctx context.Context, b Backend, set *packSet) ([]string, error) {
	objs, err := b.List(ctx, "packs/")
	if err != nil {
		return nil, err
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	var out []string
	for _, o := range objs {
		id := path.Base(o.Key)
		if !validPackID(id) {
			continue
		}
		if _, ok := set.packs[id]; ok || set.writing[id] {
			continue
		}
		out = append(out, id)
	}
	return out, nil
}

// isMissing reports whether err says an object (or the range of one) is absent.
func isMissing(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, io.ErrUnexpectedEOF)
}
