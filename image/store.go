package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// ErrInvalid marks a request the caller got wrong: a bad image name, package
// name or digest, or an import archive that is not a usable tar. The API maps it
// to 400.
var ErrInvalid = errors.New("invalid")

// ErrNotFound marks an image name or digest the store does not hold (API 404).
var ErrNotFound = errors.New("not found")

var (
	nameRE   = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
)

// ValidName reports whether name is a valid image name:
// ^[a-z0-9][a-z0-9._-]{0,62}$ (1 to 63 characters).
func ValidName(name string) bool { return nameRE.MatchString(name) }

// Store holds the images of one data directory. It is safe for concurrent use
// by several goroutines; two builds or imports of the same name run one after
// the other.
type Store struct {
	dir string
	db  metadata.Images

	mu    sync.Mutex
	locks map[string]*sync.Mutex // per image name

	cacheDir string // see SetBuildCache

	// Sharing between hosts (share.go): nil bucket without SetBucket.
	bucket        *Bucket
	fetches       singleflight.Group // downloads, per digest
	retries       singleflight.Group // shareLater's uploads, per "name@digest"
	downloads     atomic.Int64       // downloads started (tests)
	shared        map[string]bool    // "name@digest" this process shared; under mu
	shareFailedAt time.Time          // the last failed upload; under mu
}

// Open opens (creating if needed) the image store in dir, e.g.
// "<data-dir>/images", with its name records in db (the metadata store's
// image names), and removes temporary files a previous process left in
// dir/tmp.
func Open(dir string, db metadata.Images) (*Store, error) {
	if db == nil {
		return nil, errors.New("image: open: nil metadata store")
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("image: open %s: %w", dir, err)
	}
	for _, d := range []string{filepath.Join(dir, "sha256"), filepath.Join(dir, "tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("image: open %s: %w", dir, err)
		}
	}
	s := &Store{dir: dir, db: db, locks: map[string]*sync.Mutex{}}
	if ents, err := os.ReadDir(s.tmpDir()); err == nil {
		for _, e := range ents {
			_ = removeTree(filepath.Join(s.tmpDir(), e.Name()))
		}
	}
	return s, nil
}

// Dir returns the store's directory (absolute).
func (s *Store) Dir() string { return s.dir }

func (s *Store) tmpDir() string { return filepath.Join(s.dir, "tmp") }

// Path returns the absolute path of the EROFS file of digest ("sha256:<hex>" or
// bare "<hex>"), whether or not the file exists; "" if digest is malformed.
func (s *Store) Path(digest string) string {
	if !strings.HasPrefix(digest, "sha256:") {
		digest = "sha256:" + digest
	}
	if !digestRE.MatchString(digest) {
		return ""
	}
	return filepath.Join(s.dir, "sha256", strings.TrimPrefix(digest, "sha256:")+".erofs")
}

// nameLock returns the mutex that serializes builds and imports of name.
func (s *Store) nameLock(name string) *sync.Mutex {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.locks[name]
	if l == nil {
		l = &sync.Mutex{}
		s.locks[name] = l
	}
	return l
}

// lockName takes the name's lock, giving up when ctx ends.
func (s *Store) lockName(ctx context.Context, name string) (unlock func(), err error) {
	l := s.nameLock(name)
	got := make(chan struct{})
	go func() { l.Lock(); close(got) }()
	select {
	case <-got:
		return l.Unlock, nil
	case <-ctx.Done():
		go func() { <-got; l.Unlock() }()
		return nil, ctx.Err()
	}
}

// Get returns the image with the given name, or with the given digest
// ("sha256:<hex>"), and the absolute path of its EROFS file. A digest whose file
// exists but that no name points to any more (replaced by a newer build) is
// still found, with an empty Name and Source. With a bucket (SetBucket), a
// name or file this host lacks comes from the bucket (see SetBucket), which
// may take a download's time. Errors: ErrInvalid for a malformed name or
// digest, ErrNotFound if there is no such image (here or in the bucket),
// ErrCorrupt for a fetched file that fails its digest, and the bucket's.
func (s *Store) Get(ctx context.Context, nameOrDigest string) (sandbox.Image, string, error) {
	if strings.HasPrefix(nameOrDigest, "sha256:") {
		return s.getDigest(ctx, nameOrDigest)
	}
	if !ValidName(nameOrDigest) {
		return sandbox.Image{}, "", invalidf("image %q: invalid name (want a digest sha256:<64 hex> or a name matching %s)", nameOrDigest, nameRE)
	}
	img, ok, err := s.lookup(ctx, nameOrDigest)
	if err != nil {
		return sandbox.Image{}, "", err
	}
	if !ok && s.bucket != nil {
		img, ok, err = s.fromBucket(ctx, nameOrDigest)
		if err != nil {
			return sandbox.Image{}, "", err
		}
	}
	if !ok {
		return sandbox.Image{}, "", fmt.Errorf("image %q %w", nameOrDigest, ErrNotFound)
	}
	p := s.Path(img.Digest)
	if p == "" {
		return sandbox.Image{}, "", fmt.Errorf("image %q: record has malformed digest %q", nameOrDigest, img.Digest)
	}
	_, err = os.Stat(p)
	if missing(err) && s.bucket != nil {
		if err = s.fetch(ctx, img.Digest); err != nil {
			return sandbox.Image{}, "", fmt.Errorf("image %q: %w", nameOrDigest, err)
		}
	} else if err != nil {
		return sandbox.Image{}, "", fmt.Errorf("image %q (%s): file missing: %w", nameOrDigest, img.Digest, err)
	} else {
		s.shareLater(ctx, img)
	}
	return img, p, nil
}

// Has reports whether Get would find the image name, without fetching its
// file: without a bucket, whether this host's records name it and its file is
// here; with one (SetBucket), whether the records or the bucket's manifests
// name it. Errors: ErrInvalid for a malformed name; reading the records or
// the bucket.
func (s *Store) Has(ctx context.Context, name string) (bool, error) {
	if !ValidName(name) {
		return false, invalidf("image %q: invalid name (want %s)", name, nameRE)
	}
	img, ok, err := s.lookup(ctx, name)
	if err != nil {
		return false, err
	}
	if s.bucket == nil {
		if !ok {
			return false, nil
		}
		_, err := os.Stat(s.Path(img.Digest))
		return err == nil, nil
	}
	if ok {
		return true, nil
	}
	_, ok, err = s.bucket.lookupName(ctx, name)
	if err != nil {
		return false, fmt.Errorf("image %q: %s: %w", name, s.bucket, err)
	}
	return ok, nil
}

func (s *Store) getDigest(ctx context.Context, digest string) (sandbox.Image, string, error) {
	if !digestRE.MatchString(digest) {
		return sandbox.Image{}, "", invalidf("image %q: invalid digest (want sha256:<64 lowercase hex>)", digest)
	}
	p := s.Path(digest)
	fi, err := os.Stat(p)
	if missing(err) && s.bucket != nil {
		if err := s.fetch(ctx, digest); err != nil {
			return sandbox.Image{}, "", err
		}
		fi, err = os.Stat(p)
	}
	if missing(err) {
		return sandbox.Image{}, "", fmt.Errorf("image %q %w", digest, ErrNotFound)
	}
	if err != nil {
		return sandbox.Image{}, "", fmt.Errorf("image %q: %w", digest, err)
	}
	img, err := s.db.ImageByDigest(ctx, digest)
	if errors.Is(err, metadata.ErrNotFound) {
		return sandbox.Image{Digest: digest, Bytes: fi.Size(), CreatedAt: fi.ModTime().UTC()}, p, nil
	}
	if err != nil {
		return sandbox.Image{}, "", fmt.Errorf("image %q: read record: %w", digest, err)
	}
	return img, p, nil
}

// lookup reads the record of name; ok is false if there is none.
func (s *Store) lookup(ctx context.Context, name string) (img sandbox.Image, ok bool, err error) {
	img, err = s.db.GetImage(ctx, name)
	if errors.Is(err, metadata.ErrNotFound) {
		return sandbox.Image{}, false, nil
	}
	if err != nil {
		return sandbox.Image{}, false, fmt.Errorf("image %q: read record: %w", name, err)
	}
	return img, true, nil
}

// List returns all named images, sorted by name.
func (s *Store) List(ctx context.Context) ([]sandbox.Image, error) {
	out, err := s.db.ListImages(ctx)
	if err != nil {
		return nil, fmt.Errorf("image: list: %w", err)
	}
	if out == nil {
		out = []sandbox.Image{}
	}
	return out, nil
}

// record points name at img.Digest.
func (s *Store) record(ctx context.Context, img sandbox.Image) error {
	if err := s.db.PutImage(ctx, img); err != nil {
		return fmt.Errorf("image %q: write record: %w", img.Name, err)
	}
	return nil
}

// commit prepares the tree at root, packs it into an EROFS file, moves the
// file into the store under its digest and points name at it.
func (s *Store) commit(ctx context.Context, name, source, root string, progress io.Writer) (sandbox.Image, error) {
	if err := prepareTree(root); err != nil {
		return sandbox.Image{}, fmt.Errorf("image %q: prepare tree: %w", name, err)
	}
	tmp, err := os.CreateTemp(s.tmpDir(), "mkfs-*.erofs")
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("image %q: %w", name, err)
	}
	tmpPath := tmp.Name()
	tmp.Close()
	defer os.Remove(tmpPath)

	fmt.Fprintf(progress, "image %s: packing with mkfs.erofs -E noinline_data\n", name)
	if err := runTool(ctx, progress, "mkfs.erofs", mkfsArgs(tmpPath, root)...); err != nil {
		return sandbox.Image{}, fmt.Errorf("image %q: %w", name, err)
	}
	return s.store(ctx, name, source, tmpPath, progress)
}

// store moves the EROFS file at tmpPath into the store under its digest and
// points name at it.
func (s *Store) store(ctx context.Context, name, source, tmpPath string, progress io.Writer) (sandbox.Image, error) {
	digest, size, err := hashAndSync(tmpPath)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("image %q: %w", name, err)
	}
	final := s.Path(digest)
	if _, err := os.Stat(final); err == nil {
		// Same content is already stored; keep the existing file.
	} else {
		if err := os.Chmod(tmpPath, 0o444); err != nil {
			return sandbox.Image{}, fmt.Errorf("image %q: %w", name, err)
		}
		if err := os.Rename(tmpPath, final); err != nil {
			return sandbox.Image{}, fmt.Errorf("image %q: store %s: %w", name, digest, err)
		}
		if err := atomicfile.SyncDir(filepath.Dir(final)); err != nil {
			return sandbox.Image{}, fmt.Errorf("image %q: %w", name, err)
		}
	}
	img := sandbox.Image{Name: name, Digest: digest, Bytes: size, Source: source, CreatedAt: time.Now().UTC()}
	if err := s.shareNew(ctx, img, progress); err != nil {
		return sandbox.Image{}, err
	}
	if err := s.record(ctx, img); err != nil {
		return sandbox.Image{}, err
	}
	fmt.Fprintf(progress, "image %s: stored %s (%d bytes) at %s\n", name, digest, size, final)
	return img, nil
}

// mkfsArgs are the mkfs.erofs arguments gVisor can read: no compression (no
// -z), no inline (tail-packed) data, no chunked files. Per-file mtimes are kept
// (Python's .pyc checks need them), so the output, and thus the digest, differs
// from build to build by the superblock's build time and UUID.
func mkfsArgs(out, dir string) []string {
	return []string{"--quiet", "-E", "noinline_data", out, dir}
}

// hashAndSync fsyncs the file at path and returns its digest and size in bytes.
func hashAndSync(path string) (digest string, size int64, err error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("fsync %s: %w", path, err)
	}
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("hash %s: %w", path, err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), n, nil
}

// invalidError is an error that wraps ErrInvalid without repeating its text.
type invalidError struct{ msg string }

func (e *invalidError) Error() string { return e.msg }
func (e *invalidError) Unwrap() error { return ErrInvalid }

// invalidf formats an error wrapping ErrInvalid.
func invalidf(format string, args ...any) error {
	return &invalidError{fmt.Sprintf(format, args...)}
}
