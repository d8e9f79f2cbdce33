package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/node"
)

// TestClusterFull: three nodes whose admission admits 384 MiB each (the
// overcommit ratio set so) take one 256 MiB sandbox each, all created through
// the first node: once it is full, a create asked of it goes on to a node
// with room (waiting between creates for the nodes' records to show their
// load). Then a create through any node answers 503 with Retry-After and the
// admission's message, also when the node asked is draining: placement
// judges the other nodes by the same rule (their committed memory within
// memory × overcommit) and refuses the create itself (before and after the
// drain hibernated the draining node's sandbox), no node's admission seeing
// it. No refused create leaves a record or a runsc sandbox behind.
func TestClusterFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 5*time.Minute)
	host, err := node.HostCapacity()
	if err != nil {
		t.Fatal(err)
	}
	const capMiB, sbMiB = 384, 256
	ratio := strconv.FormatFloat(float64(capMiB)/float64(host.MemoryMiB), 'g', -1, 64)
	cl := startCluster(t, ctx, "--memory-overcommit", ratio)
	var made []string
	t.Cleanup(func() {
		for _, id := range made {
			cl.order[0].c.DeleteSandbox(context.Background(), id)
		}
	})
	// waitLoad waits until the nodes' records (their heartbeats) show n
	// sandboxes' memory in all.
	waitLoad := func(n int) []apiv1.Node {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(250 * time.Millisecond) {
			ns, err := cl.order[0].c.ListNodes(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var sum int64
			for _, nd := range ns {
				sum += nd.Load.MemoryMiB
			}
			if sum >= int64(n*sbMiB) {
				return ns
			}
			if time.Now().After(deadline) {
				t.Fatalf("a minute after %d creates the nodes' records show %d MiB: %+v", n, sum, ns)
			}
		}
	}
	first := cl.order[0]
	on := map[string]int{}            // sandboxes created per node
	key := client.NewIdempotencyKey() // the last create's
	for i := range cl.order {
		k := ""
		if i == len(cl.order)-1 {
			k = key
		}
		code, _, msg, sb := createKeyed(t, ctx, first.proc.url, sbMiB, k)
		if code != http.StatusCreated && code != http.StatusOK {
			t.Fatalf("create %d through %s: %d %s", i+1, first.name, code, msg)
		}
		made = append(made, sb.ID)
		on[sb.Node]++
		waitLoad(len(made))
	}
	for _, n := range cl.order {
		if on[n.name] != capMiB/sbMiB {
			t.Errorf("%s holds %d sandboxes of %d MiB; want %d (admits %d MiB): creates through a full node go to one with room", n.name, on[n.name], sbMiB, capMiB/sbMiB, capMiB)
		}
	}
	// Full: a second round through every node, each refused.
	for _, n := range cl.order {
		code, retry, msg, _ := createRaw(t, ctx, n.proc.url, sbMiB)
		if code != http.StatusServiceUnavailable {
			t.Fatalf("create through full %s: %d %s; want 503", n.name, code, msg)
		}
		checkRefusal(t, n.name, retry, msg)
	}
	// A retry of the last create's key through each full node gets that
	// create's sandbox, not placement's refusal (a trial: 503 "on every
	// node" for a key whose own sandbox filled the last room).
	for _, n := range cl.order {
		if code, _, msg, sb := createKeyed(t, ctx, n.proc.url, sbMiB, key); code != http.StatusCreated || sb.ID != made[len(made)-1] {
			t.Errorf("retry of the last create's key through full %s: %d %s %s; want 201 with %s", n.name, code, msg, sb.ID, made[len(made)-1])
		}
	}
	// Through a draining node: no other node has room by its registered
	// memory and overcommit ratio, so placement refuses it; also once the
	// drain has hibernated the draining node's own sandboxes (it has room
	// then, but takes no creates). The nodes' load is their heartbeat's: wait
	// until every node's shows it full.
	for deadline := time.Now().Add(time.Minute); ; {
		ns, err := cl.order[0].c.ListNodes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		full := 0
		for _, n := range ns {
			if n.Load.MemoryMiB+sbMiB > int64(float64(n.Capacity.MemoryMiB)*n.MemoryOvercommit) {
				full++
			}
		}
		if full == len(cl.order) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after the last create the nodes' records do not show them full: %+v", ns)
		}
		time.Sleep(250 * time.Millisecond)
	}
	a := cl.order[0]
	if _, err := a.c.DrainNode(ctx, a.name, true); err != nil {
		t.Fatal(err)
	}
	drainedCreate := func(when string) {
		t.Helper()
		before := map[string]float64{}
		for _, n := range cl.order {
			before[n.name] = refusedTotal(t, n.proc.url)
		}
		code, retry, msg, _ := createRaw(t, ctx, a.proc.url, sbMiB)
		if code != http.StatusServiceUnavailable {
			t.Fatalf("create through draining %s (%s): %d %s; want 503", a.name, when, code, msg)
		}
		checkRefusal(t, a.name+" (draining)", retry, msg)
		if !strings.Contains(msg, "every node") {
			t.Errorf("create through draining %s (%s): %q; want placement's refusal (every node)", a.name, when, msg)
		}
		var refusedBy []string
		for _, n := range cl.order {
			if refusedTotal(t, n.proc.url) > before[n.name] {
				refusedBy = append(refusedBy, n.name)
			}
		}
		if len(refusedBy) != 0 {
			t.Errorf("the create through draining %s (%s) reached the admission of %v; want placement to refuse it", a.name, when, refusedBy)
		}
		t.Logf("create through draining %s (%s): refused by placement: %s", a.name, when, msg)
	}
	drainedCreate("just drained")
	drained := time.Now()
	for {
		all, err := a.c.ListSandboxes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		left := 0
		for _, s := range all {
			if s.Node == a.name {
				left++
			}
		}
		if left == 0 {
			break
		}
		if time.Since(drained) > time.Minute {
			t.Fatalf("a minute after its drain %s still holds %d sandboxes", a.name, left)
		}
		time.Sleep(250 * time.Millisecond)
	}
	on[a.name] = 0
	drainedCreate("its sandboxes hibernated")

	// Nothing orphaned: the records are the admitted sandboxes, each node
	// runs exactly its own.
	all, err := a.c.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != len(made) {
		t.Errorf("%d sandbox records after %d admitted creates", len(all), len(made))
	}
	for _, s := range all {
		if want := apiv1.StateRunning; s.Node == "" {
			want = apiv1.StateHibernated // the drain's
			if s.State != want {
				t.Errorf("%s is %s on no node; want %s", s.ID, s.State, want)
			}
		} else if (s.State != want && s.State != apiv1.StatePaused) || s.Node == a.name { // idle ones pause
			t.Errorf("%s is %s on %q; want %s or paused on another node than %s", s.ID, s.State, s.Node, want, a.name)
		}
	}
	for _, n := range cl.order {
		if got := runscSandboxes(t, n.dir); got != on[n.name] {
			t.Errorf("%s runs %d runsc sandboxes; want %d", n.name, got, on[n.name])
		}
	}
}

// createRaw posts a create of a mib MiB sandbox to the server at url and
// returns the status, the Retry-After header, the error message (or body)
// and the sandbox created.
func createRaw(t *testing.T, ctx context.Context, url string, mib int) (int, string, string, apiv1.Sandbox) {
	t.Helper()
	return createKeyed(t, ctx, url, mib, "")
}

// createKeyed is createRaw with header Idempotency-Key key ("": none).
func createKeyed(t *testing.T, ctx context.Context, url string, mib int, key string) (int, string, string, apiv1.Sandbox) {
	t.Helper()
	body, _ := json.Marshal(apiv1.CreateSandboxRequest{MemoryMiB: mib})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/sandboxes", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(apiv1.IdempotencyKeyHeader, key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sb apiv1.Sandbox
	var eb struct {
		Error struct{ Message string } `json:"error"`
	}
	msg := string(b)
	if resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(b, &sb); err != nil {
			t.Fatalf("create answer %s: %v", b, err)
		}
	} else if json.Unmarshal(b, &eb) == nil && eb.Error.Message != "" {
		msg = eb.Error.Message
	}
	return resp.StatusCode, resp.Header.Get("Retry-After"), msg, sb
}

// checkRefusal checks a 503's Retry-After (whole seconds, at least 1) and
// message (admission's).
func checkRefusal(t *testing.T, who, retry, msg string) {
	t.Helper()
	if s, err := strconv.Atoi(retry); err != nil || s < 1 {
		t.Errorf("refusal through %s: Retry-After %q; want seconds", who, retry)
	}
	if !strings.Contains(msg, "host memory full") || !strings.Contains(msg, "retry later") {
		t.Errorf("refusal through %s: message %q", who, msg)
	}
}

// refusedTotal reads torpor_admission_refused_total from the server at url.
func refusedTotal(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "torpor_admission_refused_total "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metrics line %q: %v", l, err)
			}
			return f
		}
	}
	t.Fatalf("%s/metrics: no torpor_admission_refused_total", url)
	return 0
}

// runscSandboxes counts every runsc sandbox the server of data directory
// dir runs a sandbox's instance in (instancesOn).
func runscSandboxes(t *testing.T, dir string) int {
	t.Helper()
	all, err := instancesOn(t, dir)
	if err != nil {
		t.Fatal(err)
	}
	return len(all)
}
