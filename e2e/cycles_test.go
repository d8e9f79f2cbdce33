package e2e

import (
	"crypto/rand"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestHibernateResumeCycles runs five hibernate/resume cycles on one sandbox that
// holds a Python server (counter + 64 MiB of random data) and a growing set of
// files. Each cycle writes a new file and changes an old one, through the files
// API and through exec, then hibernates; a proxied GET must resume the sandbox
// with the same process continuing, the data's checksum unchanged, and every file
// as it was last written before the hibernate.
func TestHibernateResumeCycles(t *testing.T) {
	srv := start(t, servertest.Options{})
	continuityCycles(t, srv, 5, nil)
}

// cycleHooks let a caller act around each cycle's resume: Before runs after the
// hibernate of cycle k (snapshot snap) and before the proxied request resumes the
// sandbox; After runs right after that request was answered.
type cycleHooks struct {
	Before, After func(k int, snap string)
}

// continuityCycles is the body of TestHibernateResumeCycles, shared with the
// store tests: a sandbox with the 64 MiB workload and a growing set of files goes
// through the given number of hibernate/resume cycles, each checked as described
// there.
func continuityCycles(t *testing.T, srv *servertest.Server, cycles int, hooks *cycleHooks) {
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	id := sb.ID

	t0 := time.Now()
	if err := workload.Start(ctx, c, id, 64); err != nil {
		t.Fatal(err)
	}
	t.Logf("workload (64 MiB) answering after %v", time.Since(t0).Round(time.Millisecond))
	first, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	if first.Bytes != 64<<20 || len(first.SHA256) != 64 || first.Pid == 0 {
		t.Fatalf("workload /checksum answered %+v", first)
	}
	count := first.Count

	// want maps every file path to the sha256 of its last write.
	want := map[string]string{}
	content := map[string][]byte{} // files changed by exec need their old content
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
	// Files before the first cycle, one written each way.
	apiWrite("/root/work/api-0.bin", random(1<<20))
	execAppend("/root/work/exec-0.txt", "created by exec before cycle 1")
	apiWrite("/tmp/tmpfs-0.bin", random(64<<10)) // /tmp is gVisor's internal tmpfs

	gen := sb.Generation
	snaps := map[string]bool{}
	for k := 1; k <= cycles; k++ {
		// A new file and a changed old one, through each way.
		apiWrite(fmt.Sprintf("/root/work/api-%d.bin", k), random(256<<10+k))
		apiWrite(fmt.Sprintf("/root/work/api-%d.bin", k-1), random(128<<10+k))
		execAppend(fmt.Sprintf("/root/work/exec-%d.txt", k), fmt.Sprintf("new in cycle %d", k))
		execAppend(fmt.Sprintf("/root/work/exec-%d.txt", k-1), fmt.Sprintf("changed in cycle %d", k))
		apiWrite("/tmp/tmpfs-0.bin", random(64<<10+k))

		h := hibernate(t, c, id)
		if snaps[h.Snapshot.ID] {
			t.Fatalf("cycle %d: snapshot %s reused", k, h.Snapshot.ID)
		}
		snaps[h.Snapshot.ID] = true
		wantState(t, c, id, apiv1.StateHibernated)
		if hooks != nil && hooks.Before != nil {
			hooks.Before(k, h.Snapshot.ID)
		}

		// The proxied request resumes the sandbox.
		firstAnswer, r := resumeByRequest(t, ctx, c, id, k, first, &count, &gen)
		if hooks != nil && hooks.After != nil {
			hooks.After(k, h.Snapshot.ID)
		}
		t.Logf("cycle %d: first proxied answer %v after the request (resume_ms %d, hibernate_ms %d, snapshot %d bytes)",
			k, firstAnswer.Round(time.Millisecond), r.ResumeMS, h.Snapshot.HibernateMS, h.Snapshot.Bytes)

		// Every file as last written: through the files API ...
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
		// ... and through sha256sum in the sandbox.
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
