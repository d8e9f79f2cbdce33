package chunked

import (
	"container/list"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
)

// Cache is a local on-disk cache of stored (compressed) chunks in front of a
// remote backend, bounded by a byte limit with least-recently-used eviction. It is
// only a cache: a chunk missing from it, evicted or corrupt is fetched again from
// the durable backend, so resumability never depends on it (every chunk read
// from it is checked against its address before use).
//
// Chunks are kept many to a file: each file (`<dir>/<ab>/<random>.cache`) holds
// a header listing its chunks (id, offset, length) and then their bytes, so a
// cold resume that fills the cache with the 33,000 chunks of 512 MiB writes a
// few hundred files rather than one per chunk (a file costs ~0.5 ms here,
// 2026-11-30: one per chunk kept a core busy for seconds after every cold
// resume from S3). A file is the unit of eviction; the LRU order lives in
// memory, a chunk's use moving its file to the front, and is rebuilt from the
// files' modification times at start-up. Removing a chunk forgets it; its
// file goes once it holds no chunk anyone may read.
type Cache struct {
	dir   string
	limit int64

	mu    sync.Mutex
	used  int64                    // bytes of the files in lru
	lru   *list.List               // front = most recently used; values are *cacheFile
	index map[string]cacheLocation // chunk id → where
}

type cacheFile struct {
	name string
	size int64
	ids  []string // the chunks it holds
	live int      // of which in index (pointing here)
}

type cacheLocation struct {
	file     *list.Element
	off, len int64
}

// cacheFileBytes is the most a cache file holds (less when the limit is small:
// a file is at most a quarter of it, so the LRU still has several to evict).
const cacheFileBytes = 4 << 20

// cacheMagic starts every cache file; the header is then the number of chunks
// (uint32) and per chunk its id (64 hex digits), offset and length (uint64s),
// little-endian.
const cacheMagic = "torpor-cache-1\n"

const cacheEntryBytes = 64 + 8 + 8

// NewCache opens (creating if needed) a cache in dir holding at most limit bytes.
// Files it cannot read (damaged, or chunk files of an older build) are removed.
func NewCache(dir string, limit int64) (*Cache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	c := &Cache{dir: dir, limit: limit, lru: list.New(), index: map[string]cacheLocation{}}
	type found struct {
		name    string
		size    int64
		mt      int64
		entries []cacheItemLoc
	}
	var all []found
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		name, ok := strings.CutSuffix(d.Name(), ".cache")
		info, ierr := d.Info()
		if !ok || ierr != nil {
			_ = os.Remove(p) // a temporary file, or a chunk file of an older build
			return nil
		}
		entries, err := readCacheHeader(p, info.Size())
		if err != nil {
			_ = os.Remove(p)
			return nil
		}
		all = append(all, found{name, info.Size(), info.ModTime().UnixNano(), entries})
		return nil
	})
	sort.Slice(all, func(i, j int) bool { return all[i].mt > all[j].mt })
	for _, f := range all {
		c.add(f.name, f.size, f.entries, false)
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

type cacheItemLoc struct {
	id       string
	off, len int64
}

// readCacheHeader returns the chunks a cache file of size bytes lists, or an
// error when its header is damaged or names bytes past its end.
func readCacheHeader(p string, size int64) ([]cacheItemLoc, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	head := make([]byte, len(cacheMagic)+4)
	if _, err := f.ReadAt(head, 0); err != nil || string(head[:len(cacheMagic)]) != cacheMagic {
		return nil, errors.New("not a cache file")
	}
	n := int64(binary.LittleEndian.Uint32(head[len(cacheMagic):]))
	if int64(len(head))+n*cacheEntryBytes > size {
		return nil, errors.New("truncated header")
	}
	raw := make([]byte, n*cacheEntryBytes)
	if _, err := f.ReadAt(raw, int64(len(head))); err != nil {
		return nil, err
	}
	out := make([]cacheItemLoc, n)
	for i := range out {
		e := raw[int64(i)*cacheEntryBytes:]
		out[i] = cacheItemLoc{id: string(e[:64]), off: int64(binary.LittleEndian.Uint64(e[64:])), len: int64(binary.LittleEndian.Uint64(e[72:]))}
		if !validChunkID(out[i].id) || out[i].len <= 0 || out[i].off < 0 || out[i].off > size-out[i].len {
			return nil, fmt.Errorf("bad entry %d", i)
		}
	}
	return out, nil
}

func (c *Cache) path(name string) string { return filepath.Join(c.dir, name[:2], name+".cache") }

// fileLimit is the most one file holds.
func (c *Cache) fileLimit() int64 { return max(1, min(cacheFileBytes, c.limit/4)) }

// Get returns the cached bytes of chunk id, or ok=false.
func (c *Cache) Get(id string) (b []byte, ok bool) {
	c.mu.Lock()
	l, ok := c.index[id]
	var name string
	if ok {
		c.lru.MoveToFront(l.file)
		name = l.file.Value.(*cacheFile).name
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	f, err := os.Open(c.path(name))
	if err != nil {
		c.Remove(id)
		return nil, false
	}
	defer f.Close()
	b = make([]byte, l.len)
	if _, err := f.ReadAt(b, l.off); err != nil {
		c.Remove(id)
		return nil, false
	}
	return b, true
}

// Put adds chunk id's stored bytes, evicting least recently used files beyond
// the limit. Errors are ignored: the cache is best-effort.
func (c *Cache) Put(id string, b []byte) { c.putMany([]cacheItem{{id, b}}) }

// putMany writes the chunks of items the cache does not hold yet into one file
// (its caller keeps them within fileLimit) and indexes them.
func (c *Cache) putMany(items []cacheItem) {
	c.mu.Lock()
	var todo []cacheItem
	seen := map[string]bool{}
	for _, it := range items {
		if l, ok := c.index[it.id]; ok {
			c.lru.MoveToFront(l.file)
		} else if !seen[it.id] && int64(len(it.b)) <= c.limit {
			seen[it.id] = true
			todo = append(todo, it)
		}
	}
	c.mu.Unlock()
	if len(todo) == 0 {
		return
	}
	hlen := int64(len(cacheMagic)+4) + int64(len(todo))*cacheEntryBytes
	size := hlen
	for _, it := range todo {
		size += int64(len(it.b))
	}
	if size > c.limit {
		return
	}
	buf := make([]byte, 0, size)
	buf = append(buf, cacheMagic...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(todo)))
	locs := make([]cacheItemLoc, len(todo))
	off := hlen
	for i, it := range todo {
		locs[i] = cacheItemLoc{it.id, off, int64(len(it.b))}
		buf = append(buf, it.id...)
		buf = binary.LittleEndian.AppendUint64(buf, uint64(off))
		buf = binary.LittleEndian.AppendUint64(buf, uint64(len(it.b)))
		off += int64(len(it.b))
	}
	for _, it := range todo {
		buf = append(buf, it.b...)
	}
	name := rnd()
	p := c.path(name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, buf, 0o600); err != nil {
		_ = os.Remove(tmp)
		return
	}
	if err := os.Rename(tmp, p); err != nil {
		_ = os.Remove(tmp)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.add(name, size, locs, true)
	c.evictLocked()
}

// add indexes file name (size bytes, holding entries) as the most (front) or
// least recently used; chunks indexed already keep their place. The caller
// holds mu.
func (c *Cache) add(name string, size int64, entries []cacheItemLoc, front bool) {
	cf := &cacheFile{name: name, size: size}
	var e *list.Element
	if front {
		e = c.lru.PushFront(cf)
	} else {
		e = c.lru.PushBack(cf)
	}
	c.used += size
	for _, it := range entries {
		if _, ok := c.index[it.id]; !ok {
			c.index[it.id] = cacheLocation{file: e, off: it.off, len: it.len}
			cf.ids = append(cf.ids, it.id)
			cf.live++
		}
	}
	if cf.live == 0 {
		c.dropLocked(e)
	}
}

// Remove drops chunk id from the cache.
func (c *Cache) Remove(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.index[id]
	if !ok {
		return
	}
	delete(c.index, id)
	cf := l.file.Value.(*cacheFile)
	if cf.live--; cf.live == 0 {
		c.dropLocked(l.file)
	}
}

// Clear empties the cache.
func (c *Cache) Clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.lru.Len() > 0 {
		c.dropLocked(c.lru.Back())
	}
}

// Used returns the bytes held (the cache's files) and the number of chunks.
func (c *Cache) Used() (bytes int64, chunks int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used, len(c.index)
}

func (c *Cache) evictLocked() {
	for c.used > c.limit && c.lru.Len() > 0 {
		c.dropLocked(c.lru.Back())
	}
}

// dropLocked removes file e and forgets its chunks.
func (c *Cache) dropLocked(e *list.Element) {
	cf := e.Value.(*cacheFile)
	c.lru.Remove(e)
	c.used -= cf.size
	for _, id := range cf.ids {
		if l, ok := c.index[id]; ok && l.file == e {
			delete(c.index, id)
		}
	}
	_ = os.Remove(c.path(cf.name))
}

// cacheFiller writes chunks into a Cache in the background, so that a cold
// resume does not wait for the cache's files: what is queued when it takes the
// next batch goes into one file of up to the cache's fileLimit. At most
// fillBudget bytes wait; chunks beyond that are not cached (the cache is
// best-effort).
type cacheFiller struct {
	c       *Cache
	ch      chan cacheItem
	pending atomic.Int64 // bytes queued
	idle    sync.Cond    // signalled when the queue drains
	mu      sync.Mutex
	done    chan struct{}
}

type cacheItem struct {
	id string
	b  []byte
}

const fillBudget = 64 << 20

func newCacheFiller(c *Cache) *cacheFiller {
	f := &cacheFiller{c: c, ch: make(chan cacheItem, 1<<14), done: make(chan struct{})}
	f.idle.L = &f.mu
	go func() {
		defer close(f.done)
		limit := f.c.fileLimit()
		for it := range f.ch {
			batch, n := []cacheItem{it}, int64(len(it.b))
		more:
			for n < limit {
				select {
				case it, ok := <-f.ch:
					if !ok {
						break more
					}
					batch, n = append(batch, it), n+int64(len(it.b))
				default:
					break more
				}
			}
			f.c.putMany(batch)
			for _, it := range batch {
				f.settle(len(it.b))
			}
		}
	}()
	return f
}

// put queues chunk id's stored bytes (which the caller no longer changes).
func (f *cacheFiller) put(id string, b []byte) {
	if f.pending.Load()+int64(len(b)) > fillBudget {
		return
	}
	f.pending.Add(int64(len(b)))
	select {
	case f.ch <- cacheItem{id, b}:
	default:
		f.settle(len(b))
	}
}

// settle takes n bytes off the queue's count, waking wait when it drains.
func (f *cacheFiller) settle(n int) {
	if f.pending.Add(-int64(n)) == 0 {
		f.mu.Lock()
		f.idle.Broadcast()
		f.mu.Unlock()
	}
}

// wait returns once nothing is queued (tests).
func (f *cacheFiller) wait() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for f.pending.Load() > 0 {
		f.idle.Wait()
	}
}

// close writes what is queued and stops the filler.
func (f *cacheFiller) close() {
	close(f.ch)
	<-f.done
}
