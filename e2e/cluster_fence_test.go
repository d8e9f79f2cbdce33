package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/workload"
)

// TestClusterSelfFence: node cl-c reaches the database through a TCP proxy
// the test holds; its sandbox (hibernated once, resumed on it, then asked
// twice more) keeps running when the proxy is cut (connections dropped, new
// ones held unanswered). Within the lease time cl-c fences itself: it stops
// the sandbox's instance before the other nodes declare it lost (checked at
// every poll), and answers 503 with Retry-After for the sandbox and for
// /healthz (the others' /healthz: 200). The others then put the sandbox in
// error; resumed through cl-a it continues from its snapshot on another
// node. The proxy restored, cl-c heartbeats again, runs
// no instance, and serves the sandbox's calls again (forwarded to the new
// owner); it took its node lock again before that (a second server as
// cl-c is refused at start), and takes it again when only the lock's
// session is ended (pg_terminate_backend). A second, short cut (the
// database back as soon as the instance stopped): the sandbox ends in
// error with no owner either way (cl-c gives it up, or the others declared
// cl-c lost) and resumes from its snapshot. A third cut, during which a
// second server as cl-c takes the node's lock: cl-c, back on the database,
// answers no sandbox call and exits with status 1 naming the other
// server's lock; the other server is cl-c.
func TestClusterSelfFence(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	a, c := cl.nodes["cl-a"], cl.nodes["cl-c"]
	px := throughProxy(t, cl, c, a)
	id, before := workloadOn(t, ctx, c, a, 256, 16)
	hib := hibernate(t, c.c, id)
	if r, err := c.c.Resume(ctx, id); err != nil || r.Node != c.name {
		t.Fatalf("resume through %s: node %q %v; want %s (the snapshot's node, with room)", c.name, r.Node, err, c.name)
	}
	for range 2 { // what the snapshot does not hold
		if _, err := workload.Get(ctx, c.c, id, "/count"); err != nil {
			t.Fatal(err)
		}
	}
	if n := runscSandboxesOf(t, c.dir, id); n != 1 {
		t.Fatalf("%s runs %d instances of %s; want 1", c.name, n, id)
	}

	// Cut off: cl-c stops the instance before the others declare it lost.
	px.cut()
	cut := time.Now()
	stopped, lost := stoppedBeforeLost(t, ctx, a, c, id, cut, func() bool { return runscSandboxesOf(t, c.dir, id) == 0 })
	t.Logf("cut off: %s stopped its instance %v after the cut, declared lost by the others %v after it (self-fence after %v without a heartbeat, lease %v)",
		c.name, stopped.Sub(cut).Round(100*time.Millisecond), lost.Sub(cut).Round(100*time.Millisecond), node.SelfFenceAfter, node.LeaseTime)
	if d := stopped.Sub(cut); d > node.LeaseTime {
		t.Errorf("%s stopped its instance %v after the cut; want within the lease time %v", c.name, d, node.LeaseTime)
	}
	res := rawCall(t, http.MethodGet, c.proc.url+"/v1/sandboxes/"+id, "", nil)
	if res.Status != http.StatusServiceUnavailable || res.Header.Get("Retry-After") == "" || !strings.Contains(res.Err.Message, "fenced itself") {
		t.Errorf("GET the sandbox through the fenced %s: %d Retry-After %q %s; want 503 saying it fenced itself", c.name, res.Status, res.Header.Get("Retry-After"), res.Body)
	}
	// A load balancer's probe says so too (and /healthz of the others 200).
	if code, body, err := quickGet(c.proc.url + "/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "fenced itself") {
		t.Errorf("/healthz of the fenced %s: %d %s %v; want 503 saying it fenced itself", c.name, code, body, err)
	}
	if code, body, err := quickGet(a.proc.url + "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz of %s: %d %s %v; want 200", a.name, code, body, err)
	}
	if log, _ := os.ReadFile(c.log); !strings.Contains(string(log), "fencing this node") {
		t.Errorf("%s's log does not say it fenced itself", c.name)
	}

	// The others fence the sandbox; resumed, it continues from its snapshot.
	for {
		s := get(t, a.c, id)
		if s.State == apiv1.StateError {
			if s.Node != "" || !strings.Contains(s.Error, hib.Snapshot.ID) {
				t.Errorf("the cut-off node's sandbox: node %q error %q; want no node and snapshot %s named", s.Node, s.Error, hib.Snapshot.ID)
			}
			break
		}
		if time.Since(cut) > node.LeaseTime+4*node.HeartbeatInterval {
			t.Fatalf("%v after the cut %s is %s on %q", time.Since(cut).Round(time.Second), id, s.State, s.Node)
		}
		time.Sleep(250 * time.Millisecond)
	}
	back, err := a.c.Resume(ctx, id)
	if err != nil || back.Node == "" || back.Node == c.name {
		t.Fatalf("resume through cl-a after the cut: node %q %v; want another node than %s", back.Node, err, c.name)
	}
	cnt, err := workload.Get(ctx, a.c, id, "/count")
	if err != nil || cnt.Pid != before.Pid || cnt.Count != before.Count+1 {
		t.Fatalf("resumed on %s: %+v %v; want pid %d count %d (the snapshot's, plus this request)", back.Node, cnt, err, before.Pid, before.Count+1)
	}

	// The database back: cl-c heartbeats, runs nothing, serves again.
	px.restore()
	waitNodes(t, a.c, func(ns []apiv1.Node) bool { return stateOf(ns, c.name) == "active" })
	deadline := time.Now().Add(time.Minute)
	for {
		res = rawCall(t, http.MethodGet, c.proc.url+"/v1/sandboxes/"+id, "", nil)
		if res.Status == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after the database came back %s answers %d %s", c.name, res.Status, res.Body)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if n := runscSandboxesOf(t, c.dir, id); n != 0 {
		t.Errorf("%s back on the database runs %d instances of %s", c.name, n, id)
	}
	cnt, err = workload.Get(ctx, c.c, id, "/count") // forwarded to the owner
	if err != nil || cnt.Count != before.Count+2 {
		t.Fatalf("through %s after its return: %+v %v; want count %d", c.name, cnt, err, before.Count+2)
	}
	// It took its node lock again before serving: a second server as cl-c
	// is refused at start.
	if log, _ := os.ReadFile(c.log); !strings.Contains(string(log), "node lock taken again") {
		t.Errorf("%s's log does not say it took its node lock again", c.name)
	}
	refusedAsNode(t, cl.bin, cl.dbURL, c.name)
	// Its lock's session ended while it serves (no cut): it takes the lock
	// again on a new session.
	lockRetaken(t, ctx, cl.dbURL, c.name)
	refusedAsNode(t, cl.bin, cl.dbURL, c.name)

	// A short cut: the database back as soon as cl-c has stopped its
	// instance, likely before the others declare it lost. Either way cl-c
	// gives the sandbox up (error, no owner) before it serves again, and it
	// resumes from its snapshot.
	sb2 := create(t, c.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	t.Cleanup(func() { a.c.DeleteSandbox(context.Background(), sb2.ID) })
	if err := workload.Start(ctx, c.c, sb2.ID, 16); err != nil {
		t.Fatal(err)
	}
	before2, err := workload.Get(ctx, c.c, sb2.ID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	hib2 := hibernate(t, c.c, sb2.ID)
	if r, err := c.c.Resume(ctx, sb2.ID); err != nil || r.Node != c.name {
		t.Fatalf("resume through %s: node %q %v", c.name, r.Node, err)
	}
	px.cut()
	cut = time.Now()
	for runscSandboxesOf(t, c.dir, sb2.ID) != 0 {
		if time.Since(cut) > node.LeaseTime {
			t.Fatalf("%v after the second cut %s still runs %s", time.Since(cut).Round(time.Second), c.name, sb2.ID)
		}
		time.Sleep(250 * time.Millisecond)
	}
	px.restore()
	t.Logf("second cut: instance stopped after %v, database back", time.Since(cut).Round(100*time.Millisecond))
	for {
		s := get(t, a.c, sb2.ID)
		if s.State == apiv1.StateError && s.Node == "" {
			if !strings.Contains(s.Error, hib2.Snapshot.ID) || !(strings.Contains(s.Error, "fenced itself") || strings.Contains(s.Error, "lost")) {
				t.Errorf("after the short cut: error %q; want the fence or the loss and snapshot %s named", s.Error, hib2.Snapshot.ID)
			}
			t.Logf("after the short cut: %s", s.Error)
			break
		}
		if time.Since(cut) > 2*node.LeaseTime+time.Minute {
			t.Fatalf("%v after the short cut %s is %s on %q", time.Since(cut).Round(time.Second), sb2.ID, s.State, s.Node)
		}
		time.Sleep(250 * time.Millisecond)
	}
	waitNodes(t, a.c, func(ns []apiv1.Node) bool { return stateOf(ns, c.name) == "active" })
	if _, err := a.c.Resume(ctx, sb2.ID); err != nil {
		t.Fatal(err)
	}
	cnt, err = workload.Get(ctx, a.c, sb2.ID, "/count")
	if err != nil || cnt.Pid != before2.Pid || cnt.Count != before2.Count+1 {
		t.Fatalf("resumed after the short cut: %+v %v; want pid %d count %d", cnt, err, before2.Pid, before2.Count+1)
	}

	// A third cut, during which a second server as cl-c (straight to the
	// database, its own data directory) takes the node's lock: cl-c, back
	// on the database, must not serve as cl-c. It exits non-zero naming the
	// other server's lock, never answering a sandbox call meanwhile.
	px.cut()
	cut = time.Now()
	sandboxURL := c.proc.url + "/v1/sandboxes/" + id
	for {
		// Until it fences itself a call may wait on the database: a short
		// timeout each.
		code, body, err := quickGet(sandboxURL)
		if code == http.StatusServiceUnavailable && strings.Contains(body, "fenced itself") {
			break
		}
		if time.Since(cut) > node.LeaseTime {
			t.Fatalf("%v after the third cut %s answers %d %s %v; want 503 fenced", time.Since(cut).Round(time.Second), c.name, code, body, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	pg, err := postgres.Open(ctx, cl.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	for {
		pid, err := pg.ServerLockHolder(ctx, c.name)
		if err == nil && pid == 0 {
			break // the cut ended cl-c's lock session
		}
		if time.Since(cut) > 2*node.LeaseTime {
			t.Fatalf("%v after the third cut %s's lock is held by backend %d (%v)", time.Since(cut).Round(time.Second), c.name, pid, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	other := cl.add(c.name)
	cl.start(other)
	px.restore()
	restored := time.Now()
	var exit error
	for exited := false; !exited; {
		select {
		case exit = <-c.proc.done:
			c.proc.done, exited = nil, true
			continue
		case <-time.After(250 * time.Millisecond):
		}
		if code, body, err := quickGet(sandboxURL); err == nil && code != http.StatusServiceUnavailable {
			t.Fatalf("%s back on the database while another server holds its lock answers %d %s; want 503 until it exits", c.name, code, body)
		}
		if time.Since(restored) > 2*time.Minute {
			t.Fatalf("%s still runs 2 min after the database came back with another server holding its lock", c.name)
		}
	}
	var ee *exec.ExitError
	if !errors.As(exit, &ee) || ee.ExitCode() != 1 {
		t.Errorf("%s exited with %v; want exit status 1", c.name, exit)
	}
	log, _ := os.ReadFile(c.log)
	if !strings.Contains(string(log), "another torpor server uses this database as node "+c.name) || !strings.Contains(string(log), "two servers must not be one node") {
		t.Errorf("%s's log does not name the other server's lock", c.name)
	}
	t.Logf("third cut: %s exited %v after the database came back (%v): %s", c.name, time.Since(restored).Round(100*time.Millisecond), exit, lastLine(log))
	// The other server is cl-c now.
	waitNodes(t, a.c, func(ns []apiv1.Node) bool {
		for _, n := range ns {
			if n.Name == c.name {
				return n.State == "active" && n.Advertise == other.proc.url
			}
		}
		return false
	})
	if s := get(t, other.c, id); s.ID != id {
		t.Errorf("through the second %s: %+v", c.name, s)
	}
}

// lockRetaken ends the session that holds node name's server lock
// (pg_terminate_backend) and waits until the node's server holds the lock
// again on another session (within 30 s).
func lockRetaken(t *testing.T, ctx context.Context, dbURL, name string) {
	t.Helper()
	pg, err := postgres.Open(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	old, err := pg.ServerLockHolder(ctx, name)
	if err != nil || old == 0 {
		t.Fatalf("%s's lock: held by backend %d %v; want held", name, old, err)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend($1)`, old); err != nil {
		t.Fatal(err)
	}
	ended := time.Now()
	for {
		pid, err := pg.ServerLockHolder(ctx, name)
		if err == nil && pid != 0 && pid != old {
			t.Logf("%s's lock session %d ended: held again by %d after %v", name, old, pid, time.Since(ended).Round(10*time.Millisecond))
			return
		}
		if time.Since(ended) > 30*time.Second {
			t.Fatalf("30 s after its lock session %d ended %s's lock is held by %d (%v); want a new session", old, name, pid, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// quickGet GETs url with a 3 s timeout: its status and body.
func quickGet(url string) (int, string, error) {
	resp, err := (&http.Client{Timeout: 3 * time.Second}).Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// lastLine is the last non-empty line of b.
func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// stateOf is node name's state in ns ("" if it is not there).
func stateOf(ns []apiv1.Node, name string) string {
	for _, n := range ns {
		if n.Name == name {
			return n.State
		}
	}
	return ""
}

// workloadOn creates a sandbox of memMiB through node n (deleted through
// other when the test ends) running the workload with mib MiB of memory, and
// returns its id and the workload's first answer.
func workloadOn(t *testing.T, ctx context.Context, n, other *clusterNode, memMiB, mib int) (string, workload.State) {
	t.Helper()
	id := create(t, n.c, apiv1.CreateSandboxRequest{MemoryMiB: memMiB}).ID
	t.Cleanup(func() { other.c.DeleteSandbox(context.Background(), id) })
	if err := workload.Start(ctx, n.c, id, mib); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, n.c, id, "/count")
	if err != nil {
		t.Fatal(err)
	}
	return id, before
}

// throughProxy restarts node n on a PostgreSQL proxy (startPGProxy) that
// the test can cut, and waits until other (another node) sees it active.
func throughProxy(t *testing.T, cl *cluster, n, other *clusterNode) *pgProxy {
	t.Helper()
	px := startPGProxy(t, filepath.Join(cl.pg.Dir, ".s.PGSQL.5432"))
	u, err := url.Parse(cl.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	n.proc.stop(t)
	n.database = "postgres://torpor@" + px.addr() + u.Path
	cl.start(n)
	waitNodes(t, other.c, func(ns []apiv1.Node) bool { return stateOf(ns, n.name) == "active" })
	return px
}

// pgProxy is a loopback TCP proxy to a PostgreSQL unix socket that a test
// can cut: cut drops every connection and holds new ones unanswered (a
// network that lost the database), restore forwards new ones again.
type pgProxy struct {
	ln     net.Listener
	socket string
	mu     sync.Mutex
	cutoff bool
	conns  map[net.Conn]struct{}
}

// startPGProxy listens on a free loopback port; it is closed, with its
// connections, when the test ends.
func startPGProxy(t *testing.T, socket string) *pgProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pgProxy{ln: ln, socket: socket, conns: map[net.Conn]struct{}{}}
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.drop()
	})
	return p
}

func (p *pgProxy) addr() string { return p.ln.Addr().String() }

func (p *pgProxy) accept() {
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.conns[in] = struct{}{}
		held := p.cutoff
		p.mu.Unlock()
		if held {
			continue // never answered; closed by restore or drop
		}
		go func() {
			out, err := net.Dial("unix", p.socket)
			if err != nil {
				in.Close()
				return
			}
			p.mu.Lock()
			p.conns[out] = struct{}{}
			p.mu.Unlock()
			go func() { io.Copy(out, in); out.Close() }()
			io.Copy(in, out)
			in.Close()
		}()
	}
}

// drop closes every connection.
func (p *pgProxy) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

func (p *pgProxy) cut() {
	p.mu.Lock()
	p.cutoff = true
	p.mu.Unlock()
	p.drop()
}

func (p *pgProxy) restore() {
	p.mu.Lock()
	p.cutoff = false
	p.mu.Unlock()
	p.drop() // the held ones: their clients connect again
}
