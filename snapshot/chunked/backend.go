package chunked

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Backend is the durable tier: a flat namespace of immutable objects. Keys are
// slash-separated ("chunks/ab/abcd…", "manifests/snap-x.json"). Implementations
// are safe for concurrent use.
type Backend interface {
	// Put stores size bytes read from r under key, replacing any object there. When
	// Put returns nil the object is durable (or will be made durable by Sync, for
	// backends that implement Syncer).
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get opens an object. A missing key is an error wrapping fs.ErrNotExist.
	Get(ctx context.Context, key string) (io.ReadCloser, error)
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

// Syncer is implemented by backends whose Put is not durable on its own: Sync
// makes every completed Put durable. The store calls it before writing a manifest.
type Syncer interface {
	Sync(ctx context.Context) error
}

// FS is the local filesystem backend: one file per key under a directory. Put
// writes a temporary file and renames it into place, so a reader never sees a
// partial object. Chunk files are not fsynced one by one (thousands of fsyncs
// per snapshot would dominate a hibernate); Sync flushes the whole filesystem
// with one syncfs(2) before the store writes a manifest, and manifests
// themselves ("manifests/…") are fsynced with their directory on Put.
type FS struct {
	dir string
}

var _ Backend = (*FS)(nil)
var _ Syncer = (*FS)(nil)

// NewFS opens (creating if needed) a filesystem backend rooted at dir.
func NewFS(dir string) (*FS, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{".tmp", "chunks", "manifests"} {
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

// CleanTemp removes temporary files a crashed process left behind. Only the
// backend's single writer may call it (Store.Recover does, at start-up): it would
// break Puts in flight.
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
	n, err := io.Copy(f, r)
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
	return nil
}

// Sync implements Syncer with syncfs(2) on the backend's filesystem.
func (b *FS) Sync(ctx context.Context) error {
	f, err := os.Open(b.dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Syncfs(int(f.Fd()))
}

// Get implements Backend.
func (b *FS) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	p, err := b.path(key)
	if err != nil {
		return nil, err
	}
	return os.Open(p)
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

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
