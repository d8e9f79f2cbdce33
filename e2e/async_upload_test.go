package e2e

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/workload"
)

// TestAsyncUploadS3 hibernates with async_upload while the S3 server is down:
// the hibernate answers with the snapshot not durable, the sandbox resumes from
// the local copy with its memory intact, a second (diff) hibernate is not
// durable either; once S3 is back the background upload makes both durable, and
// a cold resume (local copies emptied) works from S3 alone.
func TestAsyncUploadS3(t *testing.T) {
	s3, srv := startS3(t, "torpor-e2e-async", server.StoreConfig{UploadRetry: 100 * time.Millisecond})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	if err := workload.Start(ctx, c, sb.ID, 64); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count, gen := first.Count, sb.Generation

	async := true
	s3.Stop()
	var snaps []string
	for k := 1; k <= 2; k++ {
		h, err := c.HibernateWith(ctx, sb.ID, apiv1.HibernateRequest{AsyncUpload: &async})
		if err != nil {
			t.Fatalf("cycle %d: async hibernate with S3 down: %v", k, err)
		}
		if h.State != apiv1.StateHibernated || h.Snapshot == nil || h.Snapshot.Durable {
			t.Fatalf("cycle %d: async hibernate with S3 down answered %s, snapshot %+v", k, h.State, h.Snapshot)
		}
		snaps = append(snaps, h.Snapshot.ID)
		if sn, err := c.GetSnapshot(ctx, h.Snapshot.ID); err != nil || sn.Durable {
			t.Fatalf("cycle %d: GET snapshot while S3 is down: durable %v, %v", k, sn.Durable, err)
		}
		// Resumes from the local copy while S3 is still down.
		resumeByRequest(t, ctx, c, sb.ID, k, first, &count, &gen)
	}
	// A synchronous hibernate while S3 is down cannot commit to S3; rather than
	// lose the sandbox's memory it keeps the snapshot as a pending upload and
	// says so.
	h := hibernate(t, c, sb.ID)
	if h.Snapshot == nil || h.Snapshot.Durable {
		t.Fatalf("synchronous hibernate with S3 down: snapshot %+v, want durable false", h.Snapshot)
	}
	snaps = append(snaps, h.Snapshot.ID)

	s3.Restart()
	deadline := time.Now().Add(2 * time.Minute)
	for _, id := range snaps {
		for {
			sn, err := c.GetSnapshot(ctx, id)
			if err == nil && sn.Durable {
				break
			}
			if client.IsNotFound(err) {
				break // an older snapshot of the sandbox, replaced and deleted
			}
			if time.Now().After(deadline) {
				t.Fatalf("snapshot %s not durable 2 min after S3 came back (%v)", id, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(dataDir, "chunks", "outbox", "manifests")); len(ents) != 0 {
		t.Fatalf("outbox still holds %d manifests after the upload", len(ents))
	}
	// Cold: nothing local but what S3 has.
	dropLocalCopies(t)
	resumeByRequest(t, ctx, c, sb.ID, 3, first, &count, &gen)
}
