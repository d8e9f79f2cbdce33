package e2e

import (
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
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
func TestStoreS3Cycles(t *testing.T) {
	s3 := s3test.Start(t)
	const bucket = "torpor-e2e"
	// The server expects the bucket to exist.
	if _, err := chunked.NewS3(ctxFor(t, time.Minute), chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket,
		AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
		t.Fatal(err)
	}
	srv := startWithStore(t, server.StoreConfig{Kind: "s3", S3Endpoint: s3.Endpoint, S3Bucket: bucket,
		S3AccessKey: s3.AccessKey, S3SecretKey: s3.SecretKey, S3Region: s3.Region})
	storeCycles(t, srv, 5, 4)
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
	chunks := filepath.Join(dataDir, "chunks")
	if err := os.RemoveAll(chunks); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(chunks) }) // runs after the server has stopped
	return start(t, servertest.Options{Store: cfg})
}

// dropLocalCopies empties the chunked store's local cache and opened snapshot
// copies (<data-dir>/chunks/{cache,open}), leaving only the durable backend.
func dropLocalCopies(t *testing.T) {
	t.Helper()
	for _, sub := range []string{"open", "cache"} {
		dir := filepath.Join(dataDir, "chunks", sub)
		ents, err := os.ReadDir(dir)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		for _, e := range ents {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// storeCycles runs the continuity cycles of TestHibernateResumeCycles on srv;
// the resume of cycle cold (1-based; 0 = none) starts with no local copies.
func storeCycles(t *testing.T, srv *servertest.Server, cycles, cold int) {
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	id := sb.ID

	if err := workload.Start(ctx, c, id, 64); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	if first.Bytes != 64<<20 || len(first.SHA256) != 64 || first.Pid == 0 {
		t.Fatalf("workload /checksum answered %+v", first)
	}
	count := first.Count

	want := map[string]string{}
	content := map[string][]byte{}
	apiWrite := func(path string, b []byte) {
		writeFile(t, c, id, path, b)
		want[path], content[path] = sha(b), b
	}
	execAppend := func(path, line string) {
		sh(t, c, id, fmt.Sprintf("printf '%%s\\n' '%s' >> %s", line, path))
		b := append(append([]byte{}, content[path]...), line+"\n"...)
		want[path], content[path] = sha(b), b
	}
	random := func(n int) []byte {
		b := make([]byte, n)
		rand.Read(b)
		return b
	}
	apiWrite("/root/work/api-0.bin", random(1<<20))
	execAppend("/root/work/exec-0.txt", "created by exec before cycle 1")
	apiWrite("/tmp/tmpfs-0.bin", random(64<<10))

	gen := sb.Generation
	snaps := map[string]bool{}
	for k := 1; k <= cycles; k++ {
		apiWrite(fmt.Sprintf("/root/work/api-%d.bin", k), random(256<<10+k))
		apiWrite(fmt.Sprintf("/root/work/api-%d.bin", k-1), random(128<<10+k))
		execAppend(fmt.Sprintf("/root/work/exec-%d.txt", k), fmt.Sprintf("new in cycle %d", k))
		execAppend(fmt.Sprintf("/root/work/exec-%d.txt", k-1), fmt.Sprintf("changed in cycle %d", k))
		apiWrite("/tmp/tmpfs-0.bin", random(64<<10+k))

		h := hibernate(t, c, id)
		snap := h.Snapshot.ID
		if snaps[snap] {
			t.Fatalf("cycle %d: snapshot %s reused", k, snap)
		}
		snaps[snap] = true
		wantState(t, c, id, apiv1.StateHibernated)

		opened := filepath.Join(dataDir, "chunks", "open", snap)
		if k == cold {
			dropLocalCopies(t)
			if _, err := os.Stat(opened); !os.IsNotExist(err) {
				t.Fatalf("cycle %d: %s still there after emptying the local copies (%v)", k, opened, err)
			}
			for _, sub := range []string{"open", "cache"} {
				if ents, _ := os.ReadDir(filepath.Join(dataDir, "chunks", sub)); len(ents) != 0 {
					t.Fatalf("cycle %d: chunks/%s not empty: %d entries", k, sub, len(ents))
				}
			}
		}

		firstAnswer, r := resumeByRequest(t, ctx, c, id, k, first, &count, &gen)
		if k == cold {
			// The resume rebuilt the opened copy from the durable backend.
			if _, err := os.Stat(opened); err != nil {
				t.Errorf("cycle %d: cold resume left no opened copy: %v", k, err)
			}
		}
		t.Logf("cycle %d (cold=%v): first proxied answer %v after the request (resume_ms %d, hibernate_ms %d, snapshot %d bytes)",
			k, k == cold, firstAnswer.Round(time.Millisecond), r.ResumeMS, h.Snapshot.HibernateMS, h.Snapshot.Bytes)

		paths := make([]string, 0, len(want))
		for p := range want {
			paths = append(paths, p)
		}
		sort.Strings(paths)
		for _, p := range paths {
			if got := sha(readFile(t, c, id, p)); got != want[p] {
				t.Errorf("cycle %d: files API: %s has sha256 %s, want %s", k, p, got, want[p])
			}
		}
		out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: append([]string{"sha256sum"}, paths...)})
		if code != 0 {
			t.Fatalf("cycle %d: sha256sum exit %d: %s", k, code, errb)
		}
		seen := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) == 2 {
				seen[f[1]] = f[0]
			}
		}
		for _, p := range paths {
			if seen[p] != want[p] {
				t.Errorf("cycle %d: sha256sum: %s has %q, want %s", k, p, seen[p], want[p])
			}
		}
		if t.Failed() {
			t.FailNow()
		}
	}
}
