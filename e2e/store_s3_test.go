package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/workload"
)

// TestStoreS3Cycles is the 5-cycle memory and file continuity test (as
// TestHibernateResumeCycles) with the chunked store on a real S3 server
// (versitygw, started by s3test; skipped when it is not installed). Before the
// 4th resume the local chunk cache and the opened snapshot copies are emptied,
// so that resume is a cold resume from S3 alone.
//
// Then a second server, with another data directory, on the same bucket and
// prefix is refused at start, naming the first one's data directory (its
// start-up would have deleted every snapshot its database does not know), and
// the first server's snapshots all still verify.
func TestStoreS3Cycles(t *testing.T) {
	s3, srv := startS3(t, "torpor-e2e", server.StoreConfig{})
	storeCycles(t, srv, 5, 4)

	ctx := ctxFor(t, 2*time.Minute)
	snaps, err := srv.Client.ListSnapshots(ctx)
	if err != nil || len(snaps) == 0 {
		t.Fatalf("snapshots after the cycles: %v %v", len(snaps), err)
	}
	second, err := server.New(ctx, server.Config{DataDir: t.TempDir(), RunscPath: servertest.Runsc(t),
		AgentPath: servertest.AgentBinary(t), DisableLifecycle: true,
		Store: server.StoreConfig{Kind: "s3", S3Endpoint: s3.Endpoint, S3Bucket: "torpor-e2e",
			S3AccessKey: s3.AccessKey, S3SecretKey: s3.SecretKey, S3Region: s3.Region}})
	if err == nil {
		second.Close()
		t.Fatal("a second server on the same bucket and prefix started")
	}
	if !errors.Is(err, chunked.ErrOwnedElsewhere) || !strings.Contains(err.Error(), srv.DataDir) {
		t.Fatalf("second server: %v; want ErrOwnedElsewhere naming %s", err, srv.DataDir)
	}
	t.Logf("second server refused: %v", err)
	for _, sn := range snaps {
		if v, err := srv.Client.VerifySnapshot(ctx, sn.ID); err != nil || !v.OK {
			t.Errorf("snapshot %s after the refused start: %+v %v", sn.ID, v, err)
		}
	}
}

// startS3 starts a versitygw server and a torpor server whose store is the
// chunked store on bucket there; cfg adds store options (UploadRetry, …).
func startS3(t *testing.T, bucket string, cfg server.StoreConfig) (*s3test.Server, *servertest.Server) {
	t.Helper()
	return startS3With(t, bucket, servertest.Options{Store: cfg})
}

// startS3With is startS3 with every server option (opts.Store adds store
// options).
func startS3With(t *testing.T, bucket string, opts servertest.Options) (*s3test.Server, *servertest.Server) {
	t.Helper()
	cfg := opts.Store
	s3 := s3test.Start(t)
	// The server expects the bucket to exist.
	if _, err := chunked.NewS3(ctxFor(t, time.Minute), chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket,
		AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
		t.Fatal(err)
	}
	cfg.Kind, cfg.S3Endpoint, cfg.S3Bucket = "s3", s3.Endpoint, bucket
	cfg.S3AccessKey, cfg.S3SecretKey, cfg.S3Region = s3.AccessKey, s3.SecretKey, s3.Region
	opts.Store = cfg
	return s3, startWithOptions(t, opts)
}

// TestStoreChunkedCycles is the continuity test, shorter (2 cycles), with the
// chunked store on the local filesystem backend; the 2nd resume is cold (no
// opened copy: the files are reassembled from the chunks).
func TestStoreChunkedCycles(t *testing.T) {
	srv := startWithStore(t, server.StoreConfig{Kind: "chunked"})
	storeCycles(t, srv, 2, 2)
}

// startWithStore starts a server on the shared data directory with store cfg;
// the chunked store's directory is removed when the test ends, so that tests
// after it start from an empty one.
func startWithStore(t *testing.T, cfg server.StoreConfig) *servertest.Server {
	t.Helper()
	return startWithOptions(t, servertest.Options{Store: cfg})
}

// startWithOptions is startWithStore with every server option.
func startWithOptions(t *testing.T, opts servertest.Options) *servertest.Server {
	t.Helper()
	chunks := filepath.Join(dataDir, "chunks")
	if err := os.RemoveAll(chunks); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(chunks) }) // runs after the server has stopped
	return start(t, opts)
}

// dropLocalCopies empties the chunked store's local cache and opened snapshot
// copies (<data-dir>/chunks/{cache,open}), leaving only the durable backend.
//
// The store fills its cache in the background after a hibernate, so files may
// appear while they are removed: the removal repeats until both directories
// stay empty for 200 ms (at most 30 s).
func dropLocalCopies(t *testing.T) {
	t.Helper()
	for deadline, quiet := time.Now().Add(30*time.Second), 0; quiet < 2; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("chunks/cache keeps filling for 30 s")
		}
		found := 0
		for _, sub := range []string{"open", "cache"} {
			dir := filepath.Join(dataDir, "chunks", sub)
			ents, err := os.ReadDir(dir)
			if err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
			found += len(ents)
			for _, e := range ents {
				_ = os.RemoveAll(filepath.Join(dir, e.Name())) // "directory not empty" while being filled: next round
			}
		}
		if found == 0 {
			quiet++
		} else {
			quiet = 0
		}
	}
}

// storeCycles runs the continuity cycles of TestHibernateResumeCycles on srv;
// the resume of cycle cold (1-based; 0 = none) starts with no local copies.
func storeCycles(t *testing.T, srv *servertest.Server, cycles, cold int) {
	continuityCycles(t, srv, cycles, &cycleHooks{
		Before: func(k int, snap string) {
			if k != cold {
				return
			}
			opened := filepath.Join(dataDir, "chunks", "open", snap)
			dropLocalCopies(t)
			if _, err := os.Stat(opened); !os.IsNotExist(err) {
				t.Fatalf("cycle %d: %s still there after emptying the local copies (%v)", k, opened, err)
			}
			for _, sub := range []string{"open", "cache"} {
				if ents, _ := os.ReadDir(filepath.Join(dataDir, "chunks", sub)); len(ents) != 0 {
					t.Fatalf("cycle %d: chunks/%s not empty: %d entries", k, sub, len(ents))
				}
			}
		},
		After: func(k int, snap string) {
			if k != cold {
				return
			}
			// The resume rebuilt the opened copy from the durable backend.
			if _, err := os.Stat(filepath.Join(dataDir, "chunks", "open", snap)); err != nil {
				t.Errorf("cycle %d: cold resume left no opened copy: %v", k, err)
			}
		},
	})
}

// TestDeleteWhileS3Down: a sandbox whose snapshot waits for its upload is
// deleted while S3 is down. The sandbox goes; its snapshot cannot be deleted
// from S3 yet, so it stays listed and reported not durable (never durable
// while it is nowhere but on this host), and the lifecycle loop deletes it
// once S3 is back.
func TestDeleteWhileS3Down(t *testing.T) {
	s3 := s3test.Start(t)
	const bucket = "torpor-e2e-delete"
	if _, err := chunked.NewS3(ctxFor(t, time.Minute), chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket,
		AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
		t.Fatal(err)
	}
	chunks := filepath.Join(dataDir, "chunks")
	if err := os.RemoveAll(chunks); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(chunks) })
	srv := start(t, servertest.Options{Lifecycle: true, LifecycleInterval: 100 * time.Millisecond,
		Store: server.StoreConfig{Kind: "s3", S3Endpoint: s3.Endpoint, S3Bucket: bucket, S3AccessKey: s3.AccessKey,
			S3SecretKey: s3.SecretKey, S3Region: s3.Region, UploadRetry: 100 * time.Millisecond}})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})

	s3.Stop()
	async := true
	h, err := c.HibernateWith(ctx, sb.ID, apiv1.HibernateRequest{AsyncUpload: &async})
	if err != nil || h.Snapshot == nil || h.Snapshot.Durable {
		t.Fatalf("async hibernate with S3 down: %+v %v", h.Snapshot, err)
	}
	snap := h.Snapshot.ID
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatalf("delete the sandbox while S3 is down: %v", err)
	}
	sn, err := c.GetSnapshot(ctx, snap)
	if err != nil || sn.Durable {
		t.Fatalf("snapshot %s after a delete that could not reach S3: durable %v, %v; want listed, not durable", snap, sn.Durable, err)
	}

	s3.Restart()
	deadline := time.Now().Add(time.Minute)
	for {
		_, err := c.GetSnapshot(ctx, snap)
		if client.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s still there a minute after S3 came back (%v)", snap, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if u, err := c.StoreUsage(ctx); err != nil || u.Snapshots != 0 {
		t.Errorf("store usage after the retried delete: %+v %v", u, err)
	}
}

// TestStoreS3MovedDataDir: a sandbox hibernated on S3 resumes on a server
// that has only the data directory's records (database, store record and id,
// images, guest files) and none of its local snapshot copies or runsc state,
// as after moving the data directory to a new host: the snapshot comes from
// S3 alone, and the process continues with its memory intact.
func TestStoreS3MovedDataDir(t *testing.T) {
	s3, srv := startS3(t, "torpor-e2e-move", server.StoreConfig{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	if err := workload.Start(ctx, c, sb.ID, 16); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.Hibernate(ctx, sb.ID)
	if err != nil || h.Snapshot == nil || !h.Snapshot.Durable {
		t.Fatalf("hibernate: %+v %v", h.Snapshot, err)
	}
	srv.Stop()

	moved := t.TempDir()
	for _, name := range []string{"torpor.db", "store", "store-id", "images", "guest"} {
		if out, err := exec.Command("cp", "-a", filepath.Join(dataDir, name), moved+"/").CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", name, err, out)
		}
	}
	// The database's write-ahead log, if the stopped server left one.
	logs, _ := filepath.Glob(filepath.Join(dataDir, "torpor.db-*"))
	for _, p := range logs {
		if out, err := exec.Command("cp", "-a", p, moved+"/").CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", p, err, out)
		}
	}
	srv2 := servertest.Start(t, servertest.Options{DataDir: moved, Store: server.StoreConfig{Kind: "s3",
		S3Endpoint: s3.Endpoint, S3Bucket: "torpor-e2e-move", S3AccessKey: s3.AccessKey, S3SecretKey: s3.SecretKey,
		S3Region: s3.Region}})
	after, err := workload.Get(ctx, srv2.Client, sb.ID, "/checksum")
	if err != nil {
		t.Fatalf("resume on the moved data directory: %v", err)
	}
	if after.Pid != before.Pid || after.SHA256 != before.SHA256 || after.Count != before.Count+1 {
		t.Fatalf("state after the move: %+v, before %+v", after, before)
	}
	if _, err := os.Stat(filepath.Join(moved, "chunks", "open", h.Snapshot.ID)); err != nil {
		t.Errorf("the resume did not rebuild the snapshot from S3 into chunks/open: %v", err)
	}
	t.Logf("resumed %s from S3 on the moved data directory: count %d → %d, memory sha256 %.12s… intact",
		sb.ID, before.Count, after.Count, after.SHA256)
}
