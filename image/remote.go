package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/internal/atomicfile"
)

// Remote is where a store keeps a copy of its image files for the stores of
// other nodes (the S3 prefix a cluster's nodes share, docs/multi-host.md):
// an object per file, "images/sha256/<hex>.erofs". chunked's S3 backend is
// one. Get of a missing key returns an error wrapping fs.ErrNotExist.
type Remote interface {
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	Get(ctx context.Context, key string) (io.ReadCloser, error)
	Exists(ctx context.Context, key string) (bool, error)
}

// remoteCopy is a store's Remote and what it has sent there.
type remoteCopy struct {
	r   Remote
	log *slog.Logger
	mu  sync.Mutex
	// sent: the digests uploaded (or being uploaded) by this process.
	sent map[string]bool
	wg   sync.WaitGroup
}

// SetRemote makes the store copy every image file it stores to r (in the
// background, once per digest and process) and fetch from r a file it lacks
// (Get). Call it before the store is used.
func (s *Store) SetRemote(r Remote, log *slog.Logger) {
	if log == nil {
		log = slog.Default()
	}
	s.remote = &remoteCopy{r: r, log: log, sent: map[string]bool{}}
}

// WaitRemote waits for the uploads in flight (tests, shutdown).
func (s *Store) WaitRemote() {
	if s.remote != nil {
		s.remote.wg.Wait()
	}
}

func remoteKey(digest string) string {
	return "images/sha256/" + strings.TrimPrefix(digest, "sha256:") + ".erofs"
}

// upload copies the file of digest to the remote in the background unless
// the remote has it; a failure is logged (tried again by the next use of
// the image in this process).
func (s *Store) upload(digest string) {
	rc := s.remote
	if rc == nil {
		return
	}
	rc.mu.Lock()
	if rc.sent[digest] {
		rc.mu.Unlock()
		return
	}
	rc.sent[digest] = true
	rc.mu.Unlock()
	rc.wg.Add(1)
	go func() {
		defer rc.wg.Done()
		err := func() error {
			f, err := os.Open(s.Path(digest))
			if err != nil {
				return err
			}
			defer f.Close()
			fi, err := f.Stat()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			if ok, err := rc.r.Exists(ctx, remoteKey(digest)); err == nil && ok {
				return nil
			}
			return rc.r.Put(ctx, remoteKey(digest), f, fi.Size())
		}()
		if err != nil {
			rc.mu.Lock()
			delete(rc.sent, digest)
			rc.mu.Unlock()
			rc.log.Warn("image: copy to the shared store failed", "digest", digest, "err", err)
			return
		}
		rc.log.Info("image: copied to the shared store", "digest", digest)
	}()
}

// fetch brings the file of digest from the remote into the store, checked
// against its digest. Errors: ErrNotFound (wrapped) when the remote has no
// such file or there is no remote; the remote's, a mismatch, the disk's.
func (s *Store) fetch(ctx context.Context, digest string) error {
	if s.remote == nil {
		return fmt.Errorf("image %q %w", digest, ErrNotFound)
	}
	rc, err := s.remote.r.Get(ctx, remoteKey(digest))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("image %q %w (on this node and in the shared store)", digest, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("image %s: fetch from the shared store: %w", digest, err)
	}
	defer rc.Close()
	tmp, err := os.CreateTemp(s.tmpDir(), "fetch-*.erofs")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	h := sha256.New()
	_, err = io.Copy(io.MultiWriter(tmp, h), rc)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("image %s: fetch from the shared store: %w", digest, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		return fmt.Errorf("image %s: the shared store's copy has digest %s: not used", digest, got)
	}
	final := s.Path(digest)
	if err := os.Chmod(tmp.Name(), 0o444); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), final); err != nil {
		return fmt.Errorf("image %s: %w", digest, err)
	}
	s.log().Info("image: fetched from the shared store", "digest", digest)
	return atomicfile.SyncDir(filepath.Dir(final))
}

func (s *Store) log() *slog.Logger {
	if s.remote != nil {
		return s.remote.log
	}
	return slog.Default()
}
