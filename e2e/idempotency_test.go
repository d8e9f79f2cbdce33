package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
)

// serveProc is `torpor serve` as its own process on the shared data
// directory, so that a test can kill it (SIGKILL) as a crash would.
type serveProc struct {
	t    *testing.T
	bin  string
	addr string
	log  string
	cmd  *exec.Cmd
	done chan error
	up   bool // started and not yet seen to end
	// args are added to the command line; with tls the server is https
	// and trusted through the CA file ca.
	args []string
	ca   string
}

// url is the server's base URL.
func (p *serveProc) url() string {
	if p.ca != "" {
		return "https://" + p.addr
	}
	return "http://" + p.addr
}

// client is a Go client of the server.
func (p *serveProc) client() *client.Client {
	c := client.New(p.url())
	if p.ca != "" {
		if err := c.TrustCA(p.ca); err != nil {
			p.t.Fatal(err)
		}
	}
	return c
}

// buildTorpor builds the torpor binary of this checkout into a temporary
// directory.
func buildTorpor(t *testing.T) string { return goBuild(t, "./cmd/torpor") }

// goBuild builds the command pkg of this checkout (a path relative to its
// root) statically into a temporary directory and returns the binary's path.
func goBuild(t *testing.T, pkg string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", bin, pkg)
	cmd.Dir = servertest.Root()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v: %s", pkg, err, out)
	}
	return bin
}

// freeAddr returns a loopback address no one listens on now, on a port
// below the kernel's ephemeral range (32768 and up), so that no outgoing
// connection takes it while the server restarts.
func freeAddr(t *testing.T) string {
	t.Helper()
	for range 100 {
		addr := fmt.Sprintf("127.0.0.1:%d", 20000+rand.IntN(12000))
		if ln, err := net.Listen("tcp", addr); err == nil {
			ln.Close()
			return addr
		}
	}
	t.Fatal("no free port in 20000-31999")
	return ""
}

// start starts the server process with env added to its environment
// and waits until it answers /healthz. A start that finds its address still
// taken (by what, the log says: the sockets on the port are listed) is tried
// again for up to 15 s, so that a port's slow release is not a failure.
func (p *serveProc) start(env ...string) {
	t := p.t
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; {
		werr := p.startOnce(env)
		if werr == nil {
			return
		}
		text := p.logText()
		if !strings.HasSuffix(strings.TrimSpace(text), "address already in use") || time.Now().After(deadline) {
			t.Fatalf("torpor serve exited before it answered: %v\n%s", werr, text)
		}
		_, port, _ := net.SplitHostPort(p.addr)
		ss, _ := exec.Command("ss", "-tanpe", "( sport = :"+port+" )").CombinedOutput()
		t.Logf("torpor serve: %s still taken; sockets on the port:\n%s", p.addr, ss)
		time.Sleep(500 * time.Millisecond)
	}
}

// startOnce is one try of start: nil when the server answers, the
// process's exit when it ended first.
func (p *serveProc) startOnce(env []string) error {
	t := p.t
	t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(p.bin, "serve", "--data-dir", dataDir, "--listen", p.addr, "--auth", "none", "--store", "chunked",
		"--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t))
	p.cmd.Args = append(p.cmd.Args, p.args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	p.done = make(chan error, 1)
	p.up = true
	go func() { p.done <- p.cmd.Wait() }()
	c := p.client()
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Health(ctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case werr := <-p.done:
			p.up = false
			return werr
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("torpor serve does not answer: %v\n%s", err, p.logText())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitKilled waits for the process to end by SIGKILL.
func (p *serveProc) waitKilled() {
	t := p.t
	t.Helper()
	select {
	case err := <-p.done:
		p.up = false
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("torpor serve ended with %v, want killed by SIGKILL\n%s", err, p.logText())
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("torpor serve was not killed\n%s", p.logText())
	}
}

// stop ends the process with SIGTERM (a clean shutdown).
func (p *serveProc) stop() {
	if !p.up {
		return
	}
	p.up = false
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *serveProc) logText() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// restartAndDeleteAll restarts the server (without fault points), deletes
// every sandbox it has and stops it: a crash test's clean-up.
func (p *serveProc) restartAndDeleteAll() {
	p.stop()
	p.start()
	c := p.client()
	all, _ := c.ListSandboxes(context.Background())
	for _, s := range all {
		c.DeleteSandbox(context.Background(), s.ID)
	}
	p.stop()
}

// clonesOf returns the ids of the sandboxes forked from src, sorted.
func clonesOf(t *testing.T, c *client.Client, src string) []string {
	t.Helper()
	all, err := c.ListSandboxes(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range all {
		if s.ForkedFrom == src {
			out = append(out, s.ID)
		}
	}
	sort.Strings(out)
	return out
}

func sortedIDs(sbs []apiv1.Sandbox) []string {
	var out []string
	for _, s := range sbs {
		out = append(out, s.ID)
	}
	sort.Strings(out)
	return out
}

// TestIdempotentForkAcrossCrash: the server is killed (SIGKILL) in the three
// windows of an idempotent fork — after its key and clone ids are recorded
// but before any clone is made, after the clones' records are written but
// before any is restored (the restart leaves them in state error, to be
// resumed from the fork's snapshot by the retry), and after the clones are
// made and the answer's status recorded but before the answer is written.
// Each time the
// Go client's own retry (the same Idempotency-Key, sent while the server
// restarts) gets a set of clones, and that set is every clone of the
// source: never a second set, no clone whose id the client never saw.
func TestIdempotentForkAcrossCrash(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log")}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start()
	c := p.client()
	c.Retries = 8 // up to 64 s of waits: room for a restart
	ctx := ctxFor(t, 10*time.Minute)
	never := 0
	src, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
	if err != nil {
		t.Fatal(err)
	}
	defer p.restartAndDeleteAll()
	p.stop()

	var seen []string
	for _, point := range []string{"idempotency-claimed", "fork-clone-restored", "fork-clones-recorded", "idempotency-recorded"} {
		p.start("TORPOR_TEST_KILL_AT=" + point)
		type result struct {
			clones []apiv1.Sandbox
			err    error
		}
		got := make(chan result, 1)
		go func() {
			cl, err := c.Fork(ctx, src.ID, 2)
			got <- result{cl, err}
		}()
		p.waitKilled()
		t.Logf("server killed at %s", point)
		p.start() // the client's retry reaches this one
		var r result
		select {
		case r = <-got:
		case <-time.After(5 * time.Minute):
			t.Fatalf("kill at %s: the fork did not return", point)
		}
		if r.err != nil {
			t.Fatalf("kill at %s: fork: %v\n%s", point, r.err, p.logText())
		}
		answered := sortedIDs(r.clones)
		seen = append(seen, answered...)
		sort.Strings(seen)
		if all := clonesOf(t, c, src.ID); len(answered) != 2 || fmt.Sprint(all) != fmt.Sprint(seen) {
			t.Errorf("kill at %s: the fork answered %v; the source's clones are %v, want exactly those answered so far %v", point, answered, all, seen)
		}
		for _, cl := range r.clones {
			if st := get(t, c, cl.ID); st.State != apiv1.StateRunning {
				t.Errorf("kill at %s: clone %s in state %s (%s)", point, cl.ID, st.State, st.Error)
			}
		}
		// No instance of a clone the cut fork restored is left (Reconcile
		// stops what no running sandbox owns).
		if point == "fork-clone-restored" && !strings.Contains(p.logText(), "reconcile: stopping orphaned instance") {
			t.Errorf("kill at %s: the restart stopped no orphaned instance: the fork was cut before a clone's restore ended", point)
		}
		running := map[string]bool{src.ID: true}
		for _, id := range seen {
			running[id] = true
		}
		ids, err := runscList(t, dataDir)
		if err != nil {
			t.Fatal(err)
		}
		for _, inst := range ids {
			if i := strings.LastIndex(inst, "-"); strings.HasPrefix(inst, "sbx-") && i > 0 && !running[inst[:i]] {
				t.Errorf("kill at %s: instance %s of no running sandbox is left", point, inst)
			}
		}
		p.stop()
	}
	if !strings.Contains(p.logText(), "torpor serving") {
		t.Error("no server log")
	}

	// A retry with the key a caller chose, after the answer was cut, still
	// gets the same clones (the record is in the database).
	p.start("TORPOR_TEST_KILL_AT=idempotency-recorded")
	key := client.NewIdempotencyKey()
	req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/sandboxes/"+src.ID+"/fork", strings.NewReader(`{"count":1}`))
	req.Header.Set(apiv1.IdempotencyKeyHeader, key)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("fork answered %s though the server was to be killed before the answer", resp.Status)
	}
	p.waitKilled()
	p.start()
	first, err := c.Fork(client.WithIdempotencyKey(ctx, key), src.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Fork(client.WithIdempotencyKey(ctx, key), src.ID, 1)
	if err != nil || len(first) != 1 || len(again) != 1 || first[0].ID != again[0].ID {
		t.Errorf("two retries with one key: %v and %v (%v), want the same clone", sortedIDs(first), sortedIDs(again), err)
	}
	if all := clonesOf(t, c, src.ID); len(all) != len(seen)+1 {
		t.Errorf("clones after a retried fork of 1: %v, want %d", all, len(seen)+1)
	}
}

// TestIdempotentCreateAcrossCrash: the server is killed (SIGKILL) while an
// idempotent create makes its sandbox (its record written, its instance not
// started: the restart leaves it in state error, "create interrupted by
// server restart"). Two retries with the key, sent at once, both get 201 with
// one and the same sandbox, running and usable, under the recorded id; no
// other sandbox is made. (Before, the retry answered 201 with the sandbox in
// state error, which could not be resumed, and after its deletion the key
// answered 409.)
func TestIdempotentCreateAcrossCrash(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log")}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start("TORPOR_TEST_KILL_AT=create-recorded")
	c := p.client()
	ctx := ctxFor(t, 10*time.Minute)
	defer p.restartAndDeleteAll()
	before, err := c.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := client.NewIdempotencyKey()
	never := 0
	first := p.client()
	first.Retries = 0 // the call the kill cuts; the retries below are sent by hand
	if sb, err := first.CreateSandbox(client.WithIdempotencyKey(ctx, key), apiv1.CreateSandboxRequest{MemoryMiB: 128, IdleTimeoutS: &never}); err == nil {
		t.Fatalf("create answered %s though the server was to be killed while making it", sb.ID)
	}
	p.waitKilled()
	p.start()
	type result struct {
		sb  apiv1.Sandbox
		err error
	}
	got := make(chan result, 2)
	for range 2 {
		go func() {
			sb, err := c.CreateSandbox(client.WithIdempotencyKey(ctx, key), apiv1.CreateSandboxRequest{MemoryMiB: 128, IdleTimeoutS: &never})
			got <- result{sb, err}
		}()
	}
	var ids []string
	for range 2 {
		r := <-got
		if r.err != nil {
			t.Fatalf("retry of the cut create: %v\n%s", r.err, p.logText())
		}
		if r.sb.State != apiv1.StateRunning {
			t.Errorf("retry of the cut create: sandbox %s in state %s (%s), want running", r.sb.ID, r.sb.State, r.sb.Error)
		}
		ids = append(ids, r.sb.ID)
	}
	if ids[0] != ids[1] {
		t.Fatalf("two retries with one key got sandboxes %v, want one", ids)
	}
	if out := sh(t, c, ids[0], "echo usable"); out != "usable\n" {
		t.Errorf("exec in the retried create's sandbox: %q", out)
	}
	after, err := c.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before)+1 {
		t.Errorf("sandboxes after the cut create and its retries: %d, before %d: want one more", len(after), len(before))
	}
}
