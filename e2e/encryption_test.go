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
	"github.com/torpor/torpor/manager"
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
// versitygw) forks, hibernates and resumes a sandbox holding a marker in
// memory and fills a warm pool of its snapshot; neither the data directory
// nor the bucket holds the marker afterwards (nor while the clones, the
// resumed sandbox or the pool's clone run), and the resume brings it back. Restarted with another key, the resume fails with the
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
		return askHolder(t, c, sb.ID)
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
	// A fork of the running sandbox: its snapshot (the source never runs
	// from it) is opened for the clones' restores, and that plain copy goes
	// once they are restored — not when the clones or the source go (a
	// trial found it in chunks/open 15 minutes after both clones were
	// deleted).
	clones, err := c.Fork(ctx, sb.ID, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, cl := range clones {
		if got := askHolder(t, c, cl.ID); got != marker {
			t.Fatalf("clone %s's holder answers %q, want the marker", cl.ID, got)
		}
	}
	absent("while two clones of a fork run")
	for _, cl := range clones {
		if err := c.DeleteSandbox(ctx, cl.ID); err != nil {
			t.Fatal(err)
		}
	}
	absent("after the fork's clones were deleted")

	hibernate(t, c, sb.ID)
	absent("after the first hibernate")

	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if got := ask(c); got != marker {
		t.Fatalf("holder answers %q after the resume, want the marker", got)
	}
	// The opened copy runsc restored from is removed once the restore
	// returned: nothing on disk while it runs either (that the grep does
	// see such a copy is shown by TestEncryptedCrashes).
	absent("while the resumed sandbox runs")
	snap := hibernate(t, c, sb.ID).Snapshot.ID
	absent("after the second hibernate")
	// A warm pool of the snapshot restores a clone ahead of time: its copy
	// goes once the clone is restored, as a fork's.
	if _, err := c.SetSnapshotPool(ctx, snap, 1); err != nil {
		t.Fatal(err)
	}
	waitPool(t, c, "snapshot", snap, 1)
	absent("with a warm pool's clone of the snapshot ready")
	if _, err := c.SetSnapshotPool(ctx, snap, 0); err != nil {
		t.Fatal(err)
	}

	// Another key: the resume fails, naming both ids, and changes nothing.
	wrong := writeKey()
	srv.Restart(t)
	c = srv.Client
	_, err = c.Resume(ctx, sb.ID)
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

// askHolder asks the holderScript running in sandbox id for its marker.
func askHolder(t *testing.T, c *client.Client, id string) string {
	t.Helper()
	return sh(t, c, id, `rm -f /tmp/answer; touch /tmp/ask; for i in $(seq 200); do [ -e /tmp/answer ] && break; sleep 0.05; done; cat /tmp/answer`)
}

// TestEncryptedCrashes: `torpor serve --snapshot-key` killed (SIGKILL)
//
//   - during a resume, after the snapshot's plain copy was rebuilt in
//     chunks/open and before the restore: the copy holds the marker then
//     (the grep sees plain copies), and the restart's reconcile removes it;
//     the sandbox is hibernated and resumes with its memory;
//   - during a hibernate, after runsc wrote the checkpoint to chunks/staging
//     and before the commit: the staged files hold the marker, and the
//     restart commits the checkpoint (sealed) and removes them; the sandbox
//     is hibernated and resumes with its memory.
//
// After each restart, and after the last hibernate, no file in the data
// directory holds the marker.
func TestEncryptedCrashes(t *testing.T) {
	keyFile := filepath.Join(t.TempDir(), "snapshot.key")
	raw := make([]byte, chunked.KeyBytes)
	rand.Read(raw)
	if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(raw)), 0o600); err != nil {
		t.Fatal(err)
	}
	chunks := filepath.Join(dataDir, "chunks")
	for _, old := range []string{filepath.Join(dataDir, "store"), chunks} {
		if err := os.RemoveAll(old); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { os.RemoveAll(chunks) })
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--snapshot-key", keyFile}}
	p.start()
	c := p.client()
	ctx := ctxFor(t, 10*time.Minute)
	var rb [12]byte
	rand.Read(rb[:])
	marker := "torpor-e2e-marker-" + hex.EncodeToString(rb[:])
	never := 0
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
	if err != nil {
		t.Fatal(err)
	}
	defer p.restartAndDeleteAll()
	writeFile(t, c, sb.ID, "/opt/holder.py", []byte(holderScript))
	if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"python3", "/opt/holder.py", hex.EncodeToString([]byte(marker))}}); err != nil {
		t.Fatal(err)
	}
	if got := askHolder(t, c, sb.ID); got != marker {
		t.Fatalf("holder answers %q before the hibernate", got)
	}
	hibernate(t, c, sb.ID)
	p.stop()

	// crash kills the server at point amid call, checks that the plain
	// files it cut short (in chunks/sub) hold the marker, restarts it and
	// checks that none is left and the sandbox is hibernated and resumes
	// with its memory.
	crash := func(point, sub string, call func() error) {
		t.Helper()
		p.start(manager.FaultEnv + "=" + point)
		if err := call(); err == nil {
			t.Fatalf("kill at %s: the call answered though the server was to be killed", point)
		}
		p.waitKilled()
		if hits := filesWith(t, filepath.Join(chunks, sub), []byte(marker)); len(hits) == 0 {
			t.Fatalf("kill at %s: chunks/%s does not hold the marker: the grep for it cannot see a plain copy", point, sub)
		}
		p.start()
		if hits := filesWith(t, dataDir, []byte(marker)); len(hits) > 0 {
			t.Errorf("kill at %s: after the restart the marker is in plain text in %v", point, hits)
		}
		if st := get(t, c, sb.ID); st.State != apiv1.StateHibernated {
			t.Fatalf("kill at %s: after the restart the sandbox is %s (%s), want hibernated", point, st.State, st.Error)
		}
		if _, err := c.Resume(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		if got := askHolder(t, c, sb.ID); got != marker {
			t.Fatalf("kill at %s: holder answers %q after the resume, want the marker", point, got)
		}
		p.stop() // the sandbox runs on; the next start reattaches it
	}
	crash("resume-restoring", "open", func() error { _, err := c.Resume(ctx, sb.ID); return err })
	crash("hibernate-checkpointed", "staging", func() error { _, err := c.Hibernate(ctx, sb.ID); return err })
	p.start()
	hibernate(t, c, sb.ID)
	if hits := filesWith(t, dataDir, []byte(marker)); len(hits) > 0 {
		t.Errorf("after the hibernate the marker is in plain text in %v", hits)
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
