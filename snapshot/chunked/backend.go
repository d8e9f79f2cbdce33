package chunked

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Backend is the durable tier: a flat namespace of immutable objects. Keys are
// slash-separated ("packs/ab/abcd…", "manifests/snap-x.json"). Implementations
// are safe for concurrent use.
type Backend interface {
	// Put stores size bytes read from r under key, replacing any object there. When
	// Put returns nil the object is durable (or will be made durable by Sync, for
	// backends that implement Syncer).
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get opens an object. A missing key is an error wrapping fs.ErrNotExist.
	Get(ctx context.Context, key string) (io.ReadCloser, error)
	// GetRange returns the n bytes of an object from byte offset off (one
	// ranged read: a pack's chunks are fetched this way). A missing key is an
	// error wrapping fs.ErrNotExist; an object shorter than off+n one wrapping
	// io.ErrUnexpectedEOF.
	GetRange(ctx context.Context, key string, off, n int64) ([]byte, error)
	// Exists reports whether key is stored.
	Exists(ctx context.Context, key string) (bool, error)
	// Delete removes key; a missing key is not an error.
	Delete(ctx context.Context, key string) error
	// List returns every object whose key starts with prefix.
	List(ctx context.Context, prefix string) ([]Object, error)
}

// Object is one listed object.
type Object struct {
	Key  string
	Size int64
}

// Optional capabilities. Beside Backend, the store asks a backend only for
// these interfaces, never for its concrete type: a new backend implements
// Backend and whichever of these apply to it.

// Syncer is implemented by backends whose Put is not durable on its own: Sync
// makes every completed Put durable. The store calls it before writing a manifest.
type Syncer interface {
	Sync(ctx context.Context) error
}

// Remote is implemented by backends reached over a network (S3): each request
// waits a round trip, and the backend may be out of reach for a while. For
// them the store keeps more requests in flight (Config.Workers defaults to 16,
// against 4 for local disk, which saturates the CPUs with a few) and rides out
// an outage: New starts without their listing (listed again before the next
// upload or synchronous commit), and Recover keeps every opened copy while the
// backend cannot be listed. A backend that is not Remote is local disk: a
// listing that fails fails New and Recover.
type Remote interface {
	// UnreachableAtOpen reports whether the backend gave no answer when it
	// was opened (down, or hung): New then does not try to list it.
	UnreachableAtOpen() bool
}

// TempCleaner is implemented by backends whose writes leave temporary files
// behind when the writer crashes (FS: Put writes a temporary file and renames
// it into place).
type TempCleaner interface {
	// CleanTemp removes them. Only the backend's single writer may call it,
	// at start-up (Store.Recover does): it would break writes in flight.
	CleanTemp()
}

// syncTier makes every completed Put to b durable: Sync for a Syncer, nothing
// for a backend whose Put is durable on its own. Errors are Sync's.
func syncTier(ctx context.Context, b Backend) error {
	if sy, ok := b.(Syncer); ok {
		return sy.Sync(ctx)
	}
	return nil
}

// FS is the local filesystem backend: one file per key under a directory. Put
// writes a temporary file and renames it into place, so a reader never sees a
// partial object. Chunk files are not fsynced in Put (PutDirect starts an fsync
// of each pack in the background at once, so a first commit's packs reach the
// disk while the next are cut and its Sync has little left); Sync makes every Put since
// the last Sync durable: a few (≤ syncEachMax, a diff snapshot's) by fsync of
// each file and its directory, in parallel; more (a first snapshot's thousands)
// by one syncfs(2) of the whole filesystem, cheaper than thousands of fsyncs
// but also flushing unrelated dirty data such as the engine's freshly written
// checkpoint — the reason for the per-file path: it keeps a diff hibernate from
// writing the whole checkpoint to disk. Manifests ("manifests/…") are fsynced
// with their directory on Put.
type FS struct {
	dir string

	mu    sync.Mutex
	dirty []string // files Put since the last Sync
	// early holds the fsyncs PutDirect started as soon as each file was
	// written (path -> its result): a first commit's packs reach the disk
	// while the next ones are cut, and Sync waits for them instead of
	// fsyncing every pack at the end.
	early  map[string]chan error
	syncMu sync.Mutex // one Sync at a time: a Sync returns after the files it took are durable
}

// syncEachMax is the most files Sync fsyncs one by one before it uses syncfs.
const syncEachMax = 512

var _ Backend = (*FS)(nil)
var _ Syncer = (*FS)(nil)
var _ TempCleaner = (*FS)(nil)

// NewFS opens (creating if needed) a filesystem backend rooted at dir.
func NewFS(dir string) (*FS, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{".tmp", "chunks", "packs", "index", "manifests"} {
		if err := os.MkdirAll(filepath.Join(abs, d), 0o700); err != nil {
			return nil, fmt.Errorf("chunk backend %s: %w", abs, err)
		}
	}
	// The directories a manifest's durability depends on are themselves durable.
	if err := syncDir(abs); err != nil {
		return nil, fmt.Errorf("chunk backend %s: %w", abs, err)
	}
	return &FS{dir: abs}, nil
}

// CleanTemp implements TempCleaner: it removes the temporary files of Puts a
// crashed process left behind. Only the backend's single writer may call it
// (Store.Recover does, at start-up): it would break Puts in flight.
func (b *FS) CleanTemp() {
	ents, _ := os.ReadDir(filepath.Join(b.dir, ".tmp"))
	for _, e := range ents {
		_ = os.Remove(filepath.Join(b.dir, ".tmp", e.Name()))
	}
}

// Dir is the backend's root directory.
func (b *FS) Dir() string { return b.dir }

func (b *FS) path(key string) (string, error) {
	if key == "" || strings.HasPrefix(key, "/") || strings.HasPrefix(key, ".") || strings.Contains(key, "..") {
		return "", fmt.Errorf("invalid key %q", key)
	}
	return filepath.Join(b.dir, filepath.FromSlash(key)), nil
}

// Put implements Backend.
func (b *FS) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	return b.put(ctx, key, size, false, func(f *os.File) (int64, error) { return io.Copy(f, r) })
}

// put writes object key through write, into a temporary file renamed into
// place; write returns the bytes it wrote (size are expected). With
// syncEarly an fsync of the file starts at once in the background, and Sync
// waits for it instead of starting its own.
func (b *FS) put(ctx context.Context, key string, size int64, syncEarly bool, write func(*os.File) (int64, error)) error {
	p, err := b.path(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Join(b.dir, ".tmp"), "put-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	n, err := write(f)
	if err == nil && n != size {
		err = fmt.Errorf("put %s: %d bytes, want %d", key, n, size)
	}
	manifest := strings.HasPrefix(key, "manifests/")
	if err == nil && manifest {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	if err := os.Rename(tmp, p); err != nil {
		return err
	}
	if manifest {
		return syncDir(filepath.Dir(p))
	}
	b.mu.Lock()
	b.dirty = append(b.dirty, p)
	if syncEarly {
		if b.early == nil {
			b.early = map[string]chan error{}
		}
		ch := make(chan error, 1)
		b.early[p] = ch
		go func() { ch <- syncPath(p) }()
	}
	b.mu.Unlock()
	return nil
}

// waitEarly waits for the fsync PutDirect started of p, if any: done is
// true when it succeeded.
func (b *FS) waitEarly(p string) (done bool) {
	b.mu.Lock()
	ch, ok := b.early[p]
	delete(b.early, p)
	b.mu.Unlock()
	return ok && <-ch == nil
}

// directPutter is implemented by backends that can write an object from
// memory without copying it through the page cache.
type directPutter interface {
	// PutDirect is Put of data, which the caller does not change until it
	// returns.
	PutDirect(ctx context.Context, key string, data []byte) error
}

var _ directPutter = (*FS)(nil)

// directAlign is the alignment O_DIRECT needs of a write's memory, offset
// and length: 4 KiB covers every logical block size in use.
const directAlign = 4096

// blockAligned says whether b starts at a directAlign boundary in memory.
func blockAligned(b []byte) bool {
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))%directAlign == 0
}

// PutDirect implements directPutter: the whole 4 KiB blocks of data are
// written with O_DIRECT (from the device's point of view the same bytes;
// for the CPU no copy into the page cache, and the final Sync finds them
// written already), the rest through the page cache; Sync makes the object
// durable as after Put. data must start at a 4 KiB boundary in memory to go
// direct; otherwise, or where the filesystem refuses O_DIRECT (tmpfs), it is
// a Put.
func (b *FS) PutDirect(ctx context.Context, key string, data []byte) error {
	n := int64(len(data))
	if len(data) < directAlign || !blockAligned(data) {
		return b.Put(ctx, key, bytes.NewReader(data), n)
	}
	return b.put(ctx, key, n, true, func(f *os.File) (int64, error) {
		whole := len(data) &^ (directAlign - 1)
		fd := int(f.Fd())
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err == nil {
			_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl|unix.O_DIRECT)
		}
		done := 0
		if err == nil {
			done, err = f.Write(data[:whole])
			if errors.Is(err, unix.EINVAL) && done == 0 {
				err = nil // no O_DIRECT on this filesystem after all
			}
			_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl)
		} else {
			err = nil // the page cache it is
		}
		if err != nil {
			return int64(done), err
		}
		m, err := f.Write(data[done:])
		return int64(done + m), err
	})
}

// Sync implements Syncer: every file Put since the last Sync (by any caller)
// is durable, with its directory entry, when it returns nil.
func (b *FS) Sync(ctx context.Context) error {
	b.syncMu.Lock()
	defer b.syncMu.Unlock()
	b.mu.Lock()
	files := b.dirty
	b.dirty = nil
	b.mu.Unlock()
	err := b.syncFiles(ctx, files)
	if err != nil {
		b.mu.Lock()
		b.dirty = append(b.dirty, files...) // still owed
		b.mu.Unlock()
	}
	return err
}

// syncFiles makes files durable, then their directories: each by the fsync
// PutDirect started, or by one of its own.
func (b *FS) syncFiles(ctx context.Context, files []string) error {
	if len(files) == 0 {
		return nil
	}
	if len(files) > syncEachMax {
		for _, p := range files {
			b.waitEarly(p) // syncfs covers them either way
		}
		f, err := os.Open(b.dir)
		if err != nil {
			return err
		}
		defer f.Close()
		return unix.Syncfs(int(f.Fd()))
	}
	dirs := map[string]bool{}
	for _, p := range files {
		dirs[filepath.Dir(p)] = true
	}
	paths := append([]string(nil), files...)
	for d := range dirs {
		paths = append(paths, d)
	}
	// Files first, then their directories (the rename is durable once the
	// directory is); fsyncs on one ext4 journal coalesce, so they run in parallel.
	var mu sync.Mutex
	var firstErr error
	run := func(ps []string) {
		var wg sync.WaitGroup
		next := make(chan string)
		for w := 0; w < 16; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for p := range next {
					if b.waitEarly(p) {
						continue
					}
					if err := syncPath(p); err != nil {
						mu.Lock()
						if firstErr == nil {
							firstErr = err
						}
						mu.Unlock()
					}
				}
			}()
		}
		for _, p := range ps {
			next <- p
		}
		close(next)
		wg.Wait()
	}
	run(paths[:len(files)])
	if firstErr == nil {
		run(paths[len(files):])
	}
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return firstErr
}

// syncPath fsyncs a file or directory. A file removed meanwhile (a chunk
// collected by GC) needs no sync.
func syncPath(p string) error {
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// Get implements Backend.
func (b *FS) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	p, err := b.path(key)
	if err != nil {
		return nil, err
	}
	return os.Open(p)
}

// GetRange implements Backend (GetRangeInto a new buffer).
func (b *FS) GetRange(ctx context.Context, key string, off, n int64) ([]byte, error) {
	buf := make([]byte, n)
	if err := b.GetRangeInto(ctx, key, off, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// Exists implements Backend.
func (b *FS) Exists(ctx context.Context, key string) (bool, error) {
	p, err := b.path(key)
	if err != nil {
		return false, err
	}
	_, err = os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

// Delete implements Backend.
func (b *FS) Delete(ctx context.Context, key string) error {
	p, err := b.path(key)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// List implements Backend.
func (b *FS) List(ctx context.Context, prefix string) ([]Object, error) {
	var out []Object
	err := filepath.WalkDir(b.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, _ := filepath.Rel(b.dir, p)
		key := filepath.ToSlash(rel)
		if d.IsDir() {
			if key == ".tmp" {
				return filepath.SkipDir
			}
			// Descend only into directories that can hold keys with the prefix.
			if key != "." && !strings.HasPrefix(key+"/", prefix) && !strings.HasPrefix(prefix, key+"/") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasPrefix(key, prefix) {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil // removed meanwhile
		}
		out = append(out, Object{Key: key, Size: info.Size()})
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, err
}

func syncDir(dir string) error { return syncPath(dir) }

// getAll reads the whole object key of tier b. Errors: b.Get's (wrapping
// fs.ErrNotExist for a missing key) and read errors.
func getAll(ctx context.Context, b Backend, key string) ([]byte, error) {
	r, err := b.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}
