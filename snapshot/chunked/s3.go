package chunked

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
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

	// hungAt (unix ns) is when a request last ran into its deadline without
	// an answer; 0 once S3 answers again (answering).
	hungAt atomic.Int64

	owner     *Owner
	claimMu   sync.Mutex
	claimed   bool      // owner.json named this store at claimedAt
	claimedAt time.Time // re-read after claimRecheck
	foreign   error     // owner.json names another store (permanent)
}

var _ Backend = (*S3)(nil)
var _ Remote = (*S3)(nil)

// UnreachableAtOpen implements Remote: NewS3 got no answer from the server.
func (b *S3) UnreachableAtOpen() bool { return b.unreachable }

// reachErr marks err with snapshot.ErrUnavailable when the server gave no HTTP
// answer (refused, down, hung past the request's deadline).
func reachErr(err error) error {
	if err == nil || minio.ToErrorResponse(err).StatusCode != 0 {
		return err
	}
	return fmt.Errorf("%w: %w", snapshot.ErrUnavailable, err)
}

// reach is reachErr for a request made under the caller's context outer; a
// request that ran into a deadline, its own or the caller's (not a caller's
// cancellation), marks S3 as hung, so the next requests probe it first
// (answering). A caller's short deadline cut a healthy server costs one probe.
func (b *S3) reach(outer context.Context, err error) error {
	if err != nil && minio.ToErrorResponse(err).StatusCode == 0 && !canceled(outer) && isTimeout(err) {
		b.hungAt.Store(time.Now().UnixNano())
	}
	return reachErr(err)
}

// canceled reports whether ctx was canceled (not merely past its deadline).
func canceled(ctx context.Context) bool { return errors.Is(ctx.Err(), context.Canceled) }

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// s3ProbeTimeout bounds the probe a request makes while S3 is marked hung:
// without it every request of a server whose S3 hangs (accepts connections,
// never answers) waited out its own deadline, 10–120 s, one after another: a
// new-user trial saw a server start take 4 min and GET /v1/store 2 min.
const s3ProbeTimeout = 3 * time.Second

// answering returns nil unless S3 is marked hung; then it probes it (a bucket
// check, s3ProbeTimeout at most): snapshot.ErrUnavailable if it still gives no
// answer, else nil, and the mark is cleared.
func (b *S3) answering(ctx context.Context) error {
	t := b.hungAt.Load()
	if t == 0 {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, s3ProbeTimeout)
	defer cancel()
	_, err := b.c.BucketExists(pctx, b.bucket)
	if err != nil && minio.ToErrorResponse(err).StatusCode == 0 {
		if !canceled(ctx) && isTimeout(err) {
			b.hungAt.Store(time.Now().UnixNano())
		}
		return fmt.Errorf("%w: S3 gave no answer within %s (it hung %s ago): %w", snapshot.ErrUnavailable,
			s3ProbeTimeout, time.Since(time.Unix(0, t)).Round(time.Second), err)
	}
	b.hungAt.CompareAndSwap(t, 0)
	return nil
}

// NewS3 connects to the object store and checks that the bucket exists (creating
// it when cfg.CreateBucket is set).
func NewS3(ctx context.Context, cfg S3Config) (*S3, error) {
	switch {
	case cfg.Endpoint == "" && cfg.Bucket == "":
		return nil, fmt.Errorf("s3 backend: an endpoint and a bucket are required")
	case cfg.Endpoint == "":
		return nil, fmt.Errorf("s3 backend: no endpoint given for bucket %s (the endpoint is not recorded in the data directory: give it again)", cfg.Bucket)
	case cfg.Bucket == "":
		return nil, fmt.Errorf("s3 backend: no bucket given")
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
	if err != nil && strings.Contains(err.Error(), "server gave HTTP response to HTTPS client") {
		return nil, fmt.Errorf("s3 backend %s: the server answers plain HTTP; give the endpoint as http://%s (host:port without a scheme means https)", cfg.Endpoint, host)
	}
	if err != nil && !cfg.CreateBucket && minio.ToErrorResponse(err).StatusCode == 0 {
		// Unreachable (no HTTP answer): start anyway, so a server restarted
		// during an outage serves what it has on local disk and uploads later.
		// The claim is checked on the first write instead.
		b := &S3{c: c, bucket: cfg.Bucket, prefix: cfg.Prefix, unreachable: true, owner: cfg.Owner}
		if isTimeout(err) && ctx.Err() == nil {
			b.hungAt.Store(time.Now().UnixNano())
		}
		return b, nil
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
	if b.claimed && time.Since(b.claimedAt) < claimRecheck {
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
			return fmt.Errorf("s3 claim %s: %w", ownerKey, b.reach(ctx, err))
		}
		if cur, err = b.readOwner(ctx); err != nil {
			return err
		}
		if cur == nil {
			return fmt.Errorf("s3 claim %s: written, then not found", ownerKey)
		}
	}
	if cur.StoreID != b.owner.StoreID {
		b.foreign = fmt.Errorf("%w (store %s of data directory %s on host %s, since %s): its snapshots would be deleted by this store's start-up and garbage collection, and this store's by its; a node of a cluster sharing this prefix needs the first node's store-id (copy DATA_DIR/store-id into this data directory before its first start: docs/multi-host.md); a server of its own needs its own key prefix in the bucket; only if that server is stopped for good and its snapshots are not wanted, delete %s%s (this server will then delete them)",
			ErrOwnedElsewhere, cur.StoreID, cur.DataDir, cur.Host, cur.Since.Format(time.RFC3339), b.prefix, ownerKey)
		return b.foreign
	}
	b.claimed, b.claimedAt = true, time.Now()
	return nil
}

// claimRecheck is how long a write trusts the last reading of owner.json. A
// claim deleted by hand while this store runs is written again, and one
// another store took meanwhile stops this store's writes (ErrOwnedElsewhere),
// within this time: one GET a minute at most.
var claimRecheck = time.Minute

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

// s3StallTimeout bounds how long a put or a ranged get may move no byte: a
// put's body not read on (the connection's send buffer full: the server
// reads nothing), or no answer after its last byte; a ranged get's answer
// not arriving or stopping. It fails then, minio-go's retries included, as a
// timeout (S3 is marked hung, so the next requests probe first). Without it a
// server that hung in the middle of an upload (its connections open, never
// answered) held each request in flight, and so the hibernate, for all of
// s3DataTimeout (measured: 60 s, against 3 s when the server is down).
// 15 s of no progress at all is far beyond a healthy server's pauses.
const s3StallTimeout = 15 * time.Second

// errStalled is the cause of a request cut by stallGuard; it reads as a
// timeout (isTimeout).
var errStalled = fmt.Errorf("no byte moved for %s: %w", s3StallTimeout, context.DeadlineExceeded)

// stallGuard returns a context derived from ctx that is cancelled, with
// cause errStalled, once s3StallTimeout passes without a byte written to
// progress (a writer for minio-go's Progress option or an io.TeeReader);
// stop ends the guard.
func stallGuard(ctx context.Context) (context.Context, *progressMark, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	p := &progressMark{}
	p.last.Store(time.Now().UnixNano())
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(s3StallTimeout / 15)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case now := <-tick.C:
				if now.Sub(time.Unix(0, p.last.Load())) >= s3StallTimeout {
					cancel(errStalled)
					return
				}
			}
		}
	}()
	return ctx, p, func() { close(done); cancel(nil) }
}

// progressMark records when bytes last moved: its Read (minio-go's Progress
// hook is handed each chunk read from a put's body) and Write (an
// io.TeeReader's copy of what a get read) note the time and consume nothing.
type progressMark struct{ last atomic.Int64 }

func (p *progressMark) Read(b []byte) (int, error) {
	p.last.Store(time.Now().UnixNano())
	return len(b), nil
}

func (p *progressMark) Write(b []byte) (int, error) {
	p.last.Store(time.Now().UnixNano())
	return len(b), nil
}

// stalled returns err, or errStalled wrapping it when the request's context
// was cut by stallGuard (minio-go reports only that it was cancelled).
func stalled(ctx context.Context, err error) error {
	if err != nil && errors.Is(context.Cause(ctx), errStalled) {
		return fmt.Errorf("%w (%w)", errStalled, err)
	}
	return err
}

// Put implements Backend.
func (b *S3) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if err := b.claim(ctx); err != nil {
		return fmt.Errorf("s3 put %s: %w", key, err)
	}
	if err := b.answering(ctx); err != nil {
		return fmt.Errorf("s3 put %s: %w", key, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	defer cancel()
	ctx, progress, stop := stallGuard(ctx)
	defer stop()
	_, err := b.c.PutObject(ctx, b.bucket, b.prefix+key, r, size, minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: true,
		Progress:         progress,
	})
	if err != nil {
		return fmt.Errorf("s3 put %s: %w", key, b.reach(outer, stalled(ctx, err)))
	}
	return nil
}

// Get implements Backend. The object is fetched whole (chunks and manifests are
// small), so a missing object is reported here rather than on the first Read.
func (b *S3) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	if err := b.answering(ctx); err != nil {
		return nil, fmt.Errorf("s3 get %s: %w", key, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	o, err := b.c.GetObject(ctx, b.bucket, b.prefix+key, minio.GetObjectOptions{})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("s3 get %s: %w", key, b.reach(outer, err))
	}
	if _, err := o.Stat(); err != nil {
		o.Close()
		cancel()
		if notFound(err) {
			return nil, fmt.Errorf("s3 get %s: %w", key, fs.ErrNotExist)
		}
		return nil, fmt.Errorf("s3 get %s: %w", key, b.reach(outer, err))
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

// GetRange implements Backend with one ranged GET (GetRangeInto a new
// buffer).
func (b *S3) GetRange(ctx context.Context, key string, off, n int64) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("s3 get %s: empty range", key)
	}
	buf := make([]byte, n)
	if err := b.GetRangeInto(ctx, key, off, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// GetRangeInto implements rangeReader with one ranged GET
// (bytes=off-(off+len(buf)-1)), cut when it stalls (stallGuard).
func (b *S3) GetRangeInto(ctx context.Context, key string, off int64, buf []byte) error {
	n := int64(len(buf))
	if n <= 0 {
		return fmt.Errorf("s3 get %s: empty range", key)
	}
	opts := minio.GetObjectOptions{}
	if err := opts.SetRange(off, off+n-1); err != nil {
		return err
	}
	if err := b.answering(ctx); err != nil {
		return fmt.Errorf("s3 get %s: %w", key, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, s3DataTimeout)
	defer cancel()
	ctx, progress, stop := stallGuard(ctx)
	defer stop()
	o, err := b.c.GetObject(ctx, b.bucket, b.prefix+key, opts)
	if err != nil {
		return fmt.Errorf("s3 get %s: %w", key, b.reach(outer, stalled(ctx, err)))
	}
	defer o.Close()
	if _, err := io.ReadFull(io.TeeReader(o, progress), buf); err != nil {
		err = stalled(ctx, err)
		if notFound(err) {
			return fmt.Errorf("s3 get %s: %w", key, fs.ErrNotExist)
		}
		if r := minio.ToErrorResponse(err); errors.Is(err, io.EOF) || r.StatusCode == http.StatusRequestedRangeNotSatisfiable || r.Code == "InvalidRange" {
			err = fmt.Errorf("%v: %w", err, io.ErrUnexpectedEOF)
		}
		return fmt.Errorf("s3 get %s bytes %d-%d: %w", key, off, off+n, b.reach(outer, err))
	}
	return nil
}

// Exists implements Backend.
func (b *S3) Exists(ctx context.Context, key string) (bool, error) {
	if err := b.answering(ctx); err != nil {
		return false, fmt.Errorf("s3 stat %s: %w", key, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
	defer cancel()
	_, err := b.c.StatObject(ctx, b.bucket, b.prefix+key, minio.StatObjectOptions{})
	if err == nil {
		return true, nil
	}
	if notFound(err) {
		return false, nil
	}
	return false, fmt.Errorf("s3 stat %s: %w", key, b.reach(outer, err))
}

// Delete implements Backend. Within s3MetaTimeout of S3 being found hung it
// fails at once with snapshot.ErrUnavailable, without a probe: deletions are
// retried (the manager's lifecycle loop, every 30 s), and every hibernate
// deletes the snapshot it replaces, which held an asynchronous hibernate's
// answer 10 s against a hung S3 in a new-user trial (3 s with a probe).
func (b *S3) Delete(ctx context.Context, key string) error {
	if t := b.hungAt.Load(); t != 0 && time.Since(time.Unix(0, t)) < s3MetaTimeout {
		return fmt.Errorf("s3 delete %s: %w: S3 gave no answer %s ago; the deletion is tried again later", key,
			snapshot.ErrUnavailable, time.Since(time.Unix(0, t)).Round(time.Second))
	}
	if err := b.claim(ctx); err != nil {
		return fmt.Errorf("s3 delete %s: %w", key, err)
	}
	if err := b.answering(ctx); err != nil {
		return fmt.Errorf("s3 delete %s: %w", key, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, s3MetaTimeout)
	defer cancel()
	err := b.c.RemoveObject(ctx, b.bucket, b.prefix+key, minio.RemoveObjectOptions{})
	if err != nil && !notFound(err) {
		return fmt.Errorf("s3 delete %s: %w", key, b.reach(outer, err))
	}
	return nil
}

// List implements Backend.
func (b *S3) List(ctx context.Context, prefix string) ([]Object, error) {
	if err := b.answering(ctx); err != nil {
		return nil, fmt.Errorf("s3 list %s: %w", prefix, err)
	}
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, 2*s3DataTimeout)
	defer cancel()
	var out []Object
	for o := range b.c.ListObjects(ctx, b.bucket, minio.ListObjectsOptions{Prefix: b.prefix + prefix, Recursive: true}) {
		if o.Err != nil {
			return nil, fmt.Errorf("s3 list %s: %w", prefix, b.reach(outer, o.Err))
		}
		out = append(out, Object{Key: strings.TrimPrefix(o.Key, b.prefix), Size: o.Size})
	}
	return out, nil
}
