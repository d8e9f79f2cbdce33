package e2e

import (
	"crypto/rand"
	"encoding/hex"
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
	"github.com/torpor/torpor/snapshot/chunked"
)

// holderScript keeps a marker in a Python process's memory, decoded at
// run time from hex (so the marker itself is in no command line, request or
// log), and writes it to /tmp/answer whenever /tmp/ask appears.
const holderScript = `import os, sys, time
m = bytes.fromhex(sys.argv[1]).decode()
while True:
    if os.path.exists("/tmp/ask"):
        with open("/tmp/answer.tmp", "w") as f:
            f.write(m)
        os.rename("/tmp/answer.tmp", "/tmp/answer")
        os.remove("/tmp/ask")
    time.sleep(0.05)
`

// TestEncryptedSnapshots: a server with --snapshot-key (S3 store on
// versitygw) hibernates a sandbox holding a marker in memory; neither the
// data directory nor the bucket holds the marker afterwards, and the resume
// brings it back. Restarted with another key, the resume fails with the
// error naming both key ids and the sandbox stays hibernated; restarted with
// the right key it resumes.
func TestEncryptedSnapshots(t *testing.T) {
	keyFile := filepath.Join(t.TempDir(), "snapshot.key")
	writeKey := func() *chunked.Key {
		raw := make([]byte, chunked.KeyBytes)
		rand.Read(raw)
		if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(raw)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		k, err := chunked.NewKey(raw)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	right := writeKey()
	rightHex, _ := os.ReadFile(keyFile)
	s3, srv := startS3(t, "torpor-e2e-enc", server.StoreConfig{KeyFile: keyFile})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)

	var rb [12]byte
	rand.Read(rb[:])
	marker := "torpor-e2e-marker-" + hex.EncodeToString(rb[:])
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	writeFile(t, c, sb.ID, "/opt/holder.py", []byte(holderScript))
	writeFile(t, c, sb.ID, "/root/secret.txt", []byte(marker+"\n"))
	if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"python3", "/opt/holder.py", hex.EncodeToString([]byte(marker))}}); err != nil {
		t.Fatal(err)
	}
	ask := func(c *client.Client) string {
		t.Helper()
		return sh(t, c, sb.ID, `rm -f /tmp/answer; touch /tmp/ask; for i in $(seq 200); do [ -e /tmp/answer ] && break; sleep 0.05; done; cat /tmp/answer`)
	}
	if got := ask(c); got != marker {
		t.Fatalf("holder answers %q before the hibernate", got)
	}

	absent := func(when string) {
		t.Helper()
		for _, dir := range []string{dataDir, s3.DataDir()} {
			if hits := filesWith(t, dir, []byte(marker)); len(hits) > 0 {
				t.Errorf("%s: the marker is in plain text in %v", when, hits)
			}
		}
	}
	hibernate(t, c, sb.ID)
	absent("after the first hibernate")

	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if got := ask(c); got != marker {
		t.Fatalf("holder answers %q after the resume, want the marker", got)
	}
	// While it runs, the opened copy runsc restored from is plain text on
	// local disk (docs/security.md): the grep does see a plain copy.
	if hits := filesWith(t, filepath.Join(dataDir, "chunks", "open"), []byte(marker)); len(hits) == 0 {
		t.Error("the marker is not found in the opened copy of a resumed sandbox: the grep for it cannot see it")
	}
	snap := hibernate(t, c, sb.ID).Snapshot.ID
	absent("after the second hibernate")

	// Another key: the resume fails, naming both ids, and changes nothing.
	wrong := writeKey()
	srv.Restart(t)
	c = srv.Client
	_, err := c.Resume(ctx, sb.ID)
	want := "snapshot " + snap + " was encrypted with key " + right.ID() + ", this server has key " + wrong.ID()
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.Status != 409 || !strings.Contains(ae.Message, want) {
		t.Fatalf("resume with the wrong key: %v; want 409 with %q", err, want)
	}
	t.Logf("resume with the wrong key: %v", err)
	wantState(t, c, sb.ID, apiv1.StateHibernated)

	// The right key again: it resumes, the marker in memory and on file.
	if err := os.WriteFile(keyFile, rightHex, 0o600); err != nil {
		t.Fatal(err)
	}
	srv.Restart(t)
	c = srv.Client
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume with the right key: %v", err)
	}
	if got := ask(c); got != marker {
		t.Fatalf("holder answers %q after the restart with the right key", got)
	}
	if got := sh(t, c, sb.ID, "cat /root/secret.txt"); got != marker+"\n" {
		t.Fatalf("/root/secret.txt after the resumes: %q", got)
	}
}

// filesWith returns the files under dir whose content holds needle, found
// by grep -r (-s: files that vanish meanwhile, and namespace files
// bind-mounted there, which read(2) refuses, are left out).
func filesWith(t *testing.T, dir string, needle []byte) []string {
	t.Helper()
	out, err := exec.Command("grep", "-rlsF", "--", string(needle), dir).Output()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() <= 2) { // 1: none; 2: an unreadable file
		t.Fatalf("grep %s: %v", dir, err)
	}
	return strings.Fields(string(out))
}
