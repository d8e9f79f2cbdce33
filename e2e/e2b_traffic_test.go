package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// wantTrafficRefusal fails t unless a is the 403 of a request without the
// sandbox's traffic token: E2B's body {sandboxId, message, code: 403}, the
// message containing word.
func (a e2bAnswer) wantTrafficRefusal(t *testing.T, what, id, word string) {
	t.Helper()
	var r e2b.TrafficRefusal
	if err := json.Unmarshal(a.Body, &r); err != nil || a.Status != http.StatusForbidden || r.Code != http.StatusForbidden ||
		r.SandboxID != id || !strings.Contains(r.Message, word) {
		t.Errorf("%s: %d %s, want 403 {sandboxId: %s, code: 403, message: …%s…}", what, a.Status, a.Body, id, word)
	}
}

// TestE2BTrafficToken: a sandbox created with network.allowPublicTraffic false
// (both create paths) is given a trafficAccessToken; a request routed to one
// of its ports (by host name or by headers) is refused 403 without it or with
// a wrong one (its envd token, another sandbox's traffic token) and reaches
// the server inside with it, whose request counter shows that no refused
// request got through; the header itself is not passed on. A refused request does not wake the paused sandbox
// (autoResume on): it stays hibernated, its generation unchanged, until a
// request with the token wakes it. The setting and the token survive the
// pause and resume and a restart of the server; a fork clone has the setting
// and a token of its own. envd's port keeps needing only the envd token; a
// sandbox created without the field, or with true, is public and gets no
// token.
func TestE2BTrafficToken(t *testing.T) {
	srv := startE2B(t, servertest.Options{})
	ctx := ctxFor(t, 15*time.Minute)
	private := &e2b.Network{AllowPublicTraffic: bptr(false)}
	sb := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", AutoPause: bptr(true), AutoResume: &e2b.AutoResume{Enabled: true}, Network: private})
	id := sb.SandboxID
	if sb.TrafficAccessToken == nil || len(*sb.TrafficAccessToken) != 64 || *sb.TrafficAccessToken == sb.EnvdAccessToken {
		t.Fatalf("create answer %+v: want a trafficAccessToken of its own", sb)
	}
	token := *sb.TrafficAccessToken
	if d := e2bInfo(t, srv, id); d.Network == nil || d.Network.AllowPublicTraffic == nil || *d.Network.AllowPublicTraffic {
		t.Errorf("info network %+v, want allowPublicTraffic false", d.Network)
	}
	// The create path of SDKs before 2.51 (POST /sandboxes) takes it too.
	var old e2b.Sandbox
	a := e2bCall(t, srv, "POST", "/sandboxes", e2b.NewSandbox{TemplateID: "base", Network: private})
	if a.Status != http.StatusCreated {
		t.Fatalf("POST /sandboxes: %d %s", a.Status, a.Body)
	}
	a.decode(t, &old)
	if old.TrafficAccessToken == nil || *old.TrafficAccessToken == token {
		t.Errorf("POST /sandboxes answer %+v: want a trafficAccessToken of its own", old)
	}
	e2bCall(t, srv, "GET", "/count", nil, "Host", fmt.Sprintf("%d-%s.%s", workload.Port, old.SandboxID, e2bDomain)).
		wantTrafficRefusal(t, "POST /sandboxes sandbox, no token", old.SandboxID, "missing")
	if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+old.SandboxID, nil); a.Status != http.StatusNoContent {
		t.Errorf("kill: %d %s", a.Status, a.Body)
	}

	if err := workload.Start(ctx, srv.Client, id, 16); err != nil {
		t.Fatal(err)
	}
	last, err := workload.Get(ctx, srv.Client, id, "/count")
	if err != nil {
		t.Fatal(err)
	}
	byHost := func(id string) []string {
		return []string{"Host", fmt.Sprintf("%d-%s.%s", workload.Port, id, e2bDomain)}
	}
	byHeaders := func(id string) []string {
		return []string{e2b.HeaderSandboxID, id, e2b.HeaderSandboxPort, fmt.Sprint(workload.Port)}
	}
	// refused sends the requests that must be refused: no token, a wrong
	// one, its envd token, by host name and by headers.
	refused := func(when, id string, wrong ...string) {
		t.Helper()
		for _, route := range [][]string{byHost(id), byHeaders(id)} {
			e2bCall(t, srv, "GET", "/count", nil, route...).wantTrafficRefusal(t, when+", no token, "+route[0], id, "'e2b-traffic-access-token' is missing")
			for _, tok := range wrong {
				e2bCall(t, srv, "GET", "/count", nil, append(route, e2b.HeaderTrafficToken, tok)...).
					wantTrafficRefusal(t, fmt.Sprintf("%s, token %.8s…, %s", when, tok, route[0]), id, "invalid")
			}
		}
	}
	// reached sends a request with the token and checks that the sandbox's
	// server answers it with the count after last (no refused one reached it).
	reached := func(when, id, tok string, route []string) workload.State {
		t.Helper()
		a := e2bCall(t, srv, "GET", "/count", nil, append(route, strings.ToLower(e2b.HeaderTrafficToken), tok)...)
		var st workload.State
		if a.Status != http.StatusOK || json.Unmarshal(a.Body, &st) != nil || st.Pid != last.Pid || st.Count != last.Count+1 {
			t.Fatalf("%s, with the token: %d %s, want the server (pid %d) to answer count %d", when, a.Status, a.Body, last.Pid, last.Count+1)
		}
		return st
	}
	wrong := []string{sb.EnvdAccessToken, *old.TrafficAccessToken, strings.Repeat("0", 64)}
	refused("running", id, wrong...)
	last = reached("running, by host", id, token, byHost(id))
	last = reached("running, by headers", id, token, byHeaders(id))
	// The token stays on this side: a server that echoes the headers it got
	// does not see it.
	const echoPort = 8081
	echo := `import http.server, json, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
socketserver.TCPServer(("0.0.0.0", ` + fmt.Sprint(echoPort) + `), H).serve_forever()`
	if _, err := srv.Client.ExecBackground(ctx, id, apiv1.ExecRequest{Cmd: []string{"python3", "-c", echo}}); err != nil {
		t.Fatal(err)
	}
	echoHost := []string{"Host", fmt.Sprintf("%d-%s.%s", echoPort, id, e2bDomain), e2b.HeaderTrafficToken, token, "X-App", "kept"}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		a := e2bCall(t, srv, "GET", "/", nil, echoHost...)
		var got map[string]string
		if a.Status == http.StatusOK && json.Unmarshal(a.Body, &got) == nil {
			_, leaked := got[strings.ToLower(e2b.HeaderTrafficToken)]
			_, keyLeaked := got[strings.ToLower(e2b.HeaderAPIKey)] // e2bCall sends the API key on every request
			if leaked || keyLeaked || got["x-app"] != "kept" {
				t.Errorf("the sandbox's server got headers %v: want X-App, not %s nor %s", got, e2b.HeaderTrafficToken, e2b.HeaderAPIKey)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the echo server did not answer: %d %s", a.Status, a.Body)
		}
	}
	// envd's port: its own token, no traffic token.
	if a := e2bCall(t, srv, "GET", "/health", nil, e2b.HeaderSandboxID, id, e2b.HeaderSandboxPort, fmt.Sprint(e2b.EnvdPort),
		e2b.HeaderAccessToken, sb.EnvdAccessToken); a.Status >= 300 {
		t.Errorf("envd /health with the envd token only: %d %s", a.Status, a.Body)
	}

	// Paused: refused requests leave it hibernated; the token wakes it.
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+id+"/pause", nil); a.Status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", a.Status, a.Body)
	}
	paused := wantState(t, srv.Client, id, apiv1.StateHibernated)
	refused("hibernated", id, wrong...)
	if v := wantState(t, srv.Client, id, apiv1.StateHibernated); v.Generation != paused.Generation || !v.StateChangedAt.Equal(paused.StateChangedAt) {
		t.Errorf("after the refused requests: generation %d, state changed at %v; before them %d, %v", v.Generation, v.StateChangedAt, paused.Generation, paused.StateChangedAt)
	}
	last = reached("hibernated", id, token, byHost(id))
	if v := get(t, srv.Client, id); v.State != apiv1.StateRunning || v.Generation == paused.Generation {
		t.Errorf("after the request with the token: %s, generation %d (was %d), want running, a new generation", v.State, v.Generation, paused.Generation)
	}
	refused("resumed", id, wrong...)
	last = reached("resumed", id, token, byHost(id))

	// connect answers the same token.
	var conn e2b.Sandbox
	e2bCall(t, srv, "POST", "/v2/sandboxes/"+id+"/connect", nil).decode(t, &conn)
	if conn.TrafficAccessToken == nil || *conn.TrafficAccessToken != token {
		t.Errorf("connect answer %+v, want trafficAccessToken %s", conn, token)
	}

	// A fork clone: the setting, its own token.
	var forks []e2b.ForkResult
	a = e2bCall(t, srv, "POST", "/sandboxes/"+id+"/fork", e2b.ForkRequest{})
	a.decode(t, &forks)
	if a.Status != http.StatusCreated || len(forks) != 1 || forks[0].Sandbox == nil {
		t.Fatalf("fork: %d %s", a.Status, a.Body)
	}
	clone := *forks[0].Sandbox
	if clone.TrafficAccessToken == nil || *clone.TrafficAccessToken == token {
		t.Fatalf("fork answer %+v: want a trafficAccessToken of its own", clone)
	}
	if d := e2bInfo(t, srv, clone.SandboxID); d.Network == nil || d.Network.AllowPublicTraffic == nil || *d.Network.AllowPublicTraffic {
		t.Errorf("clone's info network %+v, want allowPublicTraffic false", d.Network)
	}
	refused("fork clone", clone.SandboxID, token, clone.EnvdAccessToken)
	a = e2bCall(t, srv, "GET", "/count", nil, append(byHost(clone.SandboxID), e2b.HeaderTrafficToken, *clone.TrafficAccessToken)...)
	var st workload.State
	if a.Status != http.StatusOK || json.Unmarshal(a.Body, &st) != nil || st.Pid != last.Pid {
		t.Errorf("fork clone with its token: %d %s, want the source's server (pid %d)", a.Status, a.Body, last.Pid)
	}
	if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+clone.SandboxID, nil); a.Status != http.StatusNoContent {
		t.Errorf("kill the clone: %d %s", a.Status, a.Body)
	}

	// A restart of the server keeps the setting and the token.
	srv.Restart(t)
	refused("after a restart", id, wrong...)
	last = reached("after a restart", id, token, byHeaders(id))

	// A sandbox made through torpor's own API (whose port proxy needs a key)
	// is not public on E2B's routing either: its ports need its traffic
	// token, which E2B's connect answers to a key holder.
	v1 := create(t, srv.Client, apiv1.CreateSandboxRequest{})
	refused("made through /v1", v1.ID, token)
	if d := e2bInfo(t, srv, v1.ID); d.Network == nil || d.Network.AllowPublicTraffic == nil || *d.Network.AllowPublicTraffic {
		t.Errorf("info of a /v1 sandbox: network %+v, want allowPublicTraffic false", d.Network)
	}
	var v1conn e2b.Sandbox
	e2bCall(t, srv, "POST", "/v2/sandboxes/"+v1.ID+"/connect", nil).decode(t, &v1conn)
	if v1conn.TrafficAccessToken == nil {
		t.Fatalf("connect of a /v1 sandbox: %+v, want a trafficAccessToken", v1conn)
	}
	e2bCall(t, srv, "GET", "/", nil, append(byHost(v1.ID), e2b.HeaderTrafficToken, *v1conn.TrafficAccessToken)...).
		wantError(t, "a /v1 sandbox's port nothing listens on, with its token", http.StatusBadGateway)

	// Public traffic, left out or true: no token, none needed (the port
	// itself is TestE2BControlPlane's).
	for _, n := range []*e2b.Network{nil, {AllowPublicTraffic: bptr(true)}} {
		pub := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Network: n})
		if pub.TrafficAccessToken != nil {
			t.Errorf("create with network %+v answers trafficAccessToken %q", n, *pub.TrafficAccessToken)
		}
		if d := e2bInfo(t, srv, pub.SandboxID); d.Network == nil || d.Network.AllowPublicTraffic == nil || !*d.Network.AllowPublicTraffic {
			t.Errorf("info network %+v of a public sandbox, want allowPublicTraffic true", d.Network)
		}
		e2bCall(t, srv, "GET", "/", nil, byHost(pub.SandboxID)...).wantError(t, "a public sandbox's port nothing listens on", http.StatusBadGateway)
		if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+pub.SandboxID, nil); a.Status != http.StatusNoContent {
			t.Errorf("kill: %d %s", a.Status, a.Body)
		}
	}
}
