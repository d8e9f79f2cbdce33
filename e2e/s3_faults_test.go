package e2e

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/workload"
)

// The snapshot store's S3 failing in the middle of a synchronous hibernate's
// upload (docs/operations.md#s3-failures): versitygw killed, or stopped with
// SIGSTOP (a hung server that holds its connections open and never answers).

// TestS3StoppedMidUpload: versitygw is killed while a hibernate uploads its
// snapshot's packs. The hibernate still answers (within 30 s): hibernated,
// the snapshot not durable, kept on local disk as a pending upload; the
// sandbox resumes from that copy while S3 is down with its memory intact;
// once S3 is back the background upload makes the snapshot durable, nothing
// waits in the outbox, and a cold resume (local copies emptied) from S3 alone
// continues the workload.
func TestS3StoppedMidUpload(t *testing.T) {
	s3FaultMidUpload(t, "torpor-e2e-stop", 30*time.Second, (*s3test.Server).Stop, (*s3test.Server).Restart)
}

// TestS3HungMidUpload is TestS3StoppedMidUpload with versitygw frozen
// (SIGSTOP to its pid) instead of killed: the requests in flight get no
// answer, so the hibernate answers only once they run into the S3 client's
// stall deadline; it must still answer, within that deadline and 30 s.
func TestS3HungMidUpload(t *testing.T) {
	s3FaultMidUpload(t, "torpor-e2e-hang", s3StallBound+30*time.Second, (*s3test.Server).Freeze, (*s3test.Server).Thaw)
}

// s3StallBound is how long an S3 request that gets no answer (and moves no
// bytes) is given before it fails: snapshot/chunked's s3StallTimeout
// (docs/operations.md#s3-failures).
const s3StallBound = 15 * time.Second

// s3FaultMidUpload runs the mid-upload fault test on a bucket of its own:
// fault breaks S3 once the hibernate's first new object has reached it, heal
// mends it; the hibernate must answer within bound.
func s3FaultMidUpload(t *testing.T, bucket string, bound time.Duration, fault, heal func(*s3test.Server)) {
	s3, srv := startS3(t, bucket, server.StoreConfig{UploadRetry: 200 * time.Millisecond})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 1024})
	// Random data: the snapshot's chunks do not compress, so its upload is
	// ~32 packs and lasts long enough to be cut in the middle.
	if err := workload.Start(ctx, c, sb.ID, 256); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count, gen := first.Count, sb.Generation
	objects := filepath.Join(s3.DataDir(), bucket)
	before := countObjects(objects)

	type answer struct {
		sb  apiv1.Sandbox
		err error
		at  time.Time
	}
	done := make(chan answer, 1)
	t0 := time.Now()
	go func() {
		h, err := c.Hibernate(ctx, sb.ID)
		done <- answer{h, err, time.Now()}
	}()
	// The fault comes as soon as the upload has begun.
	var faultAt time.Time
	for faultAt.IsZero() {
		select {
		case a := <-done:
			t.Fatalf("the hibernate answered (%v, snapshot %+v) after %v before any new object reached S3",
				a.err, a.sb.Snapshot, a.at.Sub(t0))
		default:
		}
		if n := countObjects(objects); n > before {
			fault(s3)
			faultAt = time.Now()
			t.Logf("S3 broken %v into the hibernate, %d new objects in the bucket", faultAt.Sub(t0).Round(time.Millisecond), n-before)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var a answer
	select {
	case a = <-done:
	case <-time.After(bound + 2*time.Minute):
		heal(s3)
		t.Fatalf("the hibernate did not answer %v after S3 broke mid-upload", bound+2*time.Minute)
	}
	took := a.at.Sub(faultAt)
	t.Logf("hibernate answered %v after the fault (%v in all): %v, snapshot %+v", took.Round(time.Millisecond),
		a.at.Sub(t0).Round(time.Millisecond), a.err, a.sb.Snapshot)
	if took > bound {
		t.Errorf("the hibernate answered %v after S3 broke; bound %v", took, bound)
	}
	if a.err != nil {
		heal(s3)
		t.Fatalf("hibernate with S3 broken mid-upload: %v; want hibernated with the snapshot pending upload", a.err)
	}
	if a.sb.State != apiv1.StateHibernated || a.sb.Snapshot == nil || a.sb.Snapshot.Durable {
		heal(s3)
		t.Fatalf("hibernate with S3 broken mid-upload answered %s, snapshot %+v; want hibernated, durable false", a.sb.State, a.sb.Snapshot)
	}
	snap := a.sb.Snapshot.ID

	// Resumable from the local copy while S3 is still broken.
	tr := time.Now()
	resumeByRequest(t, ctx, c, sb.ID, 1, first, &count, &gen)
	t.Logf("resumed from the local copy with S3 still broken in %v", time.Since(tr).Round(time.Millisecond))

	heal(s3)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		sn, err := c.GetSnapshot(ctx, snap)
		if err == nil && sn.Durable {
			break
		}
		if client.IsNotFound(err) {
			break // replaced by a later snapshot (none is taken here)
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s not durable 2 min after S3 came back (%v)", snap, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("snapshot %s durable %v after S3 came back", snap, time.Since(deadline.Add(-2*time.Minute)).Round(time.Millisecond))
	if ents, _ := os.ReadDir(filepath.Join(dataDir, "chunks", "outbox", "manifests")); len(ents) != 0 {
		t.Errorf("outbox still holds %d manifests after the upload", len(ents))
	}

	// A diff hibernate on the healed S3 is durable; the cold resume needs
	// every chunk of the interrupted upload from S3.
	h := hibernate(t, c, sb.ID)
	if h.Snapshot == nil || !h.Snapshot.Durable {
		t.Fatalf("hibernate with S3 back: snapshot %+v, want durable", h.Snapshot)
	}
	dropLocalCopies(t)
	resumeByRequest(t, ctx, c, sb.ID, 2, first, &count, &gen)
	if v, err := c.VerifySnapshot(ctx, h.Snapshot.ID); err != nil || !v.OK {
		t.Errorf("verify %s: %+v %v", h.Snapshot.ID, v, err)
	}
}

// countObjects counts the objects versitygw keeps under dir (its files,
// without its hidden temporary ones).
func countObjects(dir string) int {
	n := 0
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if strings.HasPrefix(d.Name(), ".") && path != dir {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.Type().IsRegular() {
			n++
		}
		return nil
	})
	return n
}
