package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/torpor/torpor/sandbox"
)

// ErrCorrupt marks an image whose bytes, fetched from the bucket, do not hash
// to the digest they are stored under (a damaged or tampered object). Nothing
// of them is kept on the host.
var ErrCorrupt = errors.New("digest mismatch")

// Bucket is where the image stores of several hosts share their images: an
// S3 bucket (or a key prefix in one) that every host's server reaches. Under
// its prefix P it holds, per image:
//
//	P sha256/<hex>          the EROFS file, whose SHA-256 is <hex>
//	P names/<name>.json     {"name","digest","bytes","source","created_at"}:
//	                        the image a name points at, written after the bytes
//
// so a name listed in the bucket always has its bytes there. Objects are
// written, never deleted, by torpor (a name's manifest is replaced when the
// name is given to a new image). The bytes are not encrypted: images are
// built from public packages or imported by the operator, and unlike a
// sandbox's memory hold nothing a sandbox wrote (docs/multi-host.md).
type Bucket struct {
	c      *minio.Client
	bucket string
	prefix string
	log    *slog.Logger
}

// BucketConfig configures NewBucket.
type BucketConfig struct {
	// Client reaches the object store (e.g. the snapshot store's S3 client,
	// chunked.S3.Client).
	Client *minio.Client
	// Bucket is the bucket's name; it must exist.
	Bucket string
	// Prefix is put before every key, e.g. "images/" (the default a server
	// uses). Every host that shares images must use the same bucket and prefix.
	Prefix string
	// Logger gets the failures of uploads a store retries later (nil: discarded).
	Logger *slog.Logger
}

// NewBucket returns the shared image bucket cfg describes. It makes no
// request.
func NewBucket(cfg BucketConfig) (*Bucket, error) {
	if cfg.Client == nil || cfg.Bucket == "" {
		return nil, errors.New("image bucket: a client and a bucket are required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return &Bucket{c: cfg.Client, bucket: cfg.Bucket, prefix: cfg.Prefix, log: log}, nil
}

// String names the bucket and prefix, for messages ("s3://torpor/images/").
func (b *Bucket) String() string { return "s3://" + b.bucket + "/" + b.prefix }

// BytesKey is the key of digest's EROFS file, prefix included.
func (b *Bucket) BytesKey(digest string) string {
	return b.prefix + "sha256/" + strings.TrimPrefix(digest, "sha256:")
}

// NameKey is the key of name's manifest, prefix included.
func (b *Bucket) NameKey(name string) string { return b.prefix + "names/" + name + ".json" }

// Request deadlines: metaTimeout for a stat or a manifest; a file's transfer
// gets minTransfer plus its size at minRate, so that a hung server ends it
// and a slow one still finishes a 600 MB image (about 10 minutes at 1 MiB/s).
const (
	metaTimeout = 10 * time.Second
	minTransfer = time.Minute
	minRate     = 1 << 20 // bytes per second
	partSize    = 16 << 20
)

func transferTimeout(size int64) time.Duration {
	return minTransfer + time.Duration(size/minRate)*time.Second
}

func notFoundErr(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.StatusCode == http.StatusNotFound || r.Code == "NoSuchKey"
}

// nameManifest is what names/<name>.json holds.
type nameManifest struct {
	Name      string    `json:"name"`
	Digest    string    `json:"digest"`
	Bytes     int64     `json:"bytes"`
	Source    string    `json:"source,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// put uploads img's file at path unless the bucket holds an object of its
// size under its digest, then writes the manifest of img.Name: always when
// replaceName is set, else only if the name has none (a retried upload must
// not take back a name another host gave to a newer image). Errors name the
// key.
func (b *Bucket) put(ctx context.Context, img sandbox.Image, path string, replaceName bool) error {
	key := b.BytesKey(img.Digest)
	sctx, cancel := context.WithTimeout(ctx, metaTimeout)
	st, err := b.c.StatObject(sctx, b.bucket, key, minio.StatObjectOptions{})
	cancel()
	switch {
	case err == nil && st.Size == img.Bytes:
	case err == nil || notFoundErr(err):
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		pctx, cancel := context.WithTimeout(ctx, transferTimeout(img.Bytes))
		_, err = b.c.PutObject(pctx, b.bucket, key, f, img.Bytes, minio.PutObjectOptions{
			ContentType: "application/octet-stream", PartSize: partSize})
		cancel()
		f.Close()
		if err != nil {
			return fmt.Errorf("upload %s to %s: %w", img.Digest, key, err)
		}
	default:
		return fmt.Errorf("stat %s: %w", key, err)
	}
	if img.Name == "" {
		return nil
	}
	nkey := b.NameKey(img.Name)
	if !replaceName {
		sctx, cancel := context.WithTimeout(ctx, metaTimeout)
		_, err := b.c.StatObject(sctx, b.bucket, nkey, minio.StatObjectOptions{})
		cancel()
		if err == nil {
			return nil
		}
		if !notFoundErr(err) {
			return fmt.Errorf("stat %s: %w", nkey, err)
		}
	}
	body, _ := json.Marshal(nameManifest{Name: img.Name, Digest: img.Digest, Bytes: img.Bytes, Source: img.Source, CreatedAt: img.CreatedAt})
	pctx, cancel := context.WithTimeout(ctx, metaTimeout)
	defer cancel()
	if _, err := b.c.PutObject(pctx, b.bucket, nkey, bytes.NewReader(body), int64(len(body)),
		minio.PutObjectOptions{ContentType: "application/json", DisableMultipart: true}); err != nil {
		return fmt.Errorf("write %s: %w", nkey, err)
	}
	return nil
}

// lookupName reads name's manifest; ok is false when the bucket has none.
func (b *Bucket) lookupName(ctx context.Context, name string) (img sandbox.Image, ok bool, err error) {
	key := b.NameKey(name)
	ctx, cancel := context.WithTimeout(ctx, metaTimeout)
	defer cancel()
	o, err := b.c.GetObject(ctx, b.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return sandbox.Image{}, false, fmt.Errorf("read %s: %w", key, err)
	}
	defer o.Close()
	body, err := io.ReadAll(io.LimitReader(o, 1<<16))
	if notFoundErr(err) {
		return sandbox.Image{}, false, nil
	}
	if err != nil {
		return sandbox.Image{}, false, fmt.Errorf("read %s: %w", key, err)
	}
	var m nameManifest
	if err := json.Unmarshal(body, &m); err != nil || m.Name != name || !digestRE.MatchString(m.Digest) {
		return sandbox.Image{}, false, fmt.Errorf("%s: not an image manifest of %q (%v)", key, name, err)
	}
	return sandbox.Image{Name: m.Name, Digest: m.Digest, Bytes: m.Bytes, Source: m.Source, CreatedAt: m.CreatedAt}, true, nil
}

// download writes the object of digest into a new file in dir and returns
// its path once its SHA-256 is digest and it is fsynced. Errors wrap
// ErrNotFound when the bucket has no such object and ErrCorrupt when its
// bytes hash otherwise; no file is left behind on error.
func (b *Bucket) download(ctx context.Context, digest, dir string) (path string, err error) {
	key := b.BytesKey(digest)
	sctx, cancel := context.WithTimeout(ctx, metaTimeout)
	st, err := b.c.StatObject(sctx, b.bucket, key, minio.StatObjectOptions{})
	cancel()
	if notFoundErr(err) {
		return "", fmt.Errorf("%s %w", key, ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("stat %s: %w", key, err)
	}
	gctx, cancel := context.WithTimeout(ctx, transferTimeout(st.Size))
	defer cancel()
	o, err := b.c.GetObject(gctx, b.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return "", fmt.Errorf("get %s: %w", key, err)
	}
	defer o.Close()
	f, err := os.CreateTemp(dir, "fetch-*.erofs")
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), o)
	if notFoundErr(err) {
		return "", fmt.Errorf("%s %w", key, ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("get %s: %w", key, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		return "", fmt.Errorf("%s: %w: its %d bytes hash to %s (delete the object, then import the image again)", key, ErrCorrupt, n, got)
	}
	if err := f.Sync(); err != nil {
		return "", fmt.Errorf("fsync %s: %w", f.Name(), err)
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	return f.Name(), nil
}
