package e2e

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// oldestAgentCommit is a commit of this repository whose guest agent speaks
// proto.MinVersion: the last one before the protocol was versioned (version 1).
// When MinVersion is raised (see guest/proto/doc.go), this names the first
// commit of the new oldest version.
const oldestAgentCommit = "b89f061"

// buildAgentAt builds cmd/torpor-agent from the repository's own history at
// commit rev (git archive into a temporary directory, then go build there with
// the module cache) and returns the binary's path. It skips the test if git or
// the commit is not available (a shallow clone, a source tarball).
func buildAgentAt(t *testing.T, rev string) string {
	t.Helper()
	if _, err := exec.LookPath("git"); err != nil {
		t.Skipf("no git: cannot build the agent of commit %s: %v", rev, err)
	}
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Skipf("not in a git checkout: cannot build the agent of commit %s: %v", rev, err)
	}
	repo := strings.TrimSpace(string(top))
	if out, err := exec.Command("git", "-C", repo, "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		t.Skipf("commit %s is not in %s (a shallow clone?): %v %s", rev, repo, err, out)
	}
	src := t.TempDir()
	archive := exec.Command("git", "-C", repo, "archive", rev)
	untar := exec.Command("tar", "-x", "-C", src)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	untar.Stdin = pipe
	var aerr, terr bytes.Buffer
	archive.Stderr, untar.Stderr = &aerr, &terr
	if err := untar.Start(); err != nil {
		t.Fatal(err)
	}
	if err := archive.Run(); err != nil {
		t.Fatalf("git archive %s: %v: %s", rev, err, aerr.Bytes())
	}
	if err := untar.Wait(); err != nil {
		t.Fatalf("tar -x of commit %s: %v: %s", rev, err, terr.Bytes())
	}
	bin := filepath.Join(t.TempDir(), "torpor-agent-"+rev)
	t0 := time.Now()
	build := exec.Command("go", "build", "-o", bin, "./cmd/torpor-agent")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=mod")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the agent of commit %s: %v: %s", rev, err, out)
	}
	t.Logf("built the agent of commit %s in %v", rev, time.Since(t0).Round(time.Millisecond))
	return bin
}

// agentVersion returns the protocol version the server's agent client learnt
// for sandbox id.
func agentVersion(t *testing.T, srv *servertest.Server, id string) int {
	t.Helper()
	v, err := srv.Manager.AgentProtocolVersion(id)
	if err != nil {
		t.Fatalf("agent protocol version of %s: %v", id, err)
	}
	return v
}

// TestResumeOldestAgentSnapshot hibernates a sandbox whose agent is the oldest
// one the host still supports (built from the repository's history), then
// resumes that snapshot on a server that installs the current agent: the
// sandbox's process continues, exec and files work, and the resume contract ran
// in the old agent (report and generation), which the host speaks at protocol
// version 1; a new sandbox on the same server speaks the current version.
func TestResumeOldestAgentSnapshot(t *testing.T) {
	oldAgent := buildAgentAt(t, oldestAgentCommit)
	ctx := ctxFor(t, 10*time.Minute)

	old := start(t, servertest.Options{AgentPath: oldAgent})
	c := old.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id := sb.ID
	if v := agentVersion(t, old, id); v != proto.Version1 {
		t.Fatalf("agent of commit %s: protocol version %d, want 1", oldestAgentCommit, v)
	}
	wantContract(t, sb, "start", false)
	agentSum := strings.Fields(sh(t, c, id, "sha256sum /.torpor/torpor-agent"))[0]
	if b, err := os.ReadFile(oldAgent); err != nil || sha(b) != agentSum {
		t.Fatalf("the sandbox runs agent %s, want the one of commit %s (%v)", agentSum, oldestAgentCommit, err)
	}
	if err := workload.Start(ctx, c, id, 16); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, c, id, "/root/before.txt", []byte("written through the old agent\n"))
	count, gen := first.Count, sb.Generation
	h := hibernate(t, c, id)
	old.Stop()

	// The same data directory, now with the current agent.
	srv := start(t, servertest.Options{})
	c = srv.Client
	wantState(t, c, id, apiv1.StateHibernated)
	for k := 1; k <= 2; k++ {
		// The proxied request resumes the snapshot: same process, counter +1, data
		// unchanged, new generation.
		_, r := resumeByRequest(t, ctx, c, id, k, first, &count, &gen)
		rep := wantContract(t, r, "resume", false)
		if !rep.OK || rep.SnapshotID != h.Snapshot.ID {
			t.Errorf("cycle %d: report ok %v snapshot %q, want ok from %s", k, rep.OK, rep.SnapshotID, h.Snapshot.ID)
		}
		if g := genFile(t, c, id); g != r.Generation {
			t.Errorf("cycle %d: /run/torpor/generation %d, API %d", k, g, r.Generation)
		}
		if v := agentVersion(t, srv, id); v != proto.Version1 {
			t.Errorf("cycle %d: resumed sandbox's agent speaks protocol version %d, want 1 (the agent of its snapshot)", k, v)
		}
		if got := strings.Fields(sh(t, c, id, "sha256sum /.torpor/torpor-agent"))[0]; got != agentSum {
			t.Errorf("cycle %d: resumed sandbox's guest dir has agent %s, want %s", k, got, agentSum)
		}

		// Exec and files, through the old agent.
		out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
		if out != "out\n" || errb != "err\n" || code != 3 {
			t.Errorf("cycle %d: exec gave %q %q exit %d", k, out, errb, code)
		}
		if got := string(readFile(t, c, id, "/root/before.txt")); got != "written through the old agent\n" {
			t.Errorf("cycle %d: file written before the hibernate: %q", k, got)
		}
		data := []byte("written after resume " + strings.Repeat("x", k) + "\n")
		writeFile(t, c, id, "/root/after.txt", data)
		if got := sh(t, c, id, "cat /root/after.txt"); got != string(data) {
			t.Errorf("cycle %d: file written after the resume reads %q, want %q", k, got, data)
		}
		if rc, err := c.ReadFile(ctx, id, "/root/missing"); !client.IsNotFound(err) {
			if rc != nil {
				rc.Close()
			}
			t.Errorf("cycle %d: read of a missing file: %v, want not_found", k, err)
		}
		// E2B's envd is refused at once, with the reason, not forwarded to an
		// agent that does not serve it.
		t0 := time.Now()
		if conn, err := srv.Manager.DialAgent(ctx, id); !errors.Is(err, agentclient.ErrNoEnvd) || time.Since(t0) > 5*time.Second {
			if conn != nil {
				conn.Close()
			}
			t.Errorf("cycle %d: DialAgent for envd to the old agent: %v after %v, want ErrNoEnvd at once", k, err, time.Since(t0))
		}
		// A snapshot taken on this host still holds the old agent.
		h = hibernate(t, c, id)
	}

	// A new sandbox on the same server runs the current agent.
	fresh := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if v := agentVersion(t, srv, fresh.ID); v != proto.Version {
		t.Errorf("new sandbox's agent speaks protocol version %d, want %d", v, proto.Version)
	}
	if got := strings.Fields(sh(t, c, fresh.ID, "sha256sum /.torpor/torpor-agent"))[0]; got == agentSum {
		t.Errorf("new sandbox runs the old agent %s", got)
	}
	if conn, err := srv.Manager.DialAgent(ctx, fresh.ID); err != nil {
		t.Errorf("DialAgent for envd to the current agent: %v", err)
	} else {
		conn.Close()
	}
}
