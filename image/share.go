package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/sandbox"
)

// SetBucket makes the store share its images through b (nil: not at all),
// for the servers of several hosts on one bucket. Call it before the store is
// used. With a bucket:
//
//   - Build and Import upload the new image's file and then its name's
//     manifest before they record the name and return; an upload that fails
//     fails the call (the file stays on the host, the name is not recorded,
//     so the call can be repeated). A built-in image (EnsureBuiltin) that
//     cannot be uploaded is used all the same and uploaded on a later use.
//   - Get of a name this host's records lack reads the name's manifest in the
//     bucket and records it here; Get of a digest (or of a name whose digest)
//     this host has no file of downloads the file into the store: once per
//     digest however many calls want it at once, into a temporary file that is
//     fsynced and renamed into place only once its SHA-256 is the digest
//     (ErrCorrupt otherwise, and nothing is kept).
//   - Get of a name whose file is here uploads what the bucket lacks of it,
//     once per name and process (images made before the store had a bucket),
//     without replacing a manifest another host wrote for that name.
func (s *Store) SetBucket(b *Bucket) {
	s.bucket = b
	s.shared = map[string]bool{}
}

// Bucket returns the bucket set by SetBucket (nil without one).
func (s *Store) Bucket() *Bucket { return s.bucket }

// shareRetry is how long after a failed upload of a name later uses leave
// the bucket alone (a down or hung S3 would otherwise hold every create).
const shareRetry = time.Minute

// share uploads img (its file in the store) and its name's manifest to the
// bucket: a new image's (replaceName), or, as a retry, only what the bucket
// lacks.
func (s *Store) share(ctx context.Context, img sandbox.Image, replaceName bool) error {
	if err := s.bucket.put(ctx, img, s.Path(img.Digest), replaceName); err != nil {
		s.mu.Lock()
		s.shareFailedAt = time.Now()
		s.mu.Unlock()
		return fmt.Errorf("image %q (%s): share in %s: %w", img.Name, img.Digest, s.bucket, err)
	}
	s.mu.Lock()
	s.shared[sharedKey(img)] = true
	s.mu.Unlock()
	return nil
}

// shareNew shares an image that store has just put in place, before its name
// is recorded. For a built-in image a failure is reported to progress only.
func (s *Store) shareNew(ctx context.Context, img sandbox.Image, progress io.Writer) error {
	if s.bucket == nil {
		return nil
	}
	if err := s.share(ctx, img, true); err != nil {
		if !IsBuiltin(img.Name) {
			return err
		}
		s.bucket.log.Warn("image: not shared yet, retried on a later use", "err", err)
		fmt.Fprintf(progress, "image %s: not shared yet (retried on a later use): %v\n", img.Name, err)
		return nil
	}
	fmt.Fprintf(progress, "image %s: shared in %s\n", img.Name, s.bucket)
	return nil
}

// shareLater uploads what the bucket lacks of the named image img, whose file
// is here, unless this process has shared it already or an upload failed
// within shareRetry; concurrent calls for one image wait for one upload.
// Failures are logged: the image serves this host anyway.
func (s *Store) shareLater(ctx context.Context, img sandbox.Image) {
	if s.bucket == nil {
		return
	}
	key := sharedKey(img)
	s.mu.Lock()
	skip := s.shared[key] || time.Since(s.shareFailedAt) < shareRetry
	s.mu.Unlock()
	if skip {
		return
	}
	s.retries.Do(key, func() (any, error) {
		s.mu.Lock()
		done := s.shared[key]
		s.mu.Unlock()
		if done {
			return nil, nil
		}
		err := s.share(ctx, img, false)
		if err != nil {
			s.bucket.log.Warn("image: not shared yet, retried on a later use", "err", err)
		}
		return nil, err
	})
}

// fromBucket returns the image the bucket's manifest of name points at,
// fetching its file if this host has none, and records the name here.
// ok is false when the bucket has no such name.
func (s *Store) fromBucket(ctx context.Context, name string) (img sandbox.Image, ok bool, err error) {
	unlock, err := s.lockName(ctx, name)
	if err != nil {
		return sandbox.Image{}, false, fmt.Errorf("image %q: %w", name, err)
	}
	defer unlock()
	// A build or import of name may have recorded it meanwhile.
	if img, ok, err := s.lookup(ctx, name); err != nil || ok {
		return img, ok, err
	}
	img, ok, err = s.bucket.lookupName(ctx, name)
	if err != nil || !ok {
		if err != nil {
			err = fmt.Errorf("image %q: %s: %w", name, s.bucket, err)
		}
		return sandbox.Image{}, false, err
	}
	if err := s.fetch(ctx, img.Digest); err != nil {
		return sandbox.Image{}, false, fmt.Errorf("image %q: %w", name, err)
	}
	if err := s.record(ctx, img); err != nil {
		return sandbox.Image{}, false, err
	}
	s.mu.Lock()
	s.shared[sharedKey(img)] = true
	s.mu.Unlock()
	return img, true, nil
}

// fetch makes sure the store has the file of digest, downloading it from the
// bucket if not. Concurrent calls for one digest share one download, which
// goes on when the caller that started it gives up (its context ends) while
// others wait. Errors wrap ErrNotFound (not in the bucket either) or
// ErrCorrupt, and name the digest and the key.
func (s *Store) fetch(ctx context.Context, digest string) error {
	p := s.Path(digest)
	if _, err := os.Stat(p); err == nil {
		return nil
	}
	ch := s.fetches.DoChan(digest, func() (any, error) {
		if _, err := os.Stat(p); err == nil {
			return nil, nil // a download that ended just before this one began
		}
		s.downloads.Add(1)
		tmp, err := s.bucket.download(context.WithoutCancel(ctx), digest, s.tmpDir())
		if err != nil {
			return nil, err
		}
		defer os.Remove(tmp)
		if err := os.Chmod(tmp, 0o444); err != nil {
			return nil, err
		}
		if err := os.Rename(tmp, p); err != nil {
			return nil, err
		}
		return nil, atomicfile.SyncDir(filepath.Dir(p))
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return fmt.Errorf("image %s: fetch from %s: %w", digest, s.bucket, r.Err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("image %s: fetch from %s: %w", digest, s.bucket, ctx.Err())
	}
}

// sharedKey is img's key in Store.shared and Store.retries.
func sharedKey(img sandbox.Image) string { return img.Name + "@" + img.Digest }

// missing reports whether err is a stat's "no such file".
func missing(err error) bool { return errors.Is(err, os.ErrNotExist) }
