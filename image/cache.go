package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/torpor/torpor/metadata/sqlite"
)

// prepareVersion changes whenever prepareTree or mkfsArgs change what a build
// produces, so that stale cache entries are not used.
const prepareVersion = "prepare-v2"

// DefaultBuildCache is the host-wide build cache used when TORPOR_IMAGE_CACHE is
// unset. It lets `make setup`, tests and every data directory on one host share
// one mmdebstrap run per package set (a build takes 40–90 s here).
const DefaultBuildCache = "/var/cache/torpor/images"

// SetBuildCache sets the directory where built images are kept by recipe (suite,
// package set, preparation version). "" disables the cache. A build whose recipe
// is cached copies the cached EROFS file instead of running mmdebstrap.
func (s *Store) SetBuildCache(dir string) { s.cacheDir = dir }

// BuildCacheFromEnv returns $TORPOR_IMAGE_CACHE, or DefaultBuildCache; the value
// "off" disables the cache.
func BuildCacheFromEnv() string {
	switch v := os.Getenv("TORPOR_IMAGE_CACHE"); v {
	case "":
		return DefaultBuildCache
	case "off":
		return ""
	default:
		return v
	}
}

func (s *Store) cachePath(source string) string {
	if s.cacheDir == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(Suite + "\n" + source + "\n" + prepareVersion))
	return filepath.Join(s.cacheDir, hex.EncodeToString(sum[:])+".erofs")
}

// inCache reports whether the build cache holds a build of source.
func (s *Store) inCache(source string) bool {
	p := s.cachePath(source)
	if p == "" {
		return false
	}
	_, err := os.Stat(p)
	return err == nil
}

// fromCache copies a cached build of source into a temporary file of the store and
// returns its path ("" if there is no cache entry).
func (s *Store) fromCache(source string) (string, error) {
	p := s.cachePath(source)
	if p == "" {
		return "", nil
	}
	if _, err := os.Stat(p); err != nil {
		return "", nil
	}
	return copyToTemp(p, s.tmpDir())
}

// toCache keeps a copy of a built image file in the cache; failures only cost a
// later rebuild, so they are reported to progress and otherwise ignored.
func (s *Store) toCache(source, file string, progress io.Writer) {
	p := s.cachePath(source)
	if p == "" {
		return
	}
	if err := os.MkdirAll(s.cacheDir, 0o755); err != nil {
		fmt.Fprintf(progress, "image cache: %v\n", err)
		return
	}
	tmp, err := copyToTemp(file, s.cacheDir)
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		fmt.Fprintf(progress, "image cache: %v\n", err)
		os.Remove(tmp)
	}
}

func copyToTemp(src, dir string) (string, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer in.Close()
	out, err := os.CreateTemp(dir, "cache-*.erofs")
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		os.Remove(out.Name())
		return "", err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		os.Remove(out.Name())
		return "", err
	}
	return out.Name(), out.Close()
}

// WarmBuildCache builds the built-in images names (nil: every one of
// Builtins) into the build cache cacheDir, each unless it is there already,
// without a server or data directory (`make setup` runs it through `torpor
// image warm`). It needs root, mmdebstrap and mkfs.erofs; progress gets the
// builds' output. Errors wrap ErrInvalid for an empty cacheDir or a name that
// is no built-in image.
func WarmBuildCache(ctx context.Context, cacheDir string, names []string, progress io.Writer) error {
	if cacheDir == "" {
		return invalidf("warm image cache: no cache directory")
	}
	if names == nil {
		names = Builtins()
	}
	for _, name := range names {
		if !IsBuiltin(name) {
			return invalidf("warm image cache: %q is not a built-in image (want one of %s)", name, strings.Join(Builtins(), ", "))
		}
	}
	work, err := os.MkdirTemp("", "torpor-warm-")
	if err != nil {
		return err
	}
	defer removeTree(work)
	db, err := sqlite.Open(filepath.Join(work, "images.db"))
	if err != nil {
		return err
	}
	defer db.Close()
	s, err := Open(filepath.Join(work, "images"), db)
	if err != nil {
		return err
	}
	s.SetBuildCache(cacheDir)
	for _, name := range names {
		if src := builtins[name].source(); s.inCache(src) {
			fmt.Fprintf(progress, "image %s: already in the build cache (%s)\n", name, s.cachePath(src))
			continue
		}
		if _, err := s.EnsureBuiltin(ctx, name, progress); err != nil {
			return err
		}
	}
	return nil
}
