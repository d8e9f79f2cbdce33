package chunked

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/torpor/torpor/snapshot"
)

// S3Config configures the S3 backend.
type S3Config struct {
	// Endpoint is host:port or a URL ("http://127.0.0.1:9000", "https://s3.amazonaws.com").
	// Without a scheme, TLS is used unless Insecure is set.
	Endpoint  string
	Bucket    string
	AccessKey string
	SecretKey string
	Region    string
	// PathStyle selects path-style requests (http://host/bucket/key), which most
	// self-hosted servers need.
	PathStyle bool
	// Insecure selects plain HTTP for an endpoint given without a scheme.
	Insecure bool
	// Prefix is prepended to every key ("" or "torpor/").
	Prefix string
	// CreateBucket creates the bucket when it does not exist.
	CreateBucket bool
	// Owner, when set, is the store that claims the prefix: the backend writes
	// it to <prefix>owner.json if no store has (a conditional PUT with
	// If-None-Match: *, then read back), and refuses to write or delete
	// anything under a prefix another store claims (ErrOwnedElsewhere). One
	// store's start-up and garbage collection delete what its own records do
	// not know, so two stores writing under one prefix would delete each
	// other's snapshots. Nil: no claim is checked (read-only tools).
	Owner *Owner
}

// Owner identifies the store (a torpor data directory) that writes under an
// S3 prefix; it is stored as JSON in <prefix>owner.json.
type Owner struct {
	StoreID string    `json:"store_id"` // random, recorded in the data directory
	Host    string    `json:"host"`     // hostname, for the error message only
	DataDir string    `json:"data_dir"` // absolute path, for the error message only
	Since   time.Time `json:"since"`    // when the claim was written (UTC)
}

// ErrOwnedElsewhere is returned (wrapped, with the owner named) by NewS3,
// Put and Delete when another store claims the prefix.
var ErrOwnedElsewhere = errors.New("the S3 prefix belongs to another torpor store")

// ownerKey is the claim's key under the prefix, beside chunks/, packs/,
// index/ and manifests/.
const ownerKey = "owner.json"

// S3 is the backend on an S3-compatible object store (minio-go client). A
// successful PutObject is durable by the store's contract, so S3 needs no Sync.
type S3 struct {
	c      *minio.Client
	bucket string
	prefix string
	// unreachable: NewS3 got no answer from the server (down or hung), so a
	// store does not try to list it at start (New).
	unreachable bool

	owner   *Owner
	claimMu sync.Mutex
	claimed bool  // owner.json names this store
	foreign error // owner.json names another store (permanent)
}

var _ Backend = (*S3)(nil)

// reachErr marks err with snapshot.ErrUnavailable when the server gave no HTTP
// answer (refused, down, hung past the request's deadline).
func reachErr(err error) error {
	if err == nil || minio.ToErrorResponse(err).StatusCode != 0 {
		return err
	}
	return fmt.Errorf("%w: %w", snapshot.ErrUnavailable, err)
}

// NewS3 connects to the object store and checks that the bucket exists (creating
// it when cfg.CreateBucket is set).
func NewS3(ctx context.Context, cfg S3Config) (*S3, error) {
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		return nil, fmt.Errorf("s3 backend: endpoint and bucket are required")
	}
	host, secure := cfg.Endpoint, !cfg.Insecure
	if strings.Contains(host, "://") {
		u, err := url.Parse(host)
		if err != nil {
			return nil, fmt.Errorf("s3 endpoint %q: %w", cfg.Endpoint, err)
		}
		host, secure = u.Host, u.Scheme == "https"
	}
	lookup := minio.BucketLookupDNS
	if cfg.PathStyle {
		lookup = minio.BucketLookupPath
	}
	tr, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, err
	}
	tr.MaxIdleConnsPerHost = 32
	c, err := minio.New(host, &minio.Options{
		Creds:        credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, ""),
		Secure:       secure,
		Region:       cfg.Region,
		BucketLookup: lookup,
		Transport:    tr,
		MaxRetries:   3,
	})
	if err != nil {
		return nil, fmt.Errorf("s3 backend: %w", err)
	}
	// A deadline: a hung server (accepting connections, never answering)
	// would otherwise hold a server's start, or an offline command, for minutes.
	bctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
	ok, err := c.BucketExists(bctx, cfg.Bucket)
	cancel()
	if err != nil && !cfg.CreateBucket && minio.ToErrorResponse(err).StatusCode == 0 {
		// Unreachable (no HTTP answer): start anyway, so a server restarted
		// during an outage serves what it has on local disk and uploads later.
		// The claim is checked on the first write instead.
		return &S3{c: c, bucket: cfg.Bucket, prefix: cfg.Prefix, unreachable: true, owner: cfg.Owner}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("s3 backend %s bucket %s: %w", cfg.Endpoint, cfg.Bucket, err)
	}
	if !ok {
		if !cfg.CreateBucket {
			return nil, fmt.Errorf("s3 backend %s: bucket %s does not exist", cfg.Endpoint, cfg.Bucket)
		}
		if err := c.MakeBucket(ctx, cfg.Bucket, minio.MakeBucketOptions{Region: cfg.Region}); err != nil {
			return nil, fmt.Errorf("s3 backend: create bucket %s: %w", cfg.Bucket, err)
		}
	}
	b := &S3{c: c, bucket: cfg.Bucket, prefix: cfg.Prefix, owner: cfg.Owner}
	if err := b.claim(ctx); err != nil && !errors.Is(err, snapshot.ErrUnavailable) {
		return nil, fmt.Errorf("s3 backend %s bucket %s prefix %q: %w", cfg.Endpoint, cfg.Bucket, cfg.Prefix, err)
	}
	return b, nil
}

// claim makes sure the prefix is this backend's owner's: it reads
// owner.json, writes it when missing (If-None-Match: *, so of two stores
// claiming at once one wins; read back for servers that ignore the header),
// and remembers the answer. Errors: ErrOwnedElsewhere (wrapped, naming the
// owner; remembered), snapshot.ErrUnavailable when S3 does not answer (tried
// again on the next call), or another S3 error. Nil without an owner.
func (b *S3) claim(ctx context.Context) error {
	if b.owner == nil {
		return nil
	}
	b.claimMu.Lock()
	defer b.claimMu.Unlock()
	if b.claimed {
		return nil
	}
	if b.foreign != nil {
		return b.foreign
	}
	cur, err := b.readOwner(ctx)
	if err != nil {
		return err
	}
	if cur == nil {
		o := *b.owner
		o.Since = time.Now().UTC().Truncate(time.Second)
		body, _ := json.Marshal(o)
		opts := minio.PutObjectOptions{ContentType: "application/json", DisableMultipart: true}
		opts.SetMatchETagExcept("*")
		pctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
		_, err := b.c.PutObject(pctx, b.bucket, b.prefix+ownerKey, bytes.NewReader(body), int64(len(body)), opts)
		cancel()
		if err != nil && minio.ToErrorResponse(err).StatusCode != http.StatusPreconditionFailed {
			return fmt.Errorf("s3 claim %s: %w", ownerKey, reachErr(err))
		}
		if cur, err = b.readOwner(ctx); err != nil {
			return err
		}
		if cur == nil {
			return fmt.Errorf("s3 claim %s: written, then not found", ownerKey)
		}
	}
	if cur.StoreID != b.owner.StoreID {
		b.foreign = fmt.Errorf("%w (store %s of data directory %s on host %s, since %s): its snapshots would be deleted by this store's start-up and garbage collection, and this store's by its; give this server its own prefix (--s3-prefix); if that store is gone for good and its snapshots are not wanted, delete %s%s",
			ErrOwnedElsewhere, cur.StoreID, cur.DataDir, cur.Host, cur.Since.Format(time.RFC3339), b.prefix, ownerKey)
		return b.foreign
	}
	b.claimed = true
	return nil
}

// readOwner returns the owner recorded in owner.json, nil when there is none.
// A read cut by an overwrite (412 on the body's If-Match, with a server that
// ignored If-None-Match) is tried again.
func (b *S3) readOwner(ctx context.Context) (*Owner, error) {
	for attempt := 0; ; attempt++ {
		rc, err := b.Get(ctx, ownerKey)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		var o Owner
		err = json.NewDecoder(io.LimitReader(rc, 1<<16)).Decode(&o)
		rc.Close()
		if err != nil && minio.ToErrorResponse(err).StatusCode == http.StatusPreconditionFailed && attempt < 3 {
			continue
		}
		if err != nil || o.StoreID == "" {
			return nil, fmt.Errorf("s3 %s%s: not a torpor owner record (%v); delete it only if no torpor store uses the prefix", b.prefix, ownerKey, reachErr(err))
		}
		return &o, nil
	}
}

func notFound(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.StatusCode == http.StatusNotFound || r.Code == "NoSuchKey"
}

// Deadlines per request (minio-go retries within them): a server that accepts
// connections and never answers otherwise holds a hibernate for minutes
// (measured: ~3 min per request with the client's defaults). The data requests'
// bound is for an 8 MiB pack at ≥ 0.2 MB/s.
const (
	s3MetaTimeout = 10 * time.Second // stat, delete
	s3DataTimeout = 60 * time.Second // put, get, list
)

// Put implements Backend.
func (b *S3) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if err := b.claim(ctx); err != nil {
		return fmt.Errorf("s3 put %s: %w", key, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	defer cancel()
	_, err := b.c.PutObject(ctx, b.bucket, b.prefix+key, r, size, minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: true,
	})
	if err != nil {
		return fmt.Errorf("s3 put %s: %w", key, reachErr(err))
	}
	return nil
}

// Get implements Backend. The object is fetched whole (chunks and manifests are
// small), so a missing object is reported here rather than on the first Read.
func (b *S3) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	o, err := b.c.GetObject(ctx, b.bucket, b.prefix+key, minio.GetObjectOptions{})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("s3 get %s: %w", key, reachErr(err))
	}
	if _, err := o.Stat(); err != nil {
		o.Close()
		cancel()
		if notFound(err) {
			return nil, fmt.Errorf("s3 get %s: %w", key, fs.ErrNotExist)
		}
		return nil, fmt.Errorf("s3 get %s: %w", key, reachErr(err))
	}
	return cancelOnClose{o, cancel}, nil
}

// cancelOnClose releases a request's deadline when its body is closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// GetRange implements Backend with one ranged GET (bytes=off-(off+n-1)).
func (b *S3) GetRange(ctx context.Context, key string, off, n int64) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("s3 get %s: empty range", key)
	}
	opts := minio.GetObjectOptions{}
	if err := opts.SetRange(off, off+n-1); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	defer cancel()
	o, err := b.c.GetObject(ctx, b.bucket, b.prefix+key, opts)
	if err != nil {
		return nil, fmt.Errorf("s3 get %s: %w", key, reachErr(err))
	}
	defer o.Close()
	buf := make([]byte, n)
	if _, err := io.ReadFull(o, buf); err != nil {
		if notFound(err) {
			return nil, fmt.Errorf("s3 get %s: %w", key, fs.ErrNotExist)
		}
		if r := minio.ToErrorResponse(err); errors.Is(err, io.EOF) || r.StatusCode == http.StatusRequestedRangeNotSatisfiable || r.Code == "InvalidRange" {
			err = fmt.Errorf("%v: %w", err, io.ErrUnexpectedEOF)
		}
		return nil, fmt.Errorf("s3 get %s bytes %d-%d: %w", key, off, off+n, reachErr(err))
	}
	return buf, nil
}

// Exists implements Backend.
func (b *S3) Exists(ctx context.Context, key string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
	defer cancel()
	_, err := b.c.StatObject(ctx, b.bucket, b.prefix+key, minio.StatObjectOptions{})
	if err == nil {
		return true, nil
	}
	if notFound(err) {
		return false, nil
	}
	return false, fmt.Errorf("s3 stat %s: %w", key, reachErr(err))
}

// Delete implements Backend.
func (b *S3) Delete(ctx context.Context, key string) error {
	if err := b.claim(ctx); err != nil {
		return fmt.Errorf("s3 delete %s: %w", key, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
	defer cancel()
	err := b.c.RemoveObject(ctx, b.bucket, b.prefix+key, minio.RemoveObjectOptions{})
	if err != nil && !notFound(err) {
		return fmt.Errorf("s3 delete %s: %w", key, reachErr(err))
	}
	return nil
}

// List implements Backend.
func (b *S3) List(ctx context.Context, prefix string) ([]Object, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*s3DataTimeout)
	defer cancel()
	var out []Object
	for o := range b.c.ListObjects(ctx, b.bucket, minio.ListObjectsOptions{Prefix: b.prefix + prefix, Recursive: true}) {
		if o.Err != nil {
			return nil, fmt.Errorf("s3 list %s: %w", prefix, reachErr(o.Err))
		}
		out = append(out, Object{Key: strings.TrimPrefix(o.Key, b.prefix), Size: o.Size})
	}
	return out, nil
}
