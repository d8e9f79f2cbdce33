package e2e

// Hazards of a memory snapshot (docs/resume-contract.md, "What survives a resume"),
// reproduced in real sandboxes, with and without torpor's Python SDK
// (sdk/python, on sys.path in the default image through /.torpor/python):
//
//   - TestHazardUnnotifiedClone: three clones of a process that seeded `random`
//     draw the same 64 bits without the SDK; with `import torpor.resume` they
//     differ. uuid4 and os.urandom differ in both cases; generations differ.
//   - TestHazardStaleConnection: a pooled keep-alive http.client connection to a
//     host-side server with a 1 s idle timeout fails on its first request after a
//     3 s hibernation; one registered with register_connection succeeds at once.
//   - TestHazardClock: after a 5 s hibernation a token whose expiry passed meanwhile
//     is expired() and its Lease invalid, and the sandbox clock (plus
//     clock_offset_ns) is within 100 ms of the host's when the resume hook runs,
//     i.e. before any user request, and at the first command.
//   - TestHazardIntents: an intent begun before a hibernation and never completed
//     is pending() after resume with the same key; the retry with that key is
//     deduplicated by a host-side service (one effect); a clone of the same
//     snapshot has nothing pending (the intent was moved aside) and sends nothing.
//   - TestSDKGoInSandbox: the same contract through the Go SDK (e2e/testdata/goagent):
//     clones reseed a registered source, wipe a secret and move a pending intent
//     aside before the first request; a plain resume keeps both.
//
// The Python process in each test is hzEvalServer: a small HTTP server in the
// sandbox that runs the code POSTed to it in one persistent namespace and answers
// the value of `result` as JSON; requests reach it through the port proxy, which
// forwards them only after the resume contract (including the SDK's
// acknowledgement) has run.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/server/servertest"
)

const hzEvalServer = `import http.server, json, os, random, sys, traceback
port, use_sdk = int(sys.argv[1]), sys.argv[2] == "1"
G = {"__name__": "hz", "os": os, "random": random, "json": json}
if use_sdk:
    import torpor.resume as tr
    G["tr"] = tr
random.seed(12345)  # the state every clone inherits
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        code = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        G.pop("result", None)
        try:
            exec(code, G)
            body, status = json.dumps({"result": G.get("result")}), 200
        except Exception:
            body, status = json.dumps({"error": traceback.format_exc()}), 500
        b = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", port), H).serve_forever()
`

const (
	hzPortRaw = 8101 // eval server without the SDK
	hzPortSDK = 8102 // eval server with `import torpor.resume`
)

func hzCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// hzCreate creates a sandbox that never idles out during the test: neither
// hibernated nor paused (the paused tier's pause_after_s defaults to 5 s),
// so that only the test's own hibernates, resumes and forks restore it.
func hzCreate(t *testing.T, c *client.Client) apiv1.Sandbox {
	t.Helper()
	never := 0
	sb, err := c.CreateSandbox(hzCtx(t, 5*time.Minute), apiv1.CreateSandboxRequest{IdleTimeoutS: &never, PauseAfterS: &never})
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	return sb
}

// hzStartEval starts an eval server on port in sandbox id and waits until it
// answers; with the SDK it also waits until the agent confirmed the subscription.
func hzStartEval(t *testing.T, c *client.Client, id string, port int, sdk bool) {
	t.Helper()
	ctx := hzCtx(t, 2*time.Minute)
	if err := c.WriteFile(ctx, id, "/opt/hz/evalsrv.py", strings.NewReader(hzEvalServer)); err != nil {
		t.Fatalf("write eval server: %v", err)
	}
	flag := "0"
	if sdk {
		flag = "1"
	}
	if _, err := c.ExecBackground(ctx, id, apiv1.ExecRequest{Cmd: []string{"python3", "/opt/hz/evalsrv.py", strconv.Itoa(port), flag}}); err != nil {
		t.Fatalf("start eval server: %v", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		v, err := hzTryEval(ctx, c, id, port, "result = 1")
		if err == nil && string(v) == "1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("eval server on port %d in %s did not answer: %v", port, id, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !sdk {
		return
	}
	for {
		var st []any
		hzEval(t, c, id, port, "result = [tr.subscribed(), tr.generation()]", &st)
		if st[0] == true {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("torpor.resume in %s never subscribed (generation() = %v): does the agent serve /run/torpor/events?", id, st[1])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hzTryEval runs code in the eval server on port of sandbox id (through the port
// proxy) and returns the JSON of `result`.
func hzTryEval(ctx context.Context, c *client.Client, id string, port int, code string) (json.RawMessage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.PortURL(id, port, "/"), strings.NewReader(code))
	if err != nil {
		return nil, err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Result json.RawMessage `json:"result"`
		Error  string          `json:"error"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	if out.Error != "" {
		return nil, fmt.Errorf("python: %s", out.Error)
	}
	return out.Result, nil
}

func hzEval(t *testing.T, c *client.Client, id string, port int, code string, out any) {
	t.Helper()
	v, err := hzTryEval(hzCtx(t, 2*time.Minute), c, id, port, code)
	if err != nil {
		t.Fatalf("eval in %s:%d: %v\ncode:\n%s", id, port, err, code)
	}
	if out != nil {
		if err := json.Unmarshal(v, out); err != nil {
			t.Fatalf("eval in %s:%d: result %s: %v", id, port, v, err)
		}
	}
}

func hzHibernate(t *testing.T, c *client.Client, id string) apiv1.Sandbox {
	t.Helper()
	sb, err := c.Hibernate(hzCtx(t, 2*time.Minute), id)
	if err != nil {
		t.Fatalf("hibernate %s: %v", id, err)
	}
	return sb
}

func hzResume(t *testing.T, c *client.Client, id string) apiv1.Sandbox {
	t.Helper()
	sb, err := c.Resume(hzCtx(t, 2*time.Minute), id)
	if err != nil {
		t.Fatalf("resume %s: %v", id, err)
	}
	if sb.State != apiv1.StateRunning {
		t.Fatalf("resumed %s is %q (%s)", id, sb.State, sb.Error)
	}
	return sb
}

// hzHost is a test server on the host side of sandboxes' networks, reachable
// from inside at 10.213.0.1:port. Every engine instance has its own network
// namespace (a resume or fork makes a new one), so serveIn must be called for
// each instance that should reach it; all listeners share one port and handler.
type hzHost struct {
	t       *testing.T
	srv     *servertest.Server
	handler http.Handler
	idle    time.Duration
	port    int
	mu      sync.Mutex
	servers []*http.Server
}

func newHzHost(t *testing.T, srv *servertest.Server, idle time.Duration, h http.Handler) *hzHost {
	x := &hzHost{t: t, srv: srv, handler: h, idle: idle}
	t.Cleanup(func() {
		x.mu.Lock()
		defer x.mu.Unlock()
		for _, s := range x.servers {
			s.Close()
		}
	})
	return x
}

// hzInstance returns the running engine instance of sandbox id.
func hzInstance(t *testing.T, srv *servertest.Server, id string) string {
	t.Helper()
	infos, err := srv.Engine.List(hzCtx(t, time.Minute))
	if err != nil {
		t.Fatalf("engine list: %v", err)
	}
	for _, i := range infos {
		if i.Running && strings.HasPrefix(i.ID, id+"-") {
			return i.ID
		}
	}
	t.Fatalf("no running instance of %s", id)
	return ""
}

// serveIn starts serving in the network namespace of sandbox id's current instance.
func (x *hzHost) serveIn(id string) {
	x.t.Helper()
	inst := hzInstance(x.t, x.srv, id)
	var ln net.Listener
	gv, ok := x.srv.Engine.(interface{ HostNetns(string) sandboxnet.Pair }) // gVisor's
	if !ok {
		x.t.Fatalf("engine %s has no host network namespace", x.srv.Engine.Name())
	}
	err := gv.HostNetns(inst).RunIn(func() error {
		var err error
		ln, err = net.Listen("tcp", net.JoinHostPort(sandboxnet.HostIP, strconv.Itoa(x.port)))
		return err
	})
	if err != nil {
		x.t.Fatalf("listen in the host netns of %s: %v", inst, err)
	}
	if x.port == 0 {
		x.port = ln.Addr().(*net.TCPAddr).Port
	}
	hs := &http.Server{Handler: x.handler, IdleTimeout: x.idle}
	x.mu.Lock()
	x.servers = append(x.servers, hs)
	x.mu.Unlock()
	go hs.Serve(ln)
}

// TestHazardUnnotifiedClone: random state is duplicated into clones unless the
// SDK reseeds it; kernel randomness is not.
func TestHazardUnnotifiedClone(t *testing.T) {
	srv := servertest.Start(t, servertest.Options{})
	c := srv.Client
	src := hzCreate(t, c)
	hzStartEval(t, c, src.ID, hzPortRaw, false)
	hzStartEval(t, c, src.ID, hzPortSDK, true)
	srcGen := src.Generation

	clones, err := c.Fork(hzCtx(t, 5*time.Minute), src.ID, 3)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if len(clones) != 3 {
		t.Fatalf("fork answered %d clones", len(clones))
	}
	const draw = `import uuid
result = ["%016x" % random.getrandbits(64), str(uuid.uuid4()), os.urandom(8).hex()]`
	type drawn struct{ bits, uuid, urandom map[string]bool }
	newDrawn := func() drawn { return drawn{map[string]bool{}, map[string]bool{}, map[string]bool{}} }
	raw, sdk := newDrawn(), newDrawn()
	gens := map[int64]bool{srcGen: true}
	for _, cl := range clones {
		if gens[cl.Generation] {
			t.Errorf("clone %s has generation %d, not unique", cl.ID, cl.Generation)
		}
		gens[cl.Generation] = true
		for _, x := range []struct {
			port int
			d    drawn
		}{{hzPortRaw, raw}, {hzPortSDK, sdk}} {
			var v []string
			hzEval(t, c, cl.ID, x.port, draw, &v)
			t.Logf("clone %s (generation %d) port %d: random %s uuid4 %s urandom %s", cl.ID, cl.Generation, x.port, v[0], v[1], v[2])
			x.d.bits[v[0]], x.d.uuid[v[1]], x.d.urandom[v[2]] = true, true, true
		}
		// The SDK's process had handled this clone's event before our request
		// reached it, and sees the clone's generation.
		var st []any
		hzEval(t, c, cl.ID, hzPortSDK, fmt.Sprintf(`ev = tr.wait_for_resume(0, after=%d)
result = [ev and ev.generation, ev and ev.forked, tr.generation()]`, srcGen), &st)
		if st[0] != float64(cl.Generation) || st[1] != true || st[2] != float64(cl.Generation) {
			t.Errorf("clone %s: SDK saw [handled generation, forked, generation()] = %v, want [%d true %d]", cl.ID, st, cl.Generation, cl.Generation)
		}
	}
	// The hazard: without a notification, every clone draws the same bits.
	if len(raw.bits) != 1 {
		t.Errorf("without the SDK the clones drew %d different values; the hazard (identical draws) did not reproduce: %v", len(raw.bits), raw.bits)
	}
	if len(sdk.bits) != 3 {
		t.Errorf("with torpor.resume the clones drew %d different values, want 3: %v", len(sdk.bits), sdk.bits)
	}
	for name, d := range map[string]drawn{"without SDK": raw, "with SDK": sdk} {
		if len(d.uuid) != 3 || len(d.urandom) != 3 {
			t.Errorf("%s: uuid4 values %d, urandom values %d across 3 clones, want 3 each", name, len(d.uuid), len(d.urandom))
		}
	}
}

// TestHazardStaleConnection: a keep-alive connection idle across a hibernation
// is dead; the SDK closes registered ones on resume so the next request dials.
func TestHazardStaleConnection(t *testing.T) {
	srv := servertest.Start(t, servertest.Options{})
	c := srv.Client
	sb := hzCreate(t, c)
	var mu sync.Mutex
	n := 0
	host := newHzHost(t, srv, time.Second, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		v := n
		mu.Unlock()
		fmt.Fprintf(w, "pong:%d", v)
	}))
	host.serveIn(sb.ID)
	hzStartEval(t, c, sb.ID, hzPortSDK, true)

	var before []any
	hzEval(t, c, sb.ID, hzPortSDK, fmt.Sprintf(`import http.client
raw = http.client.HTTPConnection("%[1]s", %[2]d, timeout=5)
managed = tr.register_connection(http.client.HTTPConnection("%[1]s", %[2]d, timeout=5))
def get(c):
    c.request("GET", "/ping")
    r = c.getresponse()
    return r.read().decode()
def first_try(c):
    try:
        return ["ok", get(c)]
    except Exception as e:
        return ["error", repr(e)]
result = [get(raw), get(managed), raw.sock is not None, managed.sock is not None]`, sandboxnet.HostIP, host.port), &before)
	if before[2] != true || before[3] != true {
		t.Fatalf("connections not kept alive before hibernation: %v", before)
	}
	hzHibernate(t, c, sb.ID)
	time.Sleep(3 * time.Second) // > the server's 1 s idle timeout
	hzResume(t, c, sb.ID)
	host.serveIn(sb.ID) // the resumed instance has a new host-side namespace

	var after [][]string
	hzEval(t, c, sb.ID, hzPortSDK, `result = [first_try(raw), first_try(managed)]`, &after)
	t.Logf("first request after resume: raw %v, SDK-managed %v", after[0], after[1])
	if after[0][0] != "error" {
		t.Errorf("the raw pooled connection's first request after resume succeeded (%v); the stale-connection hazard did not reproduce", after[0])
	}
	if after[1][0] != "ok" || !strings.HasPrefix(after[1][1], "pong:") {
		t.Errorf("the SDK-managed connection's first request after resume failed: %v", after[1])
	}
}

// TestHazardClock: expiries computed before a hibernation are judged on a
// corrected clock after it, and the clock is right before any user request.
func TestHazardClock(t *testing.T) {
	srv := servertest.Start(t, servertest.Options{})
	c := srv.Client
	sb := hzCreate(t, c)
	hzStartEval(t, c, sb.ID, hzPortSDK, true)
	var before []bool
	hzEval(t, c, sb.ID, hzPortSDK, `import time
hook_log = []
@tr.on_resume
def record(ev):
    hook_log.append({"sandbox_ns": time.time_ns(), "offset_ns": tr.clock_offset_ns(), "host_time": ev.raw.get("host_time")})
token_expiry = tr.expiry_in(2.0)   # e.g. an access token valid for 2 more seconds
lease = tr.Lease(ttl=2.0)
result = [tr.expired(token_expiry), lease.valid()]`, &before)
	if before[0] || !before[1] {
		t.Fatalf("before hibernation: expired %v, lease valid %v", before[0], before[1])
	}
	hzHibernate(t, c, sb.ID)
	time.Sleep(5 * time.Second)
	hzResume(t, c, sb.ID)

	// The first user command: the sandbox's corrected clock against the host's.
	t0 := time.Now()
	out, _, code, err := c.ExecCollect(hzCtx(t, time.Minute), sb.ID, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "date +%s%N; cat /run/torpor/clock_offset_ns 2>/dev/null || echo 0"}})
	t1 := time.Now()
	if err != nil || code != 0 {
		t.Fatalf("date: %v exit %d", err, code)
	}
	f := strings.Fields(string(out))
	sandboxNS, _ := strconv.ParseInt(f[0], 10, 64)
	offsetNS, _ := strconv.ParseInt(f[1], 10, 64)
	corrected := time.Unix(0, sandboxNS+offsetNS)
	t.Logf("first command: sandbox clock %v + offset %v; host between %v and %v (exec took %v)",
		time.Unix(0, sandboxNS).UTC().Format(time.RFC3339Nano), time.Duration(offsetNS), t0.UTC().Format(time.RFC3339Nano), t1.UTC().Format(time.RFC3339Nano), t1.Sub(t0))
	if corrected.Before(t0.Add(-100*time.Millisecond)) || corrected.After(t1.Add(100*time.Millisecond)) {
		t.Errorf("sandbox clock at the first command is off: corrected %v, host %v..%v", corrected, t0, t1)
	}

	var res struct {
		Expired    bool    `json:"expired"`
		LeaseValid bool    `json:"lease_valid"`
		Remaining  float64 `json:"remaining"`
		Hook       *struct {
			SandboxNS int64  `json:"sandbox_ns"`
			OffsetNS  int64  `json:"offset_ns"`
			HostTime  string `json:"host_time"`
		} `json:"hook"`
	}
	hzEval(t, c, sb.ID, hzPortSDK, `result = {"expired": tr.expired(token_expiry), "lease_valid": lease.valid(), "remaining": lease.remaining(), "hook": hook_log[-1] if hook_log else None}`, &res)
	if !res.Expired || res.LeaseValid || res.Remaining > -2 {
		t.Errorf("after a 5 s hibernation: token expired %v, lease valid %v, remaining %.3fs; want expired, invalid, <= -2 s", res.Expired, res.LeaseValid, res.Remaining)
	}
	if res.Hook == nil {
		t.Fatal("the resume hook did not run")
	}
	host, err := time.Parse(time.RFC3339Nano, res.Hook.HostTime)
	if err != nil {
		t.Fatalf("event host_time %q: %v", res.Hook.HostTime, err)
	}
	skew := time.Unix(0, res.Hook.SandboxNS+res.Hook.OffsetNS).Sub(host)
	t.Logf("in the resume hook (before any user request): corrected sandbox clock - event host_time = %v (offset %v)", skew, time.Duration(res.Hook.OffsetNS))
	if skew < -100*time.Millisecond || skew > 100*time.Millisecond {
		t.Errorf("sandbox clock in the resume hook is %v off the host's", skew)
	}
}

// TestHazardIntents: reconcile-and-retry with the journaled key gives one
// effect; a clone of the same snapshot retries nothing.
func TestHazardIntents(t *testing.T) {
	srv := servertest.Start(t, servertest.Options{})
	c := srv.Client
	sb := hzCreate(t, c)
	var mu sync.Mutex
	requests := 0
	effects := map[string]int{} // key -> times seen
	host := newHzHost(t, srv, 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		requests++
		effects[key]++
		first := effects[key] == 1
		mu.Unlock()
		if first {
			fmt.Fprint(w, "created")
		} else {
			fmt.Fprint(w, "duplicate")
		}
	}))
	counts := func() (int, int) {
		mu.Lock()
		defer mu.Unlock()
		return requests, len(effects)
	}
	host.serveIn(sb.ID)
	hzStartEval(t, c, sb.ID, hzPortSDK, true)

	var began struct {
		Key   string `json:"key"`
		First []any  `json:"first"`
	}
	hzEval(t, c, sb.ID, hzPortSDK, fmt.Sprintf(`import http.client
def call(key):
    c = http.client.HTTPConnection("%s", %d, timeout=5)
    c.request("POST", "/effect", body=b"{}", headers={"Idempotency-Key": key})
    r = c.getresponse()
    body = r.read().decode()
    c.close()
    return [r.status, body]
j = tr.Journal("/root/intents.jsonl")
key = j.begin("create_pr", {"title": "fix"})
first = call(key)   # the effect happens; the outcome is never recorded: hibernated now
result = {"key": key, "first": first}`, sandboxnet.HostIP, host.port), &began)
	if !strings.HasPrefix(began.Key, "idem-") || began.First[1] != "created" {
		t.Fatalf("begin: %+v", began)
	}
	hzHibernate(t, c, sb.ID)
	clones, err := c.Fork(hzCtx(t, 5*time.Minute), sb.ID, 1) // a second life of the same snapshot
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	clone := clones[0]
	host.serveIn(clone.ID)
	resumed := hzResume(t, c, sb.ID)
	host.serveIn(sb.ID)

	const reconcile = `out = {"pending": [i.key for i in j.pending()], "retried": []}
for i in j.pending():
    st = call(i.key)
    j.complete(i.key, st)
    out["retried"].append([i.key, st[1]])
out["after"] = [i.key for i in j.pending()]
result = out`
	type recon struct {
		Pending []string   `json:"pending"`
		Retried [][]string `json:"retried"`
		After   []string   `json:"after"`
	}
	var orig recon
	hzEval(t, c, sb.ID, hzPortSDK, reconcile, &orig)
	t.Logf("original (generation %d): %+v", resumed.Generation, orig)
	if len(orig.Pending) != 1 || orig.Pending[0] != began.Key {
		t.Errorf("original: pending %v, want [%s]", orig.Pending, began.Key)
	}
	if len(orig.Retried) != 1 || orig.Retried[0][0] != began.Key || orig.Retried[0][1] != "duplicate" || len(orig.After) != 0 {
		t.Errorf("original: retried %v, pending after %v", orig.Retried, orig.After)
	}
	var cl recon
	hzEval(t, c, clone.ID, hzPortSDK, reconcile, &cl)
	var aside string
	hzEval(t, c, clone.ID, hzPortSDK, fmt.Sprintf(`result = open("/root/intents.jsonl.forked-%d").read()`, clone.Generation), &aside)
	t.Logf("clone (generation %d): %+v; moved aside: %s", clone.Generation, cl, strings.TrimSpace(aside))
	if len(cl.Pending) != 0 || len(cl.Retried) != 0 {
		t.Errorf("clone: pending %v, retried %v; want nothing", cl.Pending, cl.Retried)
	}
	if !strings.Contains(aside, began.Key) {
		t.Errorf("clone: %s not in the moved-aside file: %q", began.Key, aside)
	}
	if req, uniq := counts(); req != 2 || uniq != 1 {
		t.Errorf("host service saw %d requests with %d distinct keys; want 2 requests (the call and the retry) and 1 effect", req, uniq)
	}
}

// hzGoAgentState is GET /state of e2e/testdata/goagent.
type hzGoAgentState struct {
	Subscribed     bool     `json:"subscribed"`
	Generation     int64    `json:"generation"`
	HookGeneration int64    `json:"hook_generation"`
	HookForked     bool     `json:"hook_forked"`
	Draw           uint64   `json:"draw"`
	Secret         string   `json:"secret"`
	Pending        []string `json:"pending"`
}

func hzGoState(ctx context.Context, c *client.Client, id string, port int) (hzGoAgentState, error) {
	var st hzGoAgentState
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.PortURL(id, port, "/state"), nil)
	if err != nil {
		return st, err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// hzStartGoAgent builds e2e/testdata/goagent, starts it in sandbox id on
// port and waits until it answers, subscribed to resume events.
func hzStartGoAgent(t *testing.T, c *client.Client, id string, port int) hzGoAgentState {
	t.Helper()
	ctx := hzCtx(t, 5*time.Minute)
	bin := goBuild(t, "./e2e/testdata/goagent")
	f, err := os.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := c.WriteFile(ctx, id, "/opt/hz/goagent", f); err != nil {
		t.Fatalf("copy goagent: %v", err)
	}
	cmd := fmt.Sprintf("chmod +x /opt/hz/goagent && exec /opt/hz/goagent %d", port)
	if _, err := c.ExecBackground(ctx, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", cmd}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := hzGoState(ctx, c, id, port)
		if err == nil && st.Subscribed {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("goagent not up and subscribed: %+v %v", st, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hzCheckGoClones checks the goagent (hzStartGoAgent) in each fork clone:
// its hooks ran before the first request with the clone's generation and
// forked, its secret is wiped, its pending intent set aside, and no two
// clones drew the same value from the registered random source.
func hzCheckGoClones(t *testing.T, c *client.Client, clones []apiv1.Sandbox, port int) {
	t.Helper()
	ctx := hzCtx(t, 2*time.Minute)
	draws := map[uint64]bool{}
	for _, cl := range clones {
		cs, err := hzGoState(ctx, c, cl.ID, port)
		if err != nil {
			t.Fatalf("clone %s: %v", cl.ID, err)
		}
		t.Logf("clone %s: %+v", cl.ID, cs)
		draws[cs.Draw] = true
		if cs.Generation != cl.Generation || cs.HookGeneration != cl.Generation || !cs.HookForked {
			t.Errorf("clone %s: generation %d, hook saw %d forked %v; want %d, forked", cl.ID, cs.Generation, cs.HookGeneration, cs.HookForked, cl.Generation)
		}
		if cs.Secret != "" || len(cs.Pending) != 0 {
			t.Errorf("clone %s: secret %q, pending %v; want wiped, none", cl.ID, cs.Secret, cs.Pending)
		}
	}
	if len(draws) != len(clones) {
		t.Errorf("the %d clones drew the same value from the registered source: %v", len(clones), draws)
	}
}

// TestSDKGoInSandbox runs a Go program built on sdk/go/resume in a sandbox:
// after a fork every clone's hooks ran before the first request (its registered
// source reseeded, its secret wiped, its pending intent moved aside), and after
// a plain hibernate/resume of the source the hooks ran without the fork steps.
func TestSDKGoInSandbox(t *testing.T) {
	srv := servertest.Start(t, servertest.Options{})
	c := srv.Client
	ctx := hzCtx(t, 5*time.Minute)
	sb := hzCreate(t, c)
	const port = 8103
	st := hzStartGoAgent(t, c, sb.ID, port)
	if st.Secret != "s3cret" || len(st.Pending) != 1 {
		t.Fatalf("goagent initial state %+v", st)
	}
	key := st.Pending[0]

	clones, err := c.Fork(ctx, sb.ID, 2)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	hzCheckGoClones(t, c, clones, port)

	hzHibernate(t, c, sb.ID)
	resumed := hzResume(t, c, sb.ID)
	rs, err := hzGoState(ctx, c, sb.ID, port)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("source after resume: %+v", rs)
	if rs.HookGeneration != resumed.Generation || rs.HookForked || rs.Secret != "s3cret" || len(rs.Pending) != 1 || rs.Pending[0] != key {
		t.Errorf("source after resume: %+v; want hook generation %d not forked, secret kept, pending [%s]", rs, resumed.Generation, key)
	}
}
