package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/workload"
)

// wakeKinds are the calls that wake a hibernated sandbox, as
// TestClusterConcurrentWakes sends them: REST v1's resume, exec, GET files
// and the port proxy; E2B's connect, an envd GET /files and a request to a
// port (its in-sandbox routing by headers).
var wakeKinds = []string{"resume", "exec", "files", "port", "e2b-connect", "e2b-envd", "e2b-port"}

// e2bTokens are a sandbox's E2B envd access token and traffic access token
// (connect's answer).
type e2bTokens struct{ envd, traffic string }

// e2bTokensOf connects to running sandbox id through E2B's API at c and
// returns its tokens.
func e2bTokensOf(t *testing.T, ctx context.Context, c *client.Client, id string) e2bTokens {
	t.Helper()
	resp, err := c.Do(ctx, "POST", "/sandboxes/"+id+"/connect", strings.NewReader(`{"timeout":3600}`), http.Header{"Content-Type": {"application/json"}})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sb e2b.Sandbox
	if err := json.NewDecoder(resp.Body).Decode(&sb); err != nil || resp.StatusCode != http.StatusOK || sb.EnvdAccessToken == "" || sb.TrafficAccessToken == nil {
		t.Fatalf("E2B connect to %s: %d %+v %v", id, resp.StatusCode, sb, err)
	}
	return e2bTokens{sb.EnvdAccessToken, *sb.TrafficAccessToken}
}

// raceAnswer is what one of several concurrent calls through node via got.
type raceAnswer struct {
	via, kind, body string
	status          int
}

// atOnce makes the calls at the same moment (each in its goroutine, let go
// together) and returns their answers as they come.
func atOnce(calls []func() raceAnswer) []raceAnswer {
	answers := make(chan raceAnswer, len(calls))
	var start sync.WaitGroup
	start.Add(1)
	for _, call := range calls {
		go func() {
			start.Wait()
			answers <- call()
		}()
	}
	start.Done()
	out := make([]raceAnswer, 0, len(calls))
	for range calls {
		out = append(out, <-answers)
	}
	return out
}

// wakeCall sends one call of kind (wakeKinds, or "delete") for sandbox id through c and
// returns its status and what it answered (an exec's status is 200 only if
// its stream ended with exit code 0).
func wakeCall(ctx context.Context, c *client.Client, kind, id string, tok e2bTokens) (int, string) {
	var resp *http.Response
	var err error
	switch kind {
	case "resume":
		resp, err = c.Do(ctx, "POST", "/v1/sandboxes/"+id+"/resume", nil, nil)
	case "exec":
		body, _ := json.Marshal(apiv1.ExecRequest{Cmd: []string{"true"}})
		resp, err = c.Do(ctx, "POST", "/v1/sandboxes/"+id+"/exec", bytes.NewReader(body), http.Header{"Content-Type": {"application/json"}})
	case "files":
		resp, err = c.Do(ctx, "GET", "/v1/sandboxes/"+id+"/files?path=/etc/hostname", nil, nil)
	case "port":
		resp, err = c.Do(ctx, "GET", fmt.Sprintf("/v1/sandboxes/%s/ports/%d/count", id, workload.Port), nil, nil)
	case "delete":
		resp, err = c.Do(ctx, "DELETE", "/v1/sandboxes/"+id, nil, nil)
	case "e2b-connect":
		resp, err = c.Do(ctx, "POST", "/sandboxes/"+id+"/connect", strings.NewReader(`{"timeout":3600}`), http.Header{"Content-Type": {"application/json"}})
	case "e2b-envd":
		resp, err = c.Do(ctx, "GET", "/files?path=/etc/hostname&username=root", nil, http.Header{e2b.HeaderSandboxID: {id},
			e2b.HeaderSandboxPort: {fmt.Sprint(e2b.EnvdPort)}, e2b.HeaderAccessToken: {tok.envd}})
	case "e2b-port":
		resp, err = c.Do(ctx, "GET", "/count", nil, http.Header{e2b.HeaderSandboxID: {id},
			e2b.HeaderSandboxPort: {fmt.Sprint(workload.Port)}, e2b.HeaderTrafficToken: {tok.traffic}})
	}
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if kind == "exec" && resp.StatusCode == http.StatusOK {
		dec := json.NewDecoder(bytes.NewReader(b))
		for {
			var ev apiv1.ExecEvent
			if err := dec.Decode(&ev); err != nil {
				return 0, "exec stream without an exit code: " + string(b)
			}
			if ev.ExitCode != nil {
				if *ev.ExitCode != 0 {
					return 0, "exec: " + string(b)
				}
				break
			}
		}
	}
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// TestClusterConcurrentWakes: a hibernated sandbox (its owner drained, so
// that each node places a resume on itself or, the drained one, on another)
// is woken by nine calls at once, three through each node, mixing REST v1's
// resume, exec, GET files and the port proxy and E2B's connect, envd and
// port requests (wakeKinds, in turn): every call is answered 2xx, and
// exactly one resume happens (one generation step), in each of several
// rounds (the drained node undrained after each). Before the cluster front
// forwarded a call whose sandbox another node claimed meanwhile to that
// node (a port-proxy or files call, or one already forwarded to the placed
// node), some callers got 409 "sandbox … is owned by node …".
func TestClusterConcurrentWakes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 20*time.Minute)
	cl := startCluster(t, ctx)
	a := cl.nodes["cl-a"]
	sb := create(t, a.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id := sb.ID
	t.Cleanup(func() { a.c.DeleteSandbox(context.Background(), id) })
	if err := workload.Start(ctx, a.c, id, 16); err != nil {
		t.Fatal(err)
	}
	tok := e2bTokensOf(t, ctx, a.c, id)
	const rounds = 6
	for round := range rounds {
		// Hibernate it by draining its owner.
		cur := get(t, a.c, id)
		owner := cl.nodes[cur.Node]
		if owner == nil {
			t.Fatalf("round %d: the sandbox is on %q (state %s)", round, cur.Node, cur.State)
		}
		if _, err := a.c.DrainNode(ctx, owner.name, true); err != nil {
			t.Fatal(err)
		}
		drained := time.Now()
		for cur = get(t, a.c, id); cur.State != apiv1.StateHibernated; cur = get(t, a.c, id) {
			if time.Since(drained) > 4*node.HeartbeatInterval+2*time.Minute {
				t.Fatalf("round %d: drained %s still holds %s (%s)", round, owner.name, id, cur.State)
			}
			time.Sleep(250 * time.Millisecond)
		}
		gen := cur.Generation

		var calls []func() raceAnswer
		for i, n := range cl.order[:3] {
			for j := range 3 {
				kind := wakeKinds[(9*round+3*i+j)%len(wakeKinds)]
				calls = append(calls, func() raceAnswer {
					status, body := wakeCall(ctx, n.c, kind, id, tok)
					return raceAnswer{n.name, kind, body, status}
				})
			}
		}
		bad := 0
		for _, ans := range atOnce(calls) {
			if ans.status < 200 || ans.status > 299 {
				bad++
				t.Errorf("round %d: %s through %s: %d %s", round, ans.kind, ans.via, ans.status, ans.body)
			}
		}
		after := get(t, a.c, id)
		if after.State != apiv1.StateRunning || after.Generation != gen+1 {
			t.Errorf("round %d: after the wakes: %s on %q generation %d, want running, generation %d (one resume)",
				round, after.State, after.Node, after.Generation, gen+1)
		}
		instances := 0
		for _, n := range cl.order[:3] {
			instances += runscSandboxesOf(t, n.dir, id)
		}
		if instances != 1 {
			t.Errorf("round %d: %d runsc sandboxes of %s on the three nodes, want 1", round, instances, id)
		}
		t.Logf("round %d: %s drained; 9 concurrent wakes: %d not 2xx; resumed on %s, generation %d → %d",
			round, owner.name, bad, after.Node, gen, after.Generation)
		if _, err := a.c.DrainNode(ctx, owner.name, false); err != nil {
			t.Fatal(err)
		}
	}
	referred := 0
	for _, n := range cl.order[:3] {
		b, _ := os.ReadFile(n.log)
		referred += strings.Count(string(b), "another node claimed the sandbox meanwhile")
	}
	t.Logf("%d calls were sent on to the node that claimed the sandbox (referrals, in the nodes' logs)", referred)
}

// TestClusterConcurrentDeletes: a hibernated sandbox deleted through the
// three nodes at once, while a resume and an exec of it are sent through
// two of them, is deleted once: one DELETE answers 204 and the others 404,
// never 500 (a version conflict on the record, or the record gone under a
// node); the resume and the exec answer 2xx or 404; afterwards no node
// knows the sandbox or runs an instance of it. Several sandboxes, one after
// the other.
func TestClusterConcurrentDeletes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 20*time.Minute)
	cl := startCluster(t, ctx)
	nodes := cl.order[:3]
	const sandboxes = 6
	for i := range sandboxes {
		via := nodes[i%3]
		sb := create(t, via.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
		hibernate(t, via.c, sb.ID)
		var calls []func() raceAnswer
		send := func(n *clusterNode, kind string) {
			calls = append(calls, func() raceAnswer {
				status, body := wakeCall(ctx, n.c, kind, sb.ID, e2bTokens{})
				return raceAnswer{n.name, kind, body, status}
			})
		}
		for _, n := range nodes {
			send(n, "delete")
		}
		send(nodes[(i+1)%3], "resume")
		send(nodes[(i+2)%3], "exec")
		deleted := 0
		var got []string
		for _, ans := range atOnce(calls) {
			got = append(got, fmt.Sprintf("%s@%s %d", ans.kind, ans.via, ans.status))
			switch {
			case ans.kind == "delete" && ans.status == http.StatusNoContent:
				deleted++
			case ans.status == http.StatusNotFound:
			case ans.kind != "delete" && ans.status >= 200 && ans.status <= 299:
			case ans.kind == "exec" && ans.status == 0 && strings.Contains(ans.body, "deleted while the command ran"):
				// The exec started and the delete cut it.
			default:
				t.Errorf("sandbox %d: %s through %s: %d %s; want 204 or 404 (a delete), 2xx or 404 (a resume, an exec)",
					i, ans.kind, ans.via, ans.status, ans.body)
			}
		}
		if deleted != 1 {
			t.Errorf("sandbox %d: %d DELETEs answered 204, want 1", i, deleted)
		}
		t.Logf("sandbox %d: %s", i, strings.Join(got, ", "))
		for _, n := range nodes {
			if _, err := n.c.GetSandbox(ctx, sb.ID); !client.IsNotFound(err) {
				t.Errorf("sandbox %d: GET through %s after the deletes: %v, want not found", i, n.name, err)
			}
			// The hibernate's node removes its stopped instance after the
			// hibernate's answer (a delete waits for that only on the
			// same node).
			for waited := time.Now(); ; time.Sleep(250 * time.Millisecond) {
				left := runscSandboxesOf(t, n.dir, sb.ID)
				if left == 0 {
					break
				}
				if time.Since(waited) > time.Minute {
					t.Errorf("sandbox %d: %d runsc sandboxes of it left on %s", i, left, n.name)
					break
				}
			}
		}
	}
}

// TestClusterIdempotentCreates: one create with one Idempotency-Key sent
// through the three nodes at once (twice each) makes one sandbox, and every
// call answers 201 with it: a node whose claim of the key lost waits for
// the call that another node's server runs, as a retry on the same server
// does. Before the record named its holder, a node that found the key
// claimed without an answer took the other node's running call for one a
// crash had cut and made the recorded sandbox too: two creates of one id.
// Several rounds, a key each.
func TestClusterIdempotentCreates(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	nodes := cl.order[:3]
	// createWith sends one create with key through n (no client retries).
	createWith := func(n *clusterNode, key string) raceAnswer {
		resp, err := n.c.Do(ctx, "POST", "/v1/sandboxes", strings.NewReader(`{"memory_mib":128,"idle_timeout_s":0}`),
			http.Header{"Content-Type": {"application/json"}, apiv1.IdempotencyKeyHeader: {key}})
		if err != nil {
			return raceAnswer{n.name, "create", err.Error(), 0}
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return raceAnswer{n.name, "create", string(b), resp.StatusCode}
	}
	const rounds = 3
	for round := range rounds {
		key := client.NewIdempotencyKey()
		var calls []func() raceAnswer
		for _, n := range nodes {
			for range 2 {
				calls = append(calls, func() raceAnswer { return createWith(n, key) })
			}
		}
		ids := map[string]int{}
		for _, ans := range atOnce(calls) {
			var sb apiv1.Sandbox
			if ans.status != http.StatusCreated || json.Unmarshal([]byte(ans.body), &sb) != nil || sb.ID == "" {
				t.Errorf("round %d: create through %s: %d %s; want 201 with the sandbox", round, ans.via, ans.status, ans.body)
				continue
			}
			ids[sb.ID]++
		}
		if len(ids) != 1 {
			t.Fatalf("round %d: the six creates with one key answered %d sandboxes (%v), want one", round, len(ids), ids)
		}
		for id := range ids {
			t.Cleanup(func() { nodes[0].c.DeleteSandbox(context.Background(), id) })
			sb := get(t, nodes[0].c, id)
			instances := 0
			for _, n := range nodes {
				instances += runscSandboxesOf(t, n.dir, id)
			}
			if sb.State != apiv1.StateRunning || instances != 1 {
				t.Errorf("round %d: %s is %s on %q with %d runsc sandboxes on the three nodes; want running, one", round, id, sb.State, sb.Node, instances)
			}
			if _, err := nodes[1].c.Exec(ctx, id, apiv1.ExecRequest{Cmd: []string{"true"}}); err != nil {
				t.Errorf("round %d: exec in %s: %v", round, id, err)
			}
			t.Logf("round %d: six creates with one key through three nodes: one sandbox, %s on %s", round, id, sb.Node)
		}
	}

	// A create whose server is killed after it recorded the sandbox (the
	// record owned by that node, its instance never started), retried
	// through the two other nodes at once: (1) the node's server started
	// again: the retries go to it (it owns what the cut call made) and it
	// takes the call over, remaking the sandbox; (2) the node not back: the
	// retries wait until it is lost and its sandboxes fenced, then one takes
	// it over and the other waits for it. Each time one sandbox, running.
	// Before, a retry took over at once and failed to remove the sandbox
	// the restarted node owned (409, then a stuck key), or answered the
	// lost node's sandbox as it was ("creating", then "error" for good).
	a := nodes[0]
	cutCreate := func() string {
		t.Helper()
		a.proc.stop(t)
		a.env = []string{"TORPOR_TEST_KILL_AT=create-recorded"}
		cl.start(a)
		a.env = nil
		key := client.NewIdempotencyKey()
		if ans := createWith(a, key); ans.status != 0 {
			t.Fatalf("create through %s answered %d %s though its server was to be killed", a.name, ans.status, ans.body)
		}
		select {
		case <-a.proc.done:
			a.proc.done = nil
		case <-time.After(time.Minute):
			t.Fatalf("%s's server still runs after the fault point", a.name)
		}
		return key
	}
	retried := func(key, what string) {
		t.Helper()
		ids := map[string]int{}
		for _, ans := range atOnce([]func() raceAnswer{func() raceAnswer { return createWith(nodes[1], key) }, func() raceAnswer { return createWith(nodes[2], key) }}) {
			var sb apiv1.Sandbox
			if ans.status != http.StatusCreated || json.Unmarshal([]byte(ans.body), &sb) != nil || sb.ID == "" {
				t.Errorf("%s: retry of the cut create through %s: %d %s; want 201 with the sandbox", what, ans.via, ans.status, ans.body)
				continue
			}
			ids[sb.ID]++
		}
		if len(ids) != 1 {
			t.Fatalf("%s: two retries of the cut create answered %d sandboxes (%v), want one", what, len(ids), ids)
		}
		for id := range ids {
			t.Cleanup(func() { nodes[1].c.DeleteSandbox(context.Background(), id) })
			instances := 0
			for _, n := range nodes {
				instances += runscSandboxesOf(t, n.dir, id)
			}
			if sb := get(t, nodes[1].c, id); sb.State != apiv1.StateRunning || instances != 1 {
				t.Errorf("%s: the retried create's %s is %s on %q (%s) with %d runsc sandboxes; want running, one", what, id, sb.State, sb.Node, sb.Error, instances)
			}
		}
	}
	takenIn := func(ns ...*clusterNode) int {
		taken := 0
		for _, n := range ns {
			b, _ := os.ReadFile(n.log)
			taken += strings.Count(string(b), "taking the call over")
		}
		return taken
	}
	key := cutCreate()
	cl.start(a)
	retried(key, "node restarted")
	if n := takenIn(a); n != 1 {
		t.Errorf("node restarted: %s took the cut call over %d times (its log), want 1", a.name, n)
	}
	before := takenIn(nodes[1], nodes[2])
	key = cutCreate()
	retried(key, "node lost")
	if n := takenIn(nodes[1], nodes[2]) - before; n != 1 {
		t.Errorf("node lost: the other nodes took the cut call over %d times (their logs), want 1", n)
	}
}
