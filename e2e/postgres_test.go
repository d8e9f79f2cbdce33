package e2e

import (
	"context"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// serveProcess is a `torpor serve` process started by a test.
type serveProcess struct {
	cmd  *exec.Cmd
	done chan error
	url  string
	log  string
}

// serve starts `bin serve args…` on a free loopback port (its log in
// logPath) and waits until /healthz answers; it fails the test if the
// process exits first.
func serve(t *testing.T, bin, logPath string, args ...string) *serveProcess {
	t.Helper()
	return serveEnv(t, bin, logPath, nil, args...)
}

// serveEnv is serve with env (KEY=VALUE) added to the server's environment.
func serveEnv(t *testing.T, bin, logPath string, env []string, args ...string) *serveProcess {
	t.Helper()
	addr := freeAddr(t)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(bin, append([]string{"serve", "--listen", addr, "--auth", "none"}, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &serveProcess{cmd: cmd, done: make(chan error, 1), url: "http://" + addr, log: logPath}
	go func() { p.done <- cmd.Wait() }()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		if resp, err := http.Get(p.url + "/healthz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		select {
		case err := <-p.done:
			log, _ := os.ReadFile(logPath)
			t.Fatalf("torpor serve %s exited at start (%v):\n%s", strings.Join(args, " "), err, log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.stop(t)
			t.Fatalf("torpor serve does not answer on %s", p.url)
		}
	}
}

// refusedAsNode checks that a server started as node name on database
// dbURL (another data directory) is refused at start because another
// server holds the node's lock: it exits non-zero, within 3 min, with
// postgres.ErrLocked's message.
func refusedAsNode(t *testing.T, bin, dbURL, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	other := exec.CommandContext(ctx, bin, "serve", "--listen", freeAddr(t), "--auth", "none", "--database", dbURL, "--node", name,
		"--data-dir", dir, "--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t))
	out, err := other.CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "another torpor server uses this database as node "+name) {
		t.Errorf("a second server as node %s on the database: %v (not refused at start if killed)\n%s", name, err, out)
	}
	removeDataDir(dir)
}

// stop stops the server as an operator would (SIGTERM) and waits for it.
func (p *serveProcess) stop(t *testing.T) {
	t.Helper()
	if p.done == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		t.Errorf("torpor serve %d did not stop in 60 s after SIGTERM: killed", p.cmd.Process.Pid)
		p.cmd.Process.Kill()
		<-p.done
	}
	p.done = nil
}

// TestServePostgres: `torpor serve --database postgres://…` keeps its
// records in PostgreSQL (a private cluster): a sandbox made, exec'd and
// hibernated there is hibernated in the database, not in a SQLite file; a
// second server on the same database as the same node is refused at start; after a restart
// of the server the sandbox is reported hibernated and resumes with its
// process continuing and its file intact, and the list reports true states.
// The server is a node in the database (torpor node ls): active with its
// load; restarted under another name, the first name turns lost once its
// lease has passed. The offline snapshot commands read its data directory.
func TestServePostgres(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cluster := pgtest.Start(t)
	dbURL := cluster.NewDatabase(t)
	bin := buildTorpor(t)
	dir, err := os.MkdirTemp("", "torpor-e2e-pg-")
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(t.TempDir(), "serve.log")
	args := []string{"--database", dbURL, "--data-dir", dir, "--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t)}
	srv := serve(t, bin, logPath, append(args, "--node", "pg-a")...)
	var ids []string
	t.Cleanup(func() {
		if srv.done != nil {
			c := client.New(srv.url)
			for _, id := range ids {
				if err := c.DeleteSandbox(context.Background(), id); err != nil && !client.IsNotFound(err) {
					t.Errorf("delete %s: %v", id, err)
				}
			}
			srv.stop(t)
		}
		removeDataDir(dir)
		if t.Failed() {
			log, _ := os.ReadFile(logPath)
			t.Logf("torpor serve's log:\n%s", log)
		}
	})
	c := client.New(srv.url)

	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	ids = append(ids, sb.ID)
	if got := sh(t, c, sb.ID, "echo hello from $(hostname) > /root/note && cat /root/note"); !strings.HasPrefix(got, "hello from") {
		t.Fatalf("exec: %q", got)
	}
	note := readFile(t, c, sb.ID, "/root/note")
	if err := workload.Start(ctx, c, sb.ID, 8); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c, sb.ID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	// The server is node pg-a in the database: active, and its load counts
	// the sandbox once a heartbeat has passed.
	waitNodes(t, c, func(ns []apiv1.Node) bool {
		return len(ns) == 1 && ns[0].Name == "pg-a" && ns[0].Self && ns[0].State == "active" &&
			ns[0].Load == apiv1.NodeResources{MemoryMiB: 256, CPUs: sb.CPUs, Sandboxes: 1} && ns[0].Advertise == srv.url
	})
	if out, err := exec.Command(bin, "node", "ls", "--url", srv.url).CombinedOutput(); err != nil ||
		!strings.Contains(string(out), "pg-a *") || !strings.Contains(string(out), "active") || !strings.Contains(string(out), "1/") {
		t.Errorf("torpor node ls: %v\n%s", err, out)
	}
	hib := hibernate(t, c, sb.ID)

	// The record is PostgreSQL's: hibernated there with its snapshot, and no
	// SQLite database was made.
	db, err := postgres.Open(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := db.GetSandbox(ctx, sb.ID)
	db.Close()
	if err != nil || rec.State != sandbox.StateHibernated || rec.SnapshotID != hib.Snapshot.ID {
		t.Fatalf("record in PostgreSQL: %+v %v, want hibernated from snapshot %s", rec, err, hib.Snapshot.ID)
	}
	if _, err := os.Stat(filepath.Join(dir, "torpor.db")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a server on PostgreSQL made %s/torpor.db (%v)", dir, err)
	}
	// The offline snapshot commands know the data directory without it.
	if out, err := exec.Command(bin, "snapshot", "ls", "--data-dir", dir).CombinedOutput(); err != nil || !strings.Contains(string(out), hib.Snapshot.ID) {
		t.Errorf("torpor snapshot ls --data-dir (offline): %v\n%s", err, out)
	}

	// A second server on the same database as the same node (another data
	// directory) is refused: it would take the first one's sandboxes for
	// its own. (Servers with other names are other nodes: TestCluster.)
	refusedAsNode(t, bin, dbURL, "pg-a")

	srv.stop(t)
	srv = serve(t, bin, logPath, append(args, "--node", "pg-b")...)
	c = client.New(srv.url)
	stoppedAt := time.Now()
	wantState(t, c, sb.ID, apiv1.StateHibernated)
	list, err := c.ListSandboxes(ctx)
	if err != nil || len(list) != 1 || list[0].ID != sb.ID || list[0].State != apiv1.StateHibernated {
		t.Fatalf("list after restart: %+v %v", list, err)
	}
	st, err := workload.Get(ctx, c, sb.ID, "/count")
	if err != nil {
		t.Fatalf("GET /count after restart: %v", err)
	}
	if st.Count != before.Count+1 || st.Pid != before.Pid {
		t.Errorf("after restart and resume: count %d pid %d, want count %d pid %d", st.Count, st.Pid, before.Count+1, before.Pid)
	}
	got := wantState(t, c, sb.ID, apiv1.StateRunning)
	if got.Generation <= sb.Generation {
		t.Errorf("generation after resume %d, want above %d", got.Generation, sb.Generation)
	}
	if again := readFile(t, c, sb.ID, "/root/note"); string(again) != string(note) {
		t.Errorf("file after restart and resume: %q, want %q", again, note)
	}
	if got := sh(t, c, sb.ID, "cat /root/note"); got != string(note) {
		t.Errorf("exec after resume: %q", got)
	}
	list, err = c.ListSandboxes(ctx)
	if err != nil || len(list) != 1 || list[0].State != apiv1.StateRunning {
		t.Errorf("list after resume: %+v %v", list, err)
	}

	// pg-a, stopped, no longer heartbeats: lost once the lease has passed;
	// pg-b is active and answers.
	waitNodes(t, c, func(ns []apiv1.Node) bool {
		return len(ns) == 2 && ns[0].Name == "pg-a" && !ns[0].Self && ns[1].Name == "pg-b" && ns[1].Self &&
			ns[1].State == "active" && ns[0].State == "lost"
	})
	if d := time.Since(stoppedAt); d < node.LeaseTime-node.HeartbeatInterval {
		t.Errorf("pg-a lost %v after it stopped, before its lease of %v", d, node.LeaseTime)
	}

	// node rm: an active node's record is refused (409), an unknown one is
	// 404, the lost pg-a's goes.
	if out, err := runTorpor(bin, "--url", srv.url, "node", "rm", "pg-b"); err == nil || !strings.Contains(out, "pg-b is active") {
		t.Errorf("node rm of the active node: %v\n%s", err, out)
	}
	if err := c.DeleteNode(ctx, "pg-none"); !client.IsNotFound(err) {
		t.Errorf("DELETE of an unknown node: %v, want 404", err)
	}
	if out, err := runTorpor(bin, "--url", srv.url, "node", "rm", "pg-a"); err != nil || !strings.Contains(out, "pg-a: removed") {
		t.Errorf("node rm of the lost node: %v\n%s", err, out)
	}
	if ns, err := c.ListNodes(ctx); err != nil || len(ns) != 1 || ns[0].Name != "pg-b" {
		t.Errorf("nodes after node rm pg-a: %+v %v, want pg-b alone", ns, err)
	}
}

// waitNodes polls GET /v1/nodes until ok says yes, for up to twice the
// lease time.
func waitNodes(t *testing.T, c *client.Client, ok func([]apiv1.Node) bool) {
	t.Helper()
	deadline := time.Now().Add(2 * node.LeaseTime)
	for {
		ns, err := c.ListNodes(context.Background())
		if err == nil && ok(ns) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nodes: %+v %v", ns, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
