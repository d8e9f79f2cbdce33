package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// e2bDomain is the domain of the E2B tests' host-routed requests.
const e2bDomain = "sandboxes.torpor.test"

// startE2B starts a server that requires API keys (servertest makes one,
// Server.APIKey) with e2bDomain for E2B's host routing.
func startE2B(t *testing.T, opts servertest.Options) *servertest.Server {
	opts.E2B = server.E2BConfig{Domain: e2bDomain}
	opts.Auth = server.AuthRequired
	return start(t, opts)
}

// e2bAnswer is an answer of the E2B API.
type e2bAnswer struct {
	Status int
	Header http.Header
	Body   []byte
}

// decode decodes the answer's body into v, failing t if it is not JSON of v's shape.
func (a e2bAnswer) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(a.Body, v); err != nil {
		t.Fatalf("answer %d %s: %v", a.Status, a.Body, err)
	}
}

// wantError fails t unless the answer is E2B's error body with status and a
// message containing each of words.
func (a e2bAnswer) wantError(t *testing.T, what string, status int, words ...string) {
	t.Helper()
	var e e2b.Error
	if err := json.Unmarshal(a.Body, &e); err != nil || a.Status != status || e.Code != status {
		t.Errorf("%s: %d %s, want %d with {code: %d}", what, a.Status, a.Body, status, status)
		return
	}
	for _, w := range words {
		if !strings.Contains(e.Message, w) {
			t.Errorf("%s: message %q does not name %q", what, e.Message, w)
		}
	}
}

// e2bCall sends one E2B request (body: nil, a []byte sent as it is, or a
// value sent as JSON) with the API key and the headers in hdr (pairs).
func e2bCall(t *testing.T, srv *servertest.Server, method, path string, body any, hdr ...string) e2bAnswer {
	t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		r = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		r = bytes.NewReader(j)
	}
	req, err := http.NewRequestWithContext(ctxFor(t, 3*time.Minute), method, srv.URL+path, r)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(e2b.HeaderAPIKey, srv.APIKey)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i] == "Host" {
			req.Host = hdr[i+1]
			continue
		}
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return e2bAnswer{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// e2bCreate creates a sandbox through the E2B API and returns the answer.
func e2bCreate(t *testing.T, srv *servertest.Server, req e2b.NewSandbox) e2b.Sandbox {
	t.Helper()
	a := e2bCall(t, srv, "POST", "/v2/sandboxes", req)
	if a.Status != http.StatusCreated {
		t.Fatalf("create %+v: %d %s", req, a.Status, a.Body)
	}
	var sb e2b.Sandbox
	a.decode(t, &sb)
	return sb
}

func e2bInfo(t *testing.T, srv *servertest.Server, id string) e2b.SandboxDetail {
	t.Helper()
	a := e2bCall(t, srv, "GET", "/sandboxes/"+id, nil)
	if a.Status != http.StatusOK {
		t.Fatalf("info %s: %d %s", id, a.Status, a.Body)
	}
	var d e2b.SandboxDetail
	a.decode(t, &d)
	return d
}

func i32(v int32) *int32 { return &v }
func bptr(v bool) *bool  { return &v }

// countSandboxes is how many sandboxes the server has (torpor's API).
func countSandboxes(t *testing.T, srv *servertest.Server) int {
	t.Helper()
	all, err := srv.Client.ListSandboxes(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	return len(all)
}

// TestE2BBadInput: every refused call answers E2B's error body with the
// status the SDKs map (401 AuthenticationError, 404 NotFoundError, 409, 400)
// and changes nothing.
func TestE2BBadInput(t *testing.T) {
	// The server's log goes to a file (slog's handler serializes its writes).
	logPath := filepath.Join(t.TempDir(), "server.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	srv := startE2B(t, servertest.Options{Logger: slog.New(slog.NewTextHandler(logFile, nil))})
	sb := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base"})
	before := countSandboxes(t, srv)

	for _, key := range []string{"", "e2b_ffff"} {
		req, _ := http.NewRequest("GET", srv.URL+"/v2/sandboxes", nil)
		if key != "" {
			req.Header.Set(e2b.HeaderAPIKey, key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		e2bAnswer{Status: resp.StatusCode, Body: b}.wantError(t, "key "+key, http.StatusUnauthorized, "API key")
	}
	for _, c := range []struct {
		what, method, path string
		body               any
		status             int
		words              []string
	}{
		{"create, body not JSON", "POST", "/v2/sandboxes", []byte("templateID=base"), 400, []string{"JSON"}},
		{"create, body an array", "POST", "/sandboxes", []byte(`[]`), 400, []string{"JSON object"}},
		{"create, timeout a string", "POST", "/v2/sandboxes", []byte(`{"timeout":"5"}`), 400, []string{"timeout", "string", "integer"}},
		{"create, timeout a fraction", "POST", "/v2/sandboxes", []byte(`{"templateID":"base","timeout":1.5}`), 400, []string{"timeout", "integer"}},
		{"create, templateID a number", "POST", "/v2/sandboxes", []byte(`{"templateID":5}`), 400, []string{"templateID", "string"}},
		{"create, autoPause a string", "POST", "/v2/sandboxes", []byte(`{"templateID":"base","autoPause":"yes"}`), 400, []string{"autoPause", "boolean"}},
		{"create, autoResume a boolean", "POST", "/v2/sandboxes", []byte(`{"templateID":"base","autoResume":true}`), 400, []string{"autoResume", "object"}},
		{"create, autoResume.enabled a string", "POST", "/v2/sandboxes", []byte(`{"templateID":"base","autoResume":{"enabled":"true"}}`), 400, []string{"autoResume.enabled", "boolean"}},
		{"create, metadata value a number", "POST", "/sandboxes", []byte(`{"templateID":"base","metadata":{"a":1}}`), 400, []string{"metadata", "string"}},
		{"create, envVars an array", "POST", "/v2/sandboxes", []byte(`{"templateID":"base","envVars":["A=1"]}`), 400, []string{"envVars", "object"}},
		{"pause, memory a string", "POST", "/sandboxes/" + sb.SandboxID + "/pause", []byte(`{"memory":"no"}`), 400, []string{"memory", "boolean"}},
		{"fork, count a string", "POST", "/sandboxes/" + sb.SandboxID + "/fork", []byte(`{"count":"2"}`), 400, []string{"count", "integer"}},
		{"create, negative timeout", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Timeout: i32(-1)}, 400, []string{"timeout"}},
		{"create, timeout 0", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Timeout: i32(0)}, 400, []string{"timeout 0", "at least 1"}},
		{"create (old path), timeout over the bound", "POST", "/sandboxes", e2b.NewSandbox{TemplateID: "base", Timeout: i32(40_000_000)}, 400, []string{"timeout 40000000", "at most"}},
		{"timeout, over the bound", "POST", "/sandboxes/" + sb.SandboxID + "/timeout", []byte(`{"timeout": 40000000}`), 400, []string{"timeout 40000000", "at most"}},
		{"timeout, negative", "POST", "/sandboxes/" + sb.SandboxID + "/timeout", []byte(`{"timeout": -5}`), 400, []string{"timeout -5"}},
		{"connect, timeout over the bound", "POST", "/v2/sandboxes/" + sb.SandboxID + "/connect", []byte(`{"timeout": 40000000}`), 400, []string{"timeout 40000000", "at most"}},
		{"fork, timeout 0", "POST", "/sandboxes/" + sb.SandboxID + "/fork", []byte(`{"timeout": 0}`), 400, []string{"timeout 0", "at least 1"}},
		{"create, unknown template", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "no-such-template"}, 404, []string{"no-such-template"}},
		{"create, allowOut without an uplink", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Network: &e2b.Network{AllowOut: []string{"1.1.1.1"}}}, 400, []string{"allow_out", "uplink"}},
		{"create, a domain in allowOut", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Network: &e2b.Network{AllowOut: []string{"*.example.com"}}}, 400, []string{"*.example.com", "domain"}},
		{"create, egress rules", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Network: &e2b.Network{Rules: json.RawMessage(`{"x":1}`)}}, 400, []string{"network"}},
		{"create, volumes", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", VolumeMounts: []e2b.VolumeMount{{Name: "v", Path: "/v"}}}, 400, []string{"volumeMounts"}},
		{"create, MCP", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", MCP: json.RawMessage(`{"x":{}}`)}, 400, []string{"mcp"}},
		{"create, metadata with an empty key", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", Metadata: map[string]string{"": "x"}}, 400, []string{"metadata"}},
		{"create, bad env key", "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: "base", EnvVars: map[string]string{"A B": "x"}}, 400, []string{"A B"}},
		{"info, unknown", "GET", "/sandboxes/sbx-000000000000", nil, 404, []string{"sbx-000000000000"}},
		{"kill, unknown", "DELETE", "/sandboxes/nope", nil, 404, nil},
		{"pause, unknown", "POST", "/sandboxes/sbx-000000000000/pause", nil, 404, nil},
		{"connect, unknown", "POST", "/v2/sandboxes/sbx-000000000000/connect", nil, 404, nil},
		{"timeout, missing", "POST", "/sandboxes/" + sb.SandboxID + "/timeout", []byte(`{}`), 400, []string{"timeout"}},
		{"timeout, unknown", "POST", "/sandboxes/sbx-000000000000/timeout", []byte(`{"timeout": 5}`), 404, nil},
		{"fork, count 0", "POST", "/sandboxes/" + sb.SandboxID + "/fork", []byte(`{"count": 0}`), 400, []string{"count"}},
		{"fork, count over the limit", "POST", "/sandboxes/" + sb.SandboxID + "/fork", []byte(`{"count": 17}`), 400, []string{"count 17: want 1 to 16"}},
		{"fork, count over E2B's limit", "POST", "/sandboxes/" + sb.SandboxID + "/fork", []byte(`{"count": 101}`), 400, []string{"count 101: want 1 to 16"}},
		{"snapshot name like an id", "POST", "/sandboxes/" + sb.SandboxID + "/snapshots", []byte(`{"name": "snap-x"}`), 400, []string{"snap-"}},
		{"delete unknown snapshot", "DELETE", "/templates/snap-000000000000", nil, 404, nil},
		{"list, bad state", "GET", "/v2/sandboxes?state=asleep", nil, 400, []string{"state"}},
		{"list, bad limit", "GET", "/v2/sandboxes?limit=1000", nil, 400, []string{"limit"}},
		{"list, bad token", "GET", "/v2/sandboxes?nextToken=xyz", nil, 400, []string{"nextToken"}},
		{"list, undecodable metadata", "GET", "/v2/sandboxes?metadata=%%%", nil, 400, []string{"metadata"}},
		{"list (running), undecodable metadata", "GET", "/sandboxes?metadata=%%%", nil, 400, []string{"metadata"}},
		{"list, metadata pair without =", "GET", "/v2/sandboxes?metadata=user", nil, 400, []string{"metadata"}},
		{"list (running), bogus state", "GET", "/sandboxes?state=bogus", nil, 400, []string{"state", "bogus"}},
		{"list, undecodable state", "GET", "/v2/sandboxes?state=%zz", nil, 400, []string{"state"}},
		{"list, limit not a number", "GET", "/v2/sandboxes?limit=abc", nil, 400, []string{"limit", "abc"}},
		{"list (running), garbage token", "GET", "/sandboxes?nextToken=" + url.QueryEscape("!!not-a-token"), nil, 400, []string{"nextToken"}},
		{"list, undecodable token", "GET", "/v2/sandboxes?nextToken=%zz", nil, 400, []string{"nextToken"}},
		{"list, bad order", "GET", "/v2/sandboxes?order=up", nil, 400, []string{"order"}},
		{"list, bad startedAfter", "GET", "/v2/sandboxes?startedAfter=yesterday", nil, 400, []string{"startedAfter"}},
		{"snapshots, limit not a number", "GET", "/snapshots?limit=abc", nil, 400, []string{"limit"}},
		{"snapshots, garbage token", "GET", "/snapshots?nextToken=garbage", nil, 400, []string{"nextToken"}},
		{"snapshots, undecodable sandboxID", "GET", "/snapshots?sandboxID=%zz", nil, 400, []string{"sandboxID"}},
		{"metrics, start not a number", "GET", "/sandboxes/" + sb.SandboxID + "/metrics?start=abc", nil, 400, []string{"start", "abc"}},
		{"metrics, end not a number", "GET", "/sandboxes/" + sb.SandboxID + "/metrics?end=1.5", nil, 400, []string{"end"}},
		{"metrics, start after end", "GET", "/sandboxes/" + sb.SandboxID + "/metrics?start=2000&end=1000", nil, 400, []string{"start", "end"}},
		{"unknown path", "GET", "/v2/whatever", nil, 404, []string{"/v2/whatever"}},
		{"template build", "POST", "/v3/templates", []byte(`{"name":"t"}`), 501, []string{"template builds", "torpor image build"}},
		{"template build status", "GET", "/templates/t/builds/b/status", nil, 501, []string{"template builds"}},
		{"network rules", "PUT", "/sandboxes/" + sb.SandboxID + "/network", []byte(`{"allowOut":["1.1.1.1"]}`), 501, []string{"network rules"}},
		{"volumes", "POST", "/volumes", []byte(`{"name":"v"}`), 501, []string{"volumes"}},
		{"route, one header", "GET", "/health", nil, 400, []string{e2b.HeaderSandboxPort}},
	} {
		var hdr []string
		if c.what == "route, one header" {
			hdr = []string{e2b.HeaderSandboxID, sb.SandboxID}
		}
		a := e2bCall(t, srv, c.method, c.path, c.body, hdr...)
		a.wantError(t, c.what, c.status, c.words...)
		// E2B's errors name E2B's fields, not torpor's.
		if strings.Contains(string(a.Body), "timeout_s") {
			t.Errorf("%s: %s names torpor's timeout_s", c.what, a.Body)
		}
	}
	if n := countSandboxes(t, srv); n != before {
		t.Errorf("%d sandboxes after the refused calls, want %d", n, before)
	}
	if d := e2bInfo(t, srv, sb.SandboxID); d.State != e2b.StateRunning {
		t.Errorf("sandbox %s is %s after the refused calls, want running", sb.SandboxID, d.State)
	}
	// Fields this server does not know are ignored, as E2B's server does,
	// and logged.
	a := e2bCall(t, srv, "POST", "/v2/sandboxes", []byte(`{"templateID":"base","metadata":{"k":"v"},"futureOption":{"x":1},"zFlag":true}`))
	var extra e2b.Sandbox
	if a.Status != http.StatusCreated || json.Unmarshal(a.Body, &extra) != nil {
		t.Errorf("create with unknown fields: %d %s, want 201", a.Status, a.Body)
	} else if d := e2bInfo(t, srv, extra.SandboxID); d.Metadata["k"] != "v" {
		t.Errorf("create with unknown fields: the known ones were not applied: %+v", d)
	}
	if log, _ := os.ReadFile(logPath); !strings.Contains(string(log), "fields=\"[futureOption zFlag]\"") {
		t.Errorf("the ignored fields are not logged:\n%s", log)
	}

	// envd without, and with a wrong, access token.
	for _, tok := range []string{"", "wrong"} {
		e2bCall(t, srv, "GET", "/health", nil, e2b.HeaderSandboxID, sb.SandboxID, e2b.HeaderSandboxPort, "49983",
			e2b.HeaderAccessToken, tok).wantError(t, "envd with token "+tok, http.StatusUnauthorized, e2b.HeaderAccessToken)
	}
}

// TestE2BControlPlane drives each control-plane call against real sandboxes:
// create with metadata, env and a timeout; info; timeout; pause (twice) and
// connect (201, then 200) with memory kept; list filters and pages; snapshot,
// create from it and delete it; fork; metrics; kill (twice); the port proxy
// by host name and by headers.
func TestE2BControlPlane(t *testing.T) {
	srv := startE2B(t, servertest.Options{})
	ctx := ctxFor(t, 10*time.Minute)
	t0 := time.Now()
	sb := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(120),
		Metadata: map[string]string{"user": "abc", "run": "cp"}, EnvVars: map[string]string{"GREETING": "hello e2b"}})
	id := sb.SandboxID
	if sb.TemplateID != "base" || sb.EnvdVersion != e2b.EnvdVersion || len(sb.EnvdAccessToken) != 64 ||
		sb.Domain == nil || *sb.Domain != e2bDomain || sb.ClientID != e2b.ClientID {
		t.Errorf("create answer %+v", sb)
	}
	d := e2bInfo(t, srv, id)
	if d.State != e2b.StateRunning || !reflect.DeepEqual(d.Metadata, map[string]string{"user": "abc", "run": "cp"}) ||
		d.CPUCount != 1 || d.MemoryMB != 512 || d.DiskSizeMB != 256 || d.EnvdVersion != e2b.EnvdVersion || d.EnvdAccessToken != sb.EnvdAccessToken ||
		d.Lifecycle == nil || d.Lifecycle.OnTimeout != e2b.OnTimeoutKill || d.Lifecycle.AutoResume {
		t.Errorf("info %+v", d)
	}
	if end := d.EndAt.Sub(t0); end < 100*time.Second || end > 130*time.Second || d.StartedAt.Before(t0.Add(-time.Second)) {
		t.Errorf("startedAt %v endAt %v, want endAt about 120 s after %v", d.StartedAt, d.EndAt, t0)
	}
	// envVars are the sandbox's env: every command gets them.
	if out := sh(t, srv.Client, id, `echo "$GREETING"`); out != "hello e2b\n" {
		t.Errorf("GREETING in a command: %q", out)
	}
	// The mapping onto torpor's policies: kill on timeout, no idle hibernation.
	if v := get(t, srv.Client, id); v.TimeoutS != 120 || v.OnTimeout != "delete" || v.IdleTimeoutS != 0 || v.Image != image.E2BBaseName {
		t.Errorf("torpor sees image %s timeout %d on_timeout %s idle %d", v.Image, v.TimeoutS, v.OnTimeout, v.IdleTimeoutS)
	}

	if a := e2bCall(t, srv, "POST", "/sandboxes/"+id+"/timeout", e2b.TimeoutRequest{Timeout: i32(30)}); a.Status != http.StatusNoContent {
		t.Fatalf("timeout: %d %s", a.Status, a.Body)
	}
	if end := time.Until(e2bInfo(t, srv, id).EndAt); end < 20*time.Second || end > 31*time.Second {
		t.Errorf("after setTimeout(30 s) the end is %v away", end)
	}

	// Pause with a running process; connect finds it where it was.
	if err := workload.Start(ctx, srv.Client, id, 16); err != nil {
		t.Fatal(err)
	}
	st0, err := workload.Get(ctx, srv.Client, id, "/count")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, srv.Client, id, "/home/kept.txt", []byte("kept"))
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+id+"/pause", []byte(`{}`)); a.Status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", a.Status, a.Body)
	}
	if d := e2bInfo(t, srv, id); d.State != e2b.StatePaused {
		t.Errorf("after pause: %s", d.State)
	}
	e2bCall(t, srv, "POST", "/sandboxes/"+id+"/pause", nil).wantError(t, "second pause", http.StatusConflict, "already paused")
	// A connect that resumes sets the timeout it gives, even one shorter
	// than the ~25 s the sandbox had left (E2B sets it on resume).
	a := e2bCall(t, srv, "POST", "/v2/sandboxes/"+id+"/connect", e2b.ConnectRequest{Timeout: i32(20)})
	if a.Status != http.StatusCreated {
		t.Fatalf("connect of a paused sandbox: %d %s, want 201", a.Status, a.Body)
	}
	var conn e2b.Sandbox
	a.decode(t, &conn)
	if conn.SandboxID != id || conn.EnvdAccessToken != sb.EnvdAccessToken {
		t.Errorf("connect answer %+v", conn)
	}
	if end := time.Until(e2bInfo(t, srv, id).EndAt); end > 21*time.Second || end < 10*time.Second {
		t.Errorf("after a resuming connect with timeout 20 s the end is %v away", end)
	}
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+id+"/connect", nil); a.Status != http.StatusOK {
		t.Errorf("connect of a running sandbox: %d %s, want 200", a.Status, a.Body)
	}
	if end := time.Until(e2bInfo(t, srv, id).EndAt); end < 250*time.Second {
		t.Errorf("after connect (default 300 s) the end is %v away", end)
	}
	// connect never gives an end to a sandbox that had none (one made
	// through torpor's own API without a timeout).
	endless := create(t, srv.Client, apiv1.CreateSandboxRequest{})
	if a := e2bCall(t, srv, "POST", "/v2/sandboxes/"+endless.ID+"/connect", e2b.ConnectRequest{Timeout: i32(3)}); a.Status != http.StatusOK {
		t.Errorf("connect of a running torpor sandbox: %d %s, want 200", a.Status, a.Body)
	}
	if v := get(t, srv.Client, endless.ID); v.TimeoutS != 0 || v.OnTimeout != endless.OnTimeout {
		t.Errorf("after connect a sandbox without a timeout has timeout %d s, on_timeout %s (was %s)", v.TimeoutS, v.OnTimeout, endless.OnTimeout)
	}
	st1, err := workload.Get(ctx, srv.Client, id, "/count")
	if err != nil || st1.Pid != st0.Pid || st1.Count != st0.Count+1 {
		t.Errorf("after pause and connect the server answers %+v (%v), want pid %d count %d", st1, err, st0.Pid, st0.Count+1)
	}
	if got := readFile(t, srv.Client, id, "/home/kept.txt"); string(got) != "kept" {
		t.Errorf("file after pause and connect: %q", got)
	}

	// The port proxy: by host name and by headers; envd wants the token.
	host := fmt.Sprintf("%d-%s.%s", workload.Port, id, e2bDomain)
	for _, hdr := range [][]string{{"Host", host}, {e2b.HeaderSandboxID, id, e2b.HeaderSandboxPort, fmt.Sprint(workload.Port)}} {
		a := e2bCall(t, srv, "GET", "/count", nil, hdr...)
		var st workload.State
		if a.Status != http.StatusOK || json.Unmarshal(a.Body, &st) != nil || st.Pid != st0.Pid {
			t.Errorf("GET /count with %v: %d %s", hdr, a.Status, a.Body)
		}
	}
	noServer := e2bCall(t, srv, "GET", "/", nil, "Host", "9999-"+id+"."+e2bDomain)
	noServer.wantError(t, "a port nothing listens on", http.StatusBadGateway, "no server listens")
	if strings.Contains(string(noServer.Body), "dial") || strings.Contains(string(noServer.Body), "10.") {
		t.Errorf("a port nothing listens on: %s, want no address or instance in the answer (the route takes no key)", noServer.Body)
	}
	e2bCall(t, srv, "GET", "/", nil, "Host", "8080-sbx-000000000000."+e2bDomain).wantError(t, "an unknown sandbox", http.StatusBadGateway, "not found")

	// Snapshot, a sandbox from it, each with its own later writes.
	a = e2bCall(t, srv, "POST", "/sandboxes/"+id+"/snapshots", e2b.SnapshotRequest{Name: "cp-snap"})
	if a.Status != http.StatusCreated {
		t.Fatalf("snapshot: %d %s", a.Status, a.Body)
	}
	var snap e2b.SnapshotInfo
	a.decode(t, &snap)
	if !strings.HasPrefix(snap.SnapshotID, "snap-") || !reflect.DeepEqual(snap.Names, []string{"cp-snap"}) {
		t.Errorf("snapshot answer %+v", snap)
	}
	e2bCall(t, srv, "POST", "/sandboxes/"+id+"/snapshots", e2b.SnapshotRequest{Name: "cp-snap"}).wantError(t, "a taken name", http.StatusConflict, "cp-snap")
	var snaps []e2b.SnapshotInfo
	e2bCall(t, srv, "GET", "/snapshots?sandboxID="+id, nil).decode(t, &snaps)
	if len(snaps) != 1 || snaps[0].SnapshotID != snap.SnapshotID {
		t.Errorf("snapshots of %s: %+v", id, snaps)
	}
	writeFile(t, srv.Client, id, "/home/kept.txt", []byte("source after the snapshot"))
	for _, tmpl := range []string{snap.SnapshotID, "cp-snap"} {
		c := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: tmpl, Metadata: map[string]string{"from": "snap"}})
		if got := readFile(t, srv.Client, c.SandboxID, "/home/kept.txt"); string(got) != "kept" {
			t.Errorf("sandbox from %s reads %q, want the snapshot's", tmpl, got)
		}
		if st, err := workload.Get(ctx, srv.Client, c.SandboxID, "/count"); err != nil || st.Pid != st0.Pid {
			t.Errorf("sandbox from %s: its server %+v %v, want pid %d running", tmpl, st, err, st0.Pid)
		}
		writeFile(t, srv.Client, c.SandboxID, "/home/kept.txt", []byte("clone "+tmpl))
		if got := readFile(t, srv.Client, id, "/home/kept.txt"); string(got) != "source after the snapshot" {
			t.Errorf("the clone's write reached the source: %q", got)
		}
		if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+c.SandboxID, nil); a.Status != http.StatusNoContent {
			t.Errorf("kill clone: %d %s", a.Status, a.Body)
		}
	}
	if a := e2bCall(t, srv, "DELETE", "/templates/"+snap.SnapshotID, nil); a.Status != http.StatusNoContent {
		t.Errorf("delete snapshot: %d %s", a.Status, a.Body)
	}
	e2bCall(t, srv, "DELETE", "/templates/"+snap.SnapshotID, nil).wantError(t, "second delete of the snapshot", http.StatusNotFound)
	e2bCall(t, srv, "POST", "/v2/sandboxes", e2b.NewSandbox{TemplateID: snap.SnapshotID}).wantError(t, "create from a deleted snapshot", http.StatusNotFound, snap.SnapshotID)

	// Fork: two clones, each its own.
	a = e2bCall(t, srv, "POST", "/sandboxes/"+id+"/fork", e2b.ForkRequest{Count: i32(2), Timeout: i32(90)})
	if a.Status != http.StatusCreated {
		t.Fatalf("fork: %d %s", a.Status, a.Body)
	}
	var forks []e2b.ForkResult
	a.decode(t, &forks)
	if len(forks) != 2 {
		t.Fatalf("fork answer %s", a.Body)
	}
	for i, f := range forks {
		if f.Sandbox == nil || f.Sandbox.SandboxID == id || f.Sandbox.EnvdAccessToken == sb.EnvdAccessToken {
			t.Fatalf("fork %d: %+v", i, f)
		}
		fd := e2bInfo(t, srv, f.Sandbox.SandboxID)
		if fd.Metadata["user"] != "abc" || time.Until(fd.EndAt) > 91*time.Second || time.Until(fd.EndAt) < 60*time.Second {
			t.Errorf("fork %d: metadata %v, end in %v", i, fd.Metadata, time.Until(fd.EndAt))
		}
		writeFile(t, srv.Client, f.Sandbox.SandboxID, "/home/kept.txt", []byte(fmt.Sprint("fork ", i)))
	}
	for i, f := range forks {
		if got := readFile(t, srv.Client, f.Sandbox.SandboxID, "/home/kept.txt"); string(got) != fmt.Sprint("fork ", i) {
			t.Errorf("fork %d reads %q", i, got)
		}
	}

	// Metrics of a running sandbox.
	var ms []e2b.Metric
	e2bCall(t, srv, "GET", "/sandboxes/"+id+"/metrics", nil).decode(t, &ms)
	if len(ms) != 1 || ms[0].MemUsed <= 0 || ms[0].MemTotal != 512<<20 || ms[0].CPUCount != 1 || ms[0].CPUUsedPct < 0 {
		t.Errorf("metrics %+v", ms)
	}
	// A window holding now has the sample; one that ended before has none.
	for _, c := range []struct {
		query string
		n     int
	}{{fmt.Sprintf("?start=%d", time.Now().Add(-time.Minute).Unix()), 1}, {fmt.Sprintf("?start=1000&end=%d", time.Now().Add(-time.Minute).Unix()), 0}} {
		var ms []e2b.Metric
		e2bCall(t, srv, "GET", "/sandboxes/"+id+"/metrics"+c.query, nil).decode(t, &ms)
		if len(ms) != c.n {
			t.Errorf("metrics%s: %d samples, want %d", c.query, len(ms), c.n)
		}
	}

	// List: a metadata filter (the SDK's triple encoding), states, three pages.
	q := "metadata=" + url.QueryEscape(url.QueryEscape("user")+"="+url.QueryEscape("abc"))
	var listed []e2b.ListedSandbox
	e2bCall(t, srv, "GET", "/v2/sandboxes?"+q, nil).decode(t, &listed)
	// Newest first: the source, then its two clones, made at one time and
	// so ordered by id.
	want := []string{forks[0].Sandbox.SandboxID, forks[1].Sandbox.SandboxID, id}
	if want[0] < want[1] {
		want[0], want[1] = want[1], want[0]
	}
	if ids := listedIDs(listed); !sameSet(ids, want) {
		t.Errorf("list with metadata user=abc: %v, want %v", ids, want)
	}
	var seen []string
	tok := ""
	for page := 0; page < 4; page++ {
		path := "/v2/sandboxes?limit=1&" + q
		if tok != "" {
			path += "&nextToken=" + url.QueryEscape(tok)
		}
		a := e2bCall(t, srv, "GET", path, nil)
		a.decode(t, &listed)
		seen = append(seen, listedIDs(listed)...)
		if tok = a.Header.Get(e2b.HeaderNextToken); tok == "" {
			break
		}
	}
	if !reflect.DeepEqual(seen, want) {
		t.Errorf("pages of one: %v, want %v (newest first)", seen, want)
	}
	e2bCall(t, srv, "POST", "/sandboxes/"+forks[0].Sandbox.SandboxID+"/pause", nil)
	e2bCall(t, srv, "GET", "/v2/sandboxes?state=paused&"+q, nil).decode(t, &listed)
	if ids := listedIDs(listed); !reflect.DeepEqual(ids, []string{forks[0].Sandbox.SandboxID}) || listed[0].State != e2b.StatePaused {
		t.Errorf("list of paused: %+v", listed)
	}
	var empty []e2b.Metric
	e2bCall(t, srv, "GET", "/sandboxes/"+forks[0].Sandbox.SandboxID+"/metrics", nil).decode(t, &empty)
	if len(empty) != 0 {
		t.Errorf("metrics of a paused sandbox: %+v", empty)
	}

	// Kill twice.
	if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+id, nil); a.Status != http.StatusNoContent {
		t.Errorf("kill: %d %s", a.Status, a.Body)
	}
	e2bCall(t, srv, "DELETE", "/sandboxes/"+id, nil).wantError(t, "second kill", http.StatusNotFound)
	e2bCall(t, srv, "GET", "/sandboxes/"+id, nil).wantError(t, "info after kill", http.StatusNotFound)
}

// TestE2BTimeouts: a sandbox whose timeout runs out is killed; one created
// with autoPause is paused instead and, with autoResume, a request to it wakes
// it with its processes; without autoResume such a request is refused until
// connect.
func TestE2BTimeouts(t *testing.T) {
	srv := startE2B(t, servertest.Options{Lifecycle: true, LifecycleInterval: 200 * time.Millisecond})
	ctx := ctxFor(t, 5*time.Minute)
	kill := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(2)})
	wake := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(6), AutoPause: bptr(true), AutoResume: &e2b.AutoResume{Enabled: true}})
	stay := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(4), AutoPause: bptr(true)})
	if err := workload.Start(ctx, srv.Client, wake.SandboxID, 16); err != nil {
		t.Fatal(err)
	}
	st0, err := workload.Get(ctx, srv.Client, wake.SandboxID, "/count")
	if err != nil {
		t.Fatal(err)
	}
	if d := e2bInfo(t, srv, wake.SandboxID); d.Lifecycle.OnTimeout != e2b.OnTimeoutPause || !d.Lifecycle.AutoResume {
		t.Errorf("lifecycle %+v", d.Lifecycle)
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		k := e2bCall(t, srv, "GET", "/sandboxes/"+kill.SandboxID, nil)
		var w, s e2b.SandboxDetail
		e2bCall(t, srv, "GET", "/sandboxes/"+wake.SandboxID, nil).decode(t, &w)
		e2bCall(t, srv, "GET", "/sandboxes/"+stay.SandboxID, nil).decode(t, &s)
		if k.Status == http.StatusNotFound && w.State == e2b.StatePaused && s.State == e2b.StatePaused &&
			get(t, srv.Client, wake.SandboxID).State == apiv1.StateHibernated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the timeouts: kill %d, wake %s, stay %s", k.Status, w.State, s.State)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// A health probe (the SDKs' isRunning, and their check after pause cut a
	// stream) never wakes it, autoResume or not: 502, still hibernated.
	probe := e2bCall(t, srv, "GET", "/health", nil, e2b.HeaderSandboxID, wake.SandboxID,
		e2b.HeaderSandboxPort, strconv.Itoa(e2b.EnvdPort), e2b.HeaderAccessToken, wake.EnvdAccessToken)
	probe.wantError(t, "GET /health of a paused sandbox with autoResume", http.StatusBadGateway, "paused")
	if st := get(t, srv.Client, wake.SandboxID).State; st != apiv1.StateHibernated {
		t.Errorf("after GET /health: %s, want hibernated (a probe wakes nothing)", st)
	}
	// autoResume: a request wakes it, its server continues.
	a := e2bCall(t, srv, "GET", "/count", nil, "Host", fmt.Sprintf("%d-%s.%s", workload.Port, wake.SandboxID, e2bDomain))
	var st workload.State
	if a.Status != http.StatusOK || json.Unmarshal(a.Body, &st) != nil || st.Pid != st0.Pid || st.Count != st0.Count+1 {
		t.Errorf("request to the paused sandbox: %d %s, want its server (pid %d) to answer count %d", a.Status, a.Body, st0.Pid, st0.Count+1)
	}
	if d := e2bInfo(t, srv, wake.SandboxID); d.State != e2b.StateRunning {
		t.Errorf("after the request: %s, want running", d.State)
	}
	// No autoResume: refused, still paused, until connect.
	e2bCall(t, srv, "GET", "/", nil, "Host", fmt.Sprintf("%d-%s.%s", workload.Port, stay.SandboxID, e2bDomain)).
		wantError(t, "request to a paused sandbox without autoResume", http.StatusBadGateway, "resume")
	if d := e2bInfo(t, srv, stay.SandboxID); d.State != e2b.StatePaused {
		t.Errorf("after the refused request: %s, want paused", d.State)
	}
	if a := e2bCall(t, srv, "POST", "/v2/sandboxes/"+stay.SandboxID+"/connect", nil); a.Status != http.StatusCreated {
		t.Errorf("connect: %d %s", a.Status, a.Body)
	}

	// setTimeout(0) ends the sandbox at once, as in E2B: killed (within the
	// lifecycle's next checks), or paused when it pauses on timeout.
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+stay.SandboxID+"/timeout", e2b.TimeoutRequest{Timeout: i32(0)}); a.Status != http.StatusNoContent {
		t.Fatalf("setTimeout 0: %d %s", a.Status, a.Body)
	}
	late := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(300)})
	t0 := time.Now()
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+late.SandboxID+"/timeout", e2b.TimeoutRequest{Timeout: i32(0)}); a.Status != http.StatusNoContent {
		t.Fatalf("setTimeout 0: %d %s", a.Status, a.Body)
	}
	for {
		var s e2b.SandboxDetail
		k := e2bCall(t, srv, "GET", "/sandboxes/"+late.SandboxID, nil)
		e2bCall(t, srv, "GET", "/sandboxes/"+stay.SandboxID, nil).decode(t, &s)
		if k.Status == http.StatusNotFound && s.State == e2b.StatePaused {
			break
		}
		if time.Since(t0) > 20*time.Second {
			t.Fatalf("%v after setTimeout(0): the kill-on-timeout sandbox answers %d, the pause-on-timeout one is %s", time.Since(t0), k.Status, s.State)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("setTimeout(0) ended the sandbox after %v, want at once", d)
	}
}

func listedIDs(ls []e2b.ListedSandbox) []string {
	var ids []string
	for _, l := range ls {
		ids = append(ids, l.SandboxID)
	}
	return ids
}

func sameSet(a, b []string) bool {
	m := map[string]int{}
	for _, s := range a {
		m[s]++
	}
	for _, s := range b {
		m[s]--
	}
	for _, n := range m {
		if n != 0 {
			return false
		}
	}
	return len(a) == len(b)
}
