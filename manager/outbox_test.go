package manager_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// holdManifests fails every Put of a manifest while hold is set: the
// commit's packs reach the bucket, its last object (the commit point) does
// not, as when S3 went away in the middle of an upload.
type holdManifests struct {
	chunked.Backend
	hold *atomic.Bool
}

func (h holdManifests) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if h.hold.Load() && strings.HasPrefix(key, "manifests/") {
		return fmt.Errorf("put %s: held by the test", key)
	}
	return h.Backend.Put(ctx, key, r, size)
}

// downBackend answers every call with snapshot.ErrUnavailable while down is
// set, as the S3 backend does when the server does not answer.
type downBackend struct {
	chunked.Backend
	down *atomic.Bool
}

func (d downBackend) err(key string) error {
	return fmt.Errorf("s3 %s: %w: connection refused (the test's)", key, snapshot.ErrUnavailable)
}

func (d downBackend) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if d.down.Load() {
		return d.err(key)
	}
	return d.Backend.Put(ctx, key, r, size)
}

func (d downBackend) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	if d.down.Load() {
		return nil, d.err(key)
	}
	return d.Backend.Get(ctx, key)
}

func (d downBackend) GetRange(ctx context.Context, key string, off, n int64) ([]byte, error) {
	if d.down.Load() {
		return nil, d.err(key)
	}
	return d.Backend.GetRange(ctx, key, off, n)
}

func (d downBackend) Exists(ctx context.Context, key string) (bool, error) {
	if d.down.Load() {
		return false, d.err(key)
	}
	return d.Backend.Exists(ctx, key)
}

func (d downBackend) List(ctx context.Context, prefix string) ([]chunked.Object, error) {
	if d.down.Load() {
		return nil, d.err(prefix)
	}
	return d.Backend.List(ctx, prefix)
}

// s3Node returns a hostOpts.store making a chunked store on bucket of srv
// (created by the first), its manifest Puts held while hold is set (nil:
// never); the store is also put in *made.
func s3Node(srv *s3test.Server, bucket string, first bool, hold *atomic.Bool, made **chunked.Store) func(t *testing.T, dir string) snapshot.Store {
	return s3NodeDown(srv, bucket, first, hold, nil, made)
}

// s3NodeDown is s3Node whose backend is unreachable while down is set (nil:
// never).
func s3NodeDown(srv *s3test.Server, bucket string, first bool, hold, down *atomic.Bool, made **chunked.Store) func(t *testing.T, dir string) snapshot.Store {
	return func(t *testing.T, dir string) snapshot.Store {
		b, err := chunked.NewS3(context.Background(), chunked.S3Config{Endpoint: srv.Endpoint, Bucket: bucket,
			AccessKey: srv.AccessKey, SecretKey: srv.SecretKey, Region: srv.Region, PathStyle: true, CreateBucket: first})
		if err != nil {
			t.Fatal(err)
		}
		var backend chunked.Backend = b
		if hold != nil {
			backend = holdManifests{Backend: b, hold: hold}
		}
		if down != nil {
			backend = downBackend{Backend: backend, down: down}
		}
		s, err := chunked.New(context.Background(), chunked.Config{Dir: dir + "/chunks", Backend: backend,
			CacheBytes: 16 << 20, UploadRetry: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		*made = s
		return s
	}
}

// TestDurableOnlyOnceInBucket: two nodes, each with its own chunked store on
// one versitygw bucket. Node A's synchronous hibernate cannot put its
// manifest (the commit falls back to A's upload outbox, durable false).
// Until the manifest is in the bucket the snapshot is not durable as any
// node shows it, and a resume through node B is a retryable 503
// (UploadPendingError, Retry-After) that leaves the sandbox hibernated —
// not 422 snapshot_corrupt. Once the upload ends it is durable everywhere,
// and B's very next resume restores it. A snapshot whose record says it is
// in the bucket but that is not is still snapshot_corrupt.
func TestDurableOnlyOnceInBucket(t *testing.T) {
	ctx := context.Background()
	srv := s3test.Start(t)
	const bucket = "durable"
	var hold, downB atomic.Bool
	var storeB *chunked.Store
	a := newHost(t, hostOpts{node: "node-a", store: s3Node(srv, bucket, true, &hold, new(*chunked.Store))})
	b := newHost(t, hostOpts{node: "node-b", peer: a, store: s3NodeDown(srv, bucket, false, nil, &downB, &storeB)})
	sb := a.create()
	a.writeFile(sb.ID, "/tmp/f", "before")

	hold.Store(true)
	hib, err := a.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{})
	if err != nil || hib.State != sandbox.StateHibernated || hib.Snapshot == nil {
		t.Fatalf("hibernate with the manifest held: %v %+v", err, hib)
	}
	snapID := hib.Snapshot.ID
	if hib.Snapshot.Durable {
		t.Fatalf("node A reports snapshot %s durable while its manifest is not in the bucket", snapID)
	}
	time.Sleep(300 * time.Millisecond) // several upload attempts fail meanwhile
	for name, h := range map[string]*host{"A": a, "B": b} {
		got, err := h.m.Get(ctx, sb.ID)
		if err != nil || got.Snapshot == nil || got.Snapshot.Durable {
			t.Fatalf("node %s shows the held snapshot durable: %v %+v", name, err, got.Snapshot)
		}
	}
	_, err = b.m.Resume(ctx, sb.ID)
	var pending *manager.UploadPendingError
	if sandbox.KindOf(err) != sandbox.Unavailable || !errors.As(err, &pending) || pending.Node != "node-a" ||
		manager.RetryAfterSeconds(err) <= 0 {
		t.Fatalf("resume through node B before the upload: %v (kind %v), want Unavailable naming node-a's outbox with a Retry-After",
			err, sandbox.KindOf(err))
	}
	if r := b.record(sb.ID); r.State != sandbox.StateHibernated || r.SnapshotID != snapID || r.Owner != "" {
		t.Fatalf("after the refused resume: state %s snapshot %s owner %q, want hibernated on %s with no owner",
			r.State, r.SnapshotID, r.Owner, snapID)
	}
	// The same with the bucket unreachable from node B too (a trial found
	// the S3 error answered there, without the outbox or a Retry-After).
	downB.Store(true)
	_, err = b.m.Resume(ctx, sb.ID)
	downB.Store(false)
	if !errors.As(err, &pending) || pending.Node != "node-a" || manager.RetryAfterSeconds(err) <= 0 {
		t.Fatalf("resume through node B before the upload, with S3 down for B: %v, want Unavailable naming node-a's outbox with a Retry-After", err)
	}

	hold.Store(false)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		got, err := b.m.Get(ctx, sb.ID)
		if err == nil && got.Snapshot != nil && got.Snapshot.Durable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the snapshot never became durable as node B shows it: %v %+v", err, got.Snapshot)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// What a resume through B restores from (the fake engine's checkpoint
	// is a directory tree, which the chunked store does not keep: the
	// restore itself is the e2e tests').
	if _, _, err := storeB.Open(ctx, snapID); err != nil {
		t.Fatalf("node B opening the snapshot as soon as it shows durable: %v", err)
	}

	// Recorded durable but gone from the bucket: corrupt, as before.
	other := a.create()
	hib2, err := a.m.Hibernate(ctx, other.ID, manager.HibernateOptions{})
	if err != nil || !hib2.Snapshot.Durable {
		t.Fatalf("hibernate on node A: %v %+v", err, hib2.Snapshot)
	}
	bk, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: srv.Endpoint, Bucket: bucket,
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey, Region: srv.Region, PathStyle: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := bk.Delete(ctx, "manifests/"+hib2.Snapshot.ID+".json"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.m.Resume(ctx, other.ID); sandbox.KindOf(err) != sandbox.SnapshotCorrupt {
		t.Fatalf("resume through node B of a snapshot gone from the bucket: %v (kind %v), want snapshot_corrupt", err, sandbox.KindOf(err))
	}
}

// TestRetryAfterDurableUnavailable: a call that failed because the durable
// tier did not answer tells the caller when to retry (a trial found such
// 503s without Retry-After).
func TestRetryAfterDurableUnavailable(t *testing.T) {
	err := &sandbox.Error{Kind: sandbox.Unavailable, Op: "resume", SandboxID: "sbx-x",
		Err: fmt.Errorf("manifest: s3 get: %w: connection refused", snapshot.ErrUnavailable)}
	if got := manager.RetryAfterSeconds(err); got != int(manager.DurableRetryAfter/time.Second) {
		t.Errorf("Retry-After of a durable tier outage: %d s, want %v", got, manager.DurableRetryAfter)
	}
	if got := manager.RetryAfterSeconds(errors.New("other")); got != 0 {
		t.Errorf("Retry-After of another error: %d, want 0", got)
	}
}
