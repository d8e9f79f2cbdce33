package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// dataDir is shared by every test of the package (see doc.go): the base image is
// built into it once.
var dataDir string

func TestMain(m *testing.M) {
	d, err := os.MkdirTemp("", "torpor-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	dataDir = d
	code := m.Run()
	removeDataDir(d)
	os.Exit(code)
}

// removeDataDir removes a data directory whose servers have stopped and
// whose sandboxes are gone, with what the engine left on the host for it.
func removeDataDir(d string) {
	// The engine's per-data-dir parent cgroups (empty once every sandbox is
	// gone; servertest's Engine.Close removes them too, except after tests
	// that keep their sandboxes).
	scope := gvisor.Scope(filepath.Join(d, "gvisor"))
	for _, pat := range []string{"/sys/fs/cgroup/*/torpor-" + scope, "/sys/fs/cgroup/torpor-" + scope} {
		dirs, _ := filepath.Glob(pat)
		for _, dir := range dirs {
			os.Remove(dir)
		}
	}
	// runsc's null-netns mount in the engine's root (servertest unmounts it too).
	syscall.Unmount(filepath.Join(d, "gvisor", "root", "null-netns"), syscall.MNT_DETACH)
	os.RemoveAll(d)
}

// start starts a server on the shared data directory. Tests run one at a time
// (none of them calls t.Parallel at the top level), so only one server uses the
// directory at once.
//
// Tests use different snapshot stores on that directory, so start forgets the
// store kind the previous test's server recorded in it (a real data directory
// keeps one kind: ResolveStoreKind); each test deletes its sandboxes.
func start(t *testing.T, opts servertest.Options) *servertest.Server {
	t.Helper()
	opts.DataDir = dataDir
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if opts.Store.Kind == "" {
		// The default, named: without the record, the chunks/ directory an
		// earlier test left would make the kind ambiguous (ResolveStoreKind).
		opts.Store.Kind = "chunked"
	}
	return servertest.Start(t, opts)
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// create creates a sandbox and fails the test on error.
func create(t *testing.T, c *client.Client, req apiv1.CreateSandboxRequest) apiv1.Sandbox {
	t.Helper()
	t0 := time.Now()
	sb, err := c.CreateSandbox(ctxFor(t, 5*time.Minute), req)
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	if sb.State != apiv1.StateRunning {
		t.Fatalf("created sandbox %s is %q, want running", sb.ID, sb.State)
	}
	t.Logf("created %s in %v", sb.ID, time.Since(t0).Round(time.Millisecond))
	return sb
}

// run runs cmd in sandbox id and returns stdout, stderr and the exit code.
func run(t *testing.T, c *client.Client, id string, req apiv1.ExecRequest) (string, string, int) {
	t.Helper()
	out, errb, code, err := c.ExecCollect(ctxFor(t, 2*time.Minute), id, req)
	if err != nil {
		t.Fatalf("exec %q in %s: %v (stderr %q)", req.Cmd, id, err, errb)
	}
	return string(out), string(errb), code
}

// sh runs a shell command that must exit 0 and returns its stdout.
func sh(t *testing.T, c *client.Client, id, script string) string {
	t.Helper()
	out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", script}})
	if code != 0 {
		t.Fatalf("sh %q in %s: exit %d, stderr %q", script, id, code, errb)
	}
	return out
}

func writeFile(t *testing.T, c *client.Client, id, path string, data []byte) {
	t.Helper()
	if err := c.WriteFile(ctxFor(t, time.Minute), id, path, bytes.NewReader(data)); err != nil {
		t.Fatalf("write %s in %s: %v", path, id, err)
	}
}

func readFile(t *testing.T, c *client.Client, id, path string) []byte {
	t.Helper()
	rc, err := c.ReadFile(ctxFor(t, time.Minute), id, path)
	if err != nil {
		t.Fatalf("read %s in %s: %v", path, id, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("read %s in %s: %v", path, id, err)
	}
	return b
}

func hibernate(t *testing.T, c *client.Client, id string) apiv1.Sandbox {
	t.Helper()
	t0 := time.Now()
	sb, err := c.Hibernate(ctxFor(t, 2*time.Minute), id)
	if err != nil {
		t.Fatalf("hibernate %s: %v", id, err)
	}
	if sb.State != apiv1.StateHibernated || sb.Snapshot == nil {
		t.Fatalf("hibernate %s: answer has state %q, snapshot %v; want hibernated with a snapshot", id, sb.State, sb.Snapshot)
	}
	t.Logf("hibernated %s in %v (snapshot %s, %d bytes)", id, time.Since(t0).Round(time.Millisecond), sb.Snapshot.ID, sb.Snapshot.Bytes)
	return sb
}

func get(t *testing.T, c *client.Client, id string) apiv1.Sandbox {
	t.Helper()
	sb, err := c.GetSandbox(ctxFor(t, time.Minute), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return sb
}

func wantState(t *testing.T, c *client.Client, id string, want apiv1.State) apiv1.Sandbox {
	t.Helper()
	sb := get(t, c, id)
	if sb.State != want {
		t.Fatalf("sandbox %s is %q (error %q), want %q", id, sb.State, sb.Error, want)
	}
	return sb
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// rawResult is an answer read by rawCall.
type rawResult struct {
	Status int
	Header http.Header
	Body   []byte
	Err    apiv1.ErrorDetail // decoded when the body is an ErrorBody
}

// rawCall sends a request with plain net/http (bodies the Go client cannot make).
func rawCall(t *testing.T, method, url, contentType string, body []byte) rawResult {
	t.Helper()
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctxFor(t, 2*time.Minute), method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	res := rawResult{Status: resp.StatusCode, Header: resp.Header, Body: b}
	var eb apiv1.ErrorBody
	if json.Unmarshal(b, &eb) == nil {
		res.Err = eb.Error
	}
	return res
}

// instancesOf returns the engine instances whose id starts with the sandbox id,
// once the removals of hibernated instances still in progress have ended
// (a hibernate answers before its exited instance is removed).
func instancesOf(t *testing.T, srv *servertest.Server, id string) (running, all []string, pids []int) {
	t.Helper()
	srv.Manager.Wait()
	infos, err := srv.Engine.List(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatalf("engine list: %v", err)
	}
	for _, i := range infos {
		if strings.HasPrefix(i.ID, id+"-") || i.ID == id {
			all = append(all, i.ID)
			if i.Running {
				running = append(running, i.ID)
				pids = append(pids, i.Pid)
			}
		}
	}
	return running, all, pids
}

// hostProcs returns the live (non-zombie) host processes whose command line
// mentions s, as "pid: cmdline" strings.
func hostProcs(s string) []string {
	var out []string
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	self := strconv.Itoa(os.Getpid())
	for _, d := range dirs {
		pid := filepath.Base(d)
		if pid == self {
			continue
		}
		cmd, err := os.ReadFile(d + "/cmdline")
		if err != nil || !bytes.Contains(cmd, []byte(s)) {
			continue
		}
		if procState(pid) == 'Z' {
			continue
		}
		out = append(out, pid+": "+strings.ReplaceAll(strings.TrimRight(string(cmd), "\x00"), "\x00", " "))
	}
	return out
}

// procState returns the state letter of /proc/pid/stat ('Z' zombie), 0 if gone.
func procState(pid string) byte {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// netnsOf returns the names under /run/netns that contain the sandbox id.
func netnsOf(id string) []string {
	ents, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range ents {
		if strings.Contains(e.Name(), id) {
			out = append(out, e.Name())
		}
	}
	return out
}

// assertGone checks that nothing of sandbox id is left on the host: no engine
// instance (running or not), no live process mentioning it, no network namespace.
func assertGone(t *testing.T, srv *servertest.Server, id string) {
	t.Helper()
	running, all, _ := instancesOf(t, srv, id)
	if len(running) > 0 {
		t.Errorf("engine still runs instances of %s: %v", id, running)
	} else if len(all) > 0 {
		t.Errorf("engine still lists leftovers of %s: %v", id, all)
	}
	if p := hostProcs(id); len(p) > 0 {
		t.Errorf("host processes of %s still alive:\n%s", id, strings.Join(p, "\n"))
	}
	if ns := netnsOf(id); len(ns) > 0 {
		t.Errorf("network namespaces of %s left: %v", id, ns)
	}
	var cgs []string
	for _, pat := range []string{"/sys/fs/cgroup/*/torpor-*/" + id + "-*", "/sys/fs/cgroup/torpor-*/" + id + "-*"} {
		m, _ := filepath.Glob(pat)
		cgs = append(cgs, m...)
	}
	if len(cgs) > 0 {
		t.Errorf("cgroups of %s left: %v", id, cgs)
	}
}

// metric returns the value of a sample line "name value" from GET /metrics.
func metric(t *testing.T, srv *servertest.Server, name string) float64 {
	t.Helper()
	res := rawCall(t, http.MethodGet, srv.URL+"/metrics", "", nil)
	sc := bufio.NewScanner(bytes.NewReader(res.Body))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				t.Fatalf("metric %s: %v", name, err)
			}
			return v
		}
	}
	t.Fatalf("metric %s not in /metrics", name)
	return 0
}

// resumeByRequest sends GET /count through the port proxy to the hibernated
// sandbox id, which resumes it, and checks that the workload continued where it
// stopped: counter previous+1 (*count), same pid as first, the data's checksum
// unchanged, a new generation (*gen). It updates *count and *gen and returns the
// time to the first answer and the sandbox as the API then reports it.
func resumeByRequest(t *testing.T, ctx context.Context, c *client.Client, id string, k int, first workload.State, count, gen *int64) (time.Duration, apiv1.Sandbox) {
	t.Helper()
	t1 := time.Now()
	st, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		t.Fatalf("cycle %d: GET /count after hibernate: %v", k, err)
	}
	firstAnswer := time.Since(t1)
	if st.Count != *count+1 {
		t.Errorf("cycle %d: count %d after resume, want %d (previous+1)", k, st.Count, *count+1)
	}
	if st.Pid != first.Pid {
		t.Errorf("cycle %d: workload pid %d after resume, want %d", k, st.Pid, first.Pid)
	}
	cs, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatalf("cycle %d: GET /checksum: %v", k, err)
	}
	if cs.SHA256 != first.SHA256 || cs.Bytes != first.Bytes {
		t.Errorf("cycle %d: data checksum %s (%d bytes), want %s (%d bytes)", k, cs.SHA256, cs.Bytes, first.SHA256, first.Bytes)
	}
	if cs.Count != st.Count+1 {
		t.Errorf("cycle %d: /checksum count %d, want %d", k, cs.Count, st.Count+1)
	}
	*count = cs.Count
	r := wantState(t, c, id, apiv1.StateRunning)
	if r.Generation == *gen {
		t.Errorf("cycle %d: generation %d unchanged by resume", k, *gen)
	}
	*gen = r.Generation
	return firstAnswer, r
}

// startWorkers runs step over and over in n goroutines, each with its own
// random source, until the returned stop is called; stop returns once every
// goroutine's step in progress has ended.
func startWorkers(n int, step func(rng *mrand.Rand)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), uint64(w)))
			for {
				select {
				case <-done:
					return
				default:
				}
				step(rng)
			}
		}()
	}
	return func() {
		close(done)
		wg.Wait()
	}
}
