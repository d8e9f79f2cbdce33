package chunked

import (
	"container/list"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
)

// Cache is a local on-disk cache of stored (compressed) chunks in front of a
// remote backend, bounded by a byte limit with least-recently-used eviction. It is
// only a cache: a chunk missing from it, evicted or corrupt is fetched again from
// the durable backend, so resumability never depends on it. Entries are files
// named by chunk id; the LRU order lives in memory and is rebuilt from the files'
// modification times at start-up.
type Cache struct {
	dir   string
	limit int64

	mu    sync.Mutex
	used  int64
	lru   *list.List // front = most recently used; values are *cacheEntry
	index map[string]*list.Element
}

type cacheEntry struct {
	id   string
	size int64
}

// NewCache opens (creating if needed) a cache in dir holding at most limit bytes.
func NewCache(dir string, limit int64) (*Cache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	c := &Cache{dir: dir, limit: limit, lru: list.New(), index: map[string]*list.Element{}}
	type found struct {
		id   string
		size int64
		mt   int64
	}
	var all []found
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if filepath.Ext(p) == ".tmp" {
			_ = os.Remove(p)
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		all = append(all, found{d.Name(), info.Size(), info.ModTime().UnixNano()})
		return nil
	})
	sort.Slice(all, func(i, j int) bool { return all[i].mt > all[j].mt })
	for _, f := range all {
		c.index[f.id] = c.lru.PushBack(&cacheEntry{f.id, f.size})
		c.used += f.size
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

func (c *Cache) path(id string) string { return filepath.Join(c.dir, id[:2], id) }

// Get returns the cached bytes of chunk id, or ok=false.
func (c *Cache) Get(id string) (b []byte, ok bool) {
	c.mu.Lock()
	e, ok := c.index[id]
	if ok {
		c.lru.MoveToFront(e)
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	b, err := os.ReadFile(c.path(id))
	if err != nil {
		c.Remove(id)
		return nil, false
	}
	return b, true
}

// Put adds chunk id's stored bytes, evicting least recently used chunks beyond the
// limit. Errors are ignored: the cache is best-effort.
func (c *Cache) Put(id string, b []byte) {
	if int64(len(b)) > c.limit {
		return
	}
	c.mu.Lock()
	if e, ok := c.index[id]; ok {
		c.lru.MoveToFront(e)
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	p := c.path(id)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		_ = os.Remove(tmp)
		return
	}
	if err := os.Rename(tmp, p); err != nil {
		_ = os.Remove(tmp)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.index[id]; ok {
		return
	}
	c.index[id] = c.lru.PushFront(&cacheEntry{id, int64(len(b))})
	c.used += int64(len(b))
	c.evictLocked()
}

// Remove drops chunk id from the cache.
func (c *Cache) Remove(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.index[id]; ok {
		c.dropLocked(e)
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

// Used returns the bytes held and the number of chunks.
func (c *Cache) Used() (bytes int64, chunks int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used, c.lru.Len()
}

func (c *Cache) evictLocked() {
	for c.used > c.limit && c.lru.Len() > 0 {
		c.dropLocked(c.lru.Back())
	}
}

func (c *Cache) dropLocked(e *list.Element) {
	ce := e.Value.(*cacheEntry)
	c.lru.Remove(e)
	delete(c.index, ce.id)
	c.used -= ce.size
	_ = os.Remove(c.path(ce.id))
}

// cacheFiller writes chunks into a Cache in the background, so that neither a
// commit nor a cold resume waits for the cache's one file per chunk (measured
// on this host, 2026-11-30: ~0.5 ms per file, 2.3 s of a 76 MB first commit to
// S3). At most fillBudget bytes wait; chunks beyond that are not cached (the
// cache is best-effort).
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
		for it := range f.ch {
			f.c.Put(it.id, it.b)
			f.settle(len(it.b))
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
