package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/workload"
)

// TestStreamedColdResume resumes a sandbox holding 128 MiB from S3 with no
// local copy, with --stream-cold-resumes and --background-restore: runsc
// restores from the store's FUSE mount while the chunks arrive. The first
// request after each resume is /checksum, which reads the whole buffer: it
// must match what the sandbox held (nothing stale or missing while pages
// still load), and the counter continues. The resume records its working set
// in the bucket once every chunk is fetched (workingsets/<sandbox>.json,
// naming the snapshot: only a streamed resume writes it). A second cold
// resume (of the next snapshot, which uses that record) is hibernated again at once, while its pages may still load, and
// that snapshot resumes warm with the same checksum. Once loading ends no
// mount is left.
func TestStreamedColdResume(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("FUSE mounts need root")
	}
	const bucket = "torpor-e2e-stream"
	s3, srv := startS3With(t, bucket, servertest.Options{BackgroundRestore: true, StreamColdResumes: true})
	b, err := chunked.NewS3(ctxFor(t, time.Minute), chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket,
		AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true})
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client
	ctx := ctxFor(t, 6*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 512})
	if err := workload.Start(ctx, c, sb.ID, 128); err != nil {
		t.Fatal(err)
	}
	want, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count := want.Count
	for cycle := 1; cycle <= 2; cycle++ {
		h, err := c.Hibernate(ctx, sb.ID)
		if err != nil {
			t.Fatalf("cycle %d: hibernate: %v", cycle, err)
		}
		waitNoStreams(t)
		dropLocalCopies(t)
		got, err := workload.Get(ctx, c, sb.ID, "/checksum")
		if err != nil {
			t.Fatalf("cycle %d: first request after the cold resume: %v", cycle, err)
		}
		if got.SHA256 != want.SHA256 || got.Count != count+1 || got.Pid != want.Pid {
			t.Fatalf("cycle %d: after a streamed cold resume %+v, before %+v", cycle, got, want)
		}
		count++
		var ws struct {
			Snapshot string   `json:"snapshot"`
			File     string   `json:"file"`
			Chunks   []string `json:"chunks"`
		}
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			r, err := b.Get(ctx, "workingsets/"+sb.ID+".json")
			if err == nil {
				err = json.NewDecoder(r).Decode(&ws)
				r.Close()
				if err != nil {
					t.Fatal(err)
				}
				if ws.Snapshot == h.Snapshot.ID {
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("cycle %d: no working set recorded at the resume of %s (last: %s): the resume did not stream (%v)",
					cycle, h.Snapshot.ID, ws.Snapshot, err)
			}
		}
		t.Logf("cycle %d: working set recorded at the resume of %s: %d chunks of %s", cycle, h.Snapshot.ID, len(ws.Chunks), ws.File)
		if ws.File != "pages.img" {
			t.Fatalf("cycle %d: working set of %s", cycle, ws.File)
		}
	}
	// A hibernate while the pages of the second cold resume may still load.
	if _, err := c.Hibernate(ctx, sb.ID); err != nil {
		t.Fatalf("hibernate right after a streamed resume: %v", err)
	}
	got, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil || got.SHA256 != want.SHA256 || got.Count != count+1 {
		t.Fatalf("after a hibernate during page loading: %+v %v, want checksum %s count %d", got, err, want.SHA256, count+1)
	}
	waitNoStreams(t)
}

// waitNoStreams waits (at most 60 s) until no FUSE mount of the store is
// left under <data-dir>/chunks/open: each goes once its pages are loaded.
func waitNoStreams(t *testing.T) {
	t.Helper()
	open := filepath.Join(dataDir, "chunks", "open") + "/"
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		var left []string
		for _, m := range mountPoints() {
			if strings.HasPrefix(m, open) {
				left = append(left, m)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("streams still mounted after 60 s: %v", left)
		}
	}
}
