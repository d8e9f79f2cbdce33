package chunked

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// A put of a pack to an S3 server that hangs (SIGSTOP: connections accepted,
// never answered) fails after s3StallTimeout without progress, not after
// s3DataTimeout, as unavailable and as a stall, and marks S3 hung; once the
// server answers again the same put succeeds.
func TestS3PutStalls(t *testing.T) {
	srv := s3test.Start(t)
	b := newS3Backend(t, srv)
	body := memImage(2048) // 8 MiB: more than the connection's buffers take
	if err := b.Put(ctx, "packs/warm", bytes.NewReader(body), int64(len(body))); err != nil {
		t.Fatal(err)
	}
	srv.Freeze()
	t0 := time.Now()
	err := b.Put(ctx, "packs/stalled", bytes.NewReader(body), int64(len(body)))
	took := time.Since(t0)
	srv.Thaw()
	t.Logf("put to the hung server: %v after %v", err, took.Round(time.Millisecond))
	if err == nil {
		t.Fatal("put to a hung server succeeded")
	}
	if !errors.Is(err, snapshot.ErrUnavailable) || !errors.Is(err, errStalled) {
		t.Errorf("put to a hung server: %v; want unavailable, stalled", err)
	}
	if took < s3StallTimeout || took > s3StallTimeout+10*time.Second {
		t.Errorf("put to a hung server failed after %v; want %v to %v", took, s3StallTimeout, s3StallTimeout+10*time.Second)
	}
	if b.hungAt.Load() == 0 {
		t.Error("S3 not marked hung after a stalled put")
	}
	if err := b.Put(ctx, "packs/stalled", bytes.NewReader(body), int64(len(body))); err != nil {
		t.Fatalf("put once the server answers again: %v", err)
	}
}
