package e2e

import (
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/server/servertest"
)

// connectFrames splits a Connect streaming body into its messages: each is
// a flags byte, a 4-byte big-endian length and the message; the last one
// (flags 0x02) is the end of stream.
func connectFrames(t *testing.T, b []byte) (msgs []json.RawMessage, end json.RawMessage) {
	t.Helper()
	for len(b) > 0 {
		if len(b) < 5 {
			t.Fatalf("Connect stream: %d stray bytes %q", len(b), b)
		}
		n := binary.BigEndian.Uint32(b[1:5])
		if uint32(len(b)-5) < n {
			t.Fatalf("Connect stream: frame of %d bytes, %d left", n, len(b)-5)
		}
		m := json.RawMessage(b[5 : 5+n])
		if b[0]&0x02 != 0 {
			end = m
		} else {
			msgs = append(msgs, m)
		}
		b = b[5+n:]
	}
	return msgs, end
}

// connectEnvelope is one Connect streaming request message of v as JSON.
func connectEnvelope(t *testing.T, v any) []byte {
	t.Helper()
	j, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 5, 5+len(j))
	binary.BigEndian.PutUint32(b[1:], uint32(len(j)))
	return append(b, j...)
}

// startEvent is the JSON of a process.StartResponse (protojson names; bytes
// in base64).
type startEvent struct {
	Event struct {
		Start *struct{ Pid uint32 }
		Data  *struct{ Stdout, Stderr []byte }
		End   *struct {
			ExitCode int32
			Exited   bool
			Status   string
		}
	}
}

// TestE2BEnvd drives envd through the E2B front over plain HTTP, as E2B's
// SDKs do: routed by headers or by host name, with the sandbox's
// X-Access-Token, a Connect JSON server stream (process.Process/Start) answers
// start, data and end; /files writes and reads as the user "user" of template
// base (image e2b-base); /health and /envs answer; a path envd does not serve
// is 404; a missing or wrong token is 401.
func TestE2BEnvd(t *testing.T) {
	srv := startE2B(t, servertest.Options{})
	sb := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", EnvVars: map[string]string{"GREETING": "hello envd"}})
	id := sb.SandboxID
	if img := get(t, srv.Client, id).Image; img != "e2b-base" {
		t.Errorf("template base made a sandbox of image %q, want e2b-base", img)
	}
	port := fmt.Sprint(e2b.EnvdPort)
	byHeaders := []string{e2b.HeaderSandboxID, id, e2b.HeaderSandboxPort, port, e2b.HeaderAccessToken, sb.EnvdAccessToken}
	byHost := []string{"Host", port + "-" + id + "." + e2bDomain, e2b.HeaderAccessToken, sb.EnvdAccessToken}

	for _, route := range [][]string{byHeaders, byHost} {
		hdr := append([]string{"Content-Type", "application/connect+json", "Connect-Protocol-Version", "1"}, route...)
		body := connectEnvelope(t, map[string]any{"process": map[string]any{
			"cmd": "/bin/bash", "args": []string{"-l", "-c", `echo out; echo err >&2; id -un; pwd; echo "$GREETING"; exit 3`}}})
		a := e2bCall(t, srv, "POST", "/process.Process/Start", body, hdr...)
		if a.Status != http.StatusOK || a.Header.Get("Content-Type") != "application/connect+json" {
			t.Fatalf("Start via %v: %d %s %s", route[:2], a.Status, a.Header.Get("Content-Type"), a.Body)
		}
		msgs, end := connectFrames(t, a.Body)
		var stdout, stderr strings.Builder
		var pid uint32
		var exit *int32
		for i, m := range msgs {
			var ev startEvent
			if err := json.Unmarshal(m, &ev); err != nil {
				t.Fatalf("event %s: %v", m, err)
			}
			switch e := ev.Event; {
			case e.Start != nil:
				if i != 0 {
					t.Errorf("start event at %d", i)
				}
				pid = e.Start.Pid
			case e.Data != nil:
				stdout.Write(e.Data.Stdout)
				stderr.Write(e.Data.Stderr)
			case e.End != nil:
				if i != len(msgs)-1 || !e.End.Exited {
					t.Errorf("end event %s at %d of %d", m, i, len(msgs))
				}
				exit = &e.End.ExitCode
			}
		}
		if pid == 0 || exit == nil || *exit != 3 || stdout.String() != "out\nuser\n/home/user\nhello envd\n" || stderr.String() != "err\n" {
			t.Errorf("Start via %v: pid %d exit %v stdout %q stderr %q (frames %d)", route[:2], pid, exit, stdout.String(), stderr.String(), len(msgs))
		}
		if string(end) != "{}" {
			t.Errorf("end of stream %s, want {}", end)
		}
	}

	// Files: an upload as the default user, then a download; a missing file is 404.
	data := []byte("written through the front\n")
	a := e2bCall(t, srv, "POST", "/files?path=notes/front.txt", data, append([]string{"Content-Type", "application/octet-stream"}, byHeaders...)...)
	var written []struct{ Path, Name, Type string }
	if a.Status != http.StatusOK || json.Unmarshal(a.Body, &written) != nil || len(written) != 1 || written[0].Path != "/home/user/notes/front.txt" {
		t.Errorf("POST /files: %d %s", a.Status, a.Body)
	}
	if got := sh(t, srv.Client, id, "stat -c %U /home/user/notes/front.txt; cat /home/user/notes/front.txt"); got != "user\n"+string(data) {
		t.Errorf("the uploaded file: %q", got)
	}
	if a := e2bCall(t, srv, "GET", "/files?path=/home/user/notes/front.txt", nil, byHost...); a.Status != http.StatusOK || !bytes.Equal(a.Body, data) {
		t.Errorf("GET /files: %d %q", a.Status, a.Body)
	}
	// A client on this host gets the file unencoded even when it accepts gzip
	// (Node's fetch always asks); one behind a proxy gets gzip, as from E2B.
	gz := []string{"Accept-Encoding", "gzip, deflate"}
	if a := e2bCall(t, srv, "GET", "/files?path=/home/user/notes/front.txt", nil, append(gz, byHeaders...)...); a.Status != http.StatusOK ||
		a.Header.Get("Content-Encoding") != "" || !bytes.Equal(a.Body, data) {
		t.Errorf("GET /files from this host accepting gzip: %d %q, encoding %q; want it unencoded", a.Status, a.Body, a.Header.Get("Content-Encoding"))
	}
	a = e2bCall(t, srv, "GET", "/files?path=/home/user/notes/front.txt", nil, append(append(gz, "X-Forwarded-For", "203.0.113.7"), byHeaders...)...)
	if zr, err := gzip.NewReader(bytes.NewReader(a.Body)); a.Status != http.StatusOK || a.Header.Get("Content-Encoding") != "gzip" || err != nil {
		t.Errorf("GET /files through a proxy accepting gzip: %d, encoding %q (%v); want gzip", a.Status, a.Header.Get("Content-Encoding"), err)
	} else if b, err := io.ReadAll(zr); err != nil || !bytes.Equal(b, data) {
		t.Errorf("the gzip answer decodes to %q, %v", b, err)
	}
	root := "Basic " + base64.StdEncoding.EncodeToString([]byte("root:"))
	if a := e2bCall(t, srv, "GET", "/files?path=front.txt", nil, append([]string{"Authorization", root}, byHeaders...)...); a.Status != http.StatusNotFound {
		t.Errorf("GET /files of root's missing ~/front.txt: %d %s, want 404", a.Status, a.Body)
	}

	// /health, /envs, and a path envd does not serve.
	if a := e2bCall(t, srv, "GET", "/health", nil, byHeaders...); a.Status != http.StatusNoContent {
		t.Errorf("GET /health: %d %s", a.Status, a.Body)
	}
	var env map[string]string
	if a := e2bCall(t, srv, "GET", "/envs", nil, byHeaders...); a.Status != http.StatusOK || json.Unmarshal(a.Body, &env) != nil || env["GREETING"] != "hello envd" {
		t.Errorf("GET /envs: %d %s", a.Status, a.Body)
	}
	if a := e2bCall(t, srv, "GET", "/nothing", nil, byHeaders...); a.Status != http.StatusNotFound {
		t.Errorf("GET /nothing: %d %s, want 404", a.Status, a.Body)
	}

	// The token: missing, another sandbox's, a wrong one.
	other := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base"})
	for _, tok := range []string{"", other.EnvdAccessToken, strings.Repeat("0", 64)} {
		e2bCall(t, srv, "GET", "/health", nil, e2b.HeaderSandboxID, id, e2b.HeaderSandboxPort, port, e2b.HeaderAccessToken, tok).
			wantError(t, fmt.Sprintf("envd with token %q", tok), http.StatusUnauthorized, e2b.HeaderAccessToken)
	}

	// No agent connection is left open once the answers are done: a hibernate
	// does not wait for its drain.
	t0 := time.Now()
	hibernate(t, srv.Client, id)
	if d := time.Since(t0); d > 8*time.Second {
		t.Errorf("hibernate after envd requests took %v: an agent connection held its drain?", d)
	}
}

// TestE2BEnvdOldAgent: a sandbox whose guest agent predates envd (built from
// the repository's history, as TestResumeOldestAgentSnapshot does) answers
// envd requests through the front at once with 501 and the reason; the port
// proxy and torpor's API still reach it.
func TestE2BEnvdOldAgent(t *testing.T) {
	oldAgent := buildAgentAt(t, oldestAgentCommit)
	srv := startE2B(t, servertest.Options{AgentPath: oldAgent})
	sb := create(t, srv.Client, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if v := agentVersion(t, srv, sb.ID); v >= proto.EnvdMinVersion {
		t.Fatalf("agent of commit %s speaks protocol version %d", oldestAgentCommit, v)
	}
	tok := e2bInfo(t, srv, sb.ID).EnvdAccessToken
	for _, path := range []string{"/health", "/files?path=/etc/hostname"} {
		t0 := time.Now()
		e2bCall(t, srv, "GET", path, nil, e2b.HeaderSandboxID, sb.ID, e2b.HeaderSandboxPort, fmt.Sprint(e2b.EnvdPort), e2b.HeaderAccessToken, tok).
			wantError(t, "envd of an old agent: "+path, http.StatusNotImplemented, "predates")
		if d := time.Since(t0); d > 5*time.Second {
			t.Errorf("%s: refused after %v, want at once", path, d)
		}
	}
	if out := sh(t, srv.Client, sb.ID, "echo still"); out != "still\n" {
		t.Errorf("exec through torpor's API: %q", out)
	}
}

// TestE2BEnvdRefused: a call of envd's RPC services that the front refuses
// (a wrong token, a sandbox paused without autoResume, a killed one) is
// answered in the Connect protocol, as connect-web reads it: a server stream
// (JSON or binary codec) with 200 and an end-of-stream error, a unary call
// with {"code": "<connect code>", "message"} and the code's HTTP status. The
// plain-HTTP paths keep E2B's {"code": <status>} (502 for /health of a
// sandbox not running: the SDKs' isRunning is false).
func TestE2BEnvdRefused(t *testing.T) {
	srv := startE2B(t, servertest.Options{})
	paused := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base"})
	killed := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base"})
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+paused.SandboxID+"/pause", nil); a.Status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", a.Status, a.Body)
	}
	if a := e2bCall(t, srv, "DELETE", "/sandboxes/"+killed.SandboxID, nil); a.Status != http.StatusNoContent {
		t.Fatalf("kill: %d %s", a.Status, a.Body)
	}
	route := func(sb e2b.Sandbox, token string, hdr ...string) []string {
		return append([]string{e2b.HeaderSandboxID, sb.SandboxID, e2b.HeaderSandboxPort, fmt.Sprint(e2b.EnvdPort),
			e2b.HeaderAccessToken, token, "Connect-Protocol-Version", "1"}, hdr...)
	}
	start := connectEnvelope(t, map[string]any{"process": map[string]any{"cmd": "/bin/true"}})
	for _, c := range []struct {
		what  string
		hdr   []string
		code  string
		words []string
	}{
		{"a wrong token", route(paused, strings.Repeat("0", 64)), "unauthenticated", []string{e2b.HeaderAccessToken}},
		{"a paused sandbox", route(paused, paused.EnvdAccessToken), "failed_precondition", []string{"paused", "autoResume"}},
		{"a killed sandbox", route(killed, killed.EnvdAccessToken), "unavailable", []string{killed.SandboxID}},
	} {
		for _, ctype := range []string{"application/connect+json", "application/connect+proto"} {
			body := start
			if ctype == "application/connect+proto" {
				body = []byte{0, 0, 0, 0, 0} // an empty StartRequest
			}
			a := e2bCall(t, srv, "POST", "/process.Process/Start", body, append([]string{"Content-Type", ctype}, c.hdr...)...)
			if a.Status != http.StatusOK || a.Header.Get("Content-Type") != ctype {
				t.Errorf("Start (%s) to %s: %d %s %s, want 200 %s", ctype, c.what, a.Status, a.Header.Get("Content-Type"), a.Body, ctype)
				continue
			}
			msgs, end := connectFrames(t, a.Body)
			var eos struct {
				Error *struct{ Code, Message string }
			}
			if len(msgs) != 0 || json.Unmarshal(end, &eos) != nil || eos.Error == nil || eos.Error.Code != c.code {
				t.Errorf("Start (%s) to %s: %d messages, end of stream %s; want only an end of stream with error %s", ctype, c.what, len(msgs), end, c.code)
				continue
			}
			for _, w := range c.words {
				if !strings.Contains(eos.Error.Message, w) {
					t.Errorf("Start (%s) to %s: message %q does not name %q", ctype, c.what, eos.Error.Message, w)
				}
			}
		}
		a := e2bCall(t, srv, "POST", "/process.Process/List", []byte("{}"), append([]string{"Content-Type", "application/json"}, c.hdr...)...)
		var e struct{ Code, Message string }
		if json.Unmarshal(a.Body, &e) != nil || e.Code != c.code || a.Status != connectHTTPStatus[c.code] ||
			a.Header.Get("Content-Type") != "application/json" {
			t.Errorf("List (unary) to %s: %d %s %s, want %d {code: %s}", c.what, a.Status, a.Header.Get("Content-Type"), a.Body, connectHTTPStatus[c.code], c.code)
		}
	}
	// Plain HTTP keeps E2B's form: /health of a sandbox not running is 502.
	for _, sb := range []e2b.Sandbox{paused, killed} {
		e2bCall(t, srv, "GET", "/health", nil, route(sb, sb.EnvdAccessToken)...).wantError(t, "/health of "+sb.SandboxID, http.StatusBadGateway, sb.SandboxID)
	}
	if d := e2bInfo(t, srv, paused.SandboxID); d.State != e2b.StatePaused {
		t.Errorf("the refused calls woke the paused sandbox: %s", d.State)
	}
}

// connectHTTPStatus is the HTTP status of a Connect unary error by its code
// (connectrpc.com/docs/protocol, the codes TestE2BEnvdRefused meets).
var connectHTTPStatus = map[string]int{"unauthenticated": 401, "failed_precondition": 400, "unavailable": 503}

// TestE2BEnvdPauseAfterBurst: envd's requests through the front keep their
// agent connections open, idle, for the next ones; a pause (E2B's) right after
// a burst of concurrent uploads, downloads and health checks, and a hibernate
// (torpor's) after a second burst, each return within a fraction of the
// hibernate's drain (manager.HibernateDrain), which no idle connection holds,
// and after each resume the files of the burst are there.
func TestE2BEnvdPauseAfterBurst(t *testing.T) {
	srv := startE2B(t, servertest.Options{})
	sb := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base"})
	id := sb.SandboxID
	const workers, rounds = 6, 4
	content := func(burst, w int) string { return fmt.Sprintf("burst %d, worker %d\n", burst, w) }
	file := func(w int) string { return fmt.Sprintf("/files?path=/tmp/burst-%d", w) }
	// envd sends one request through the front; it may run in any goroutine.
	envd := func(method, target, body string) (int, string) {
		var r io.Reader
		if body != "" {
			r = strings.NewReader(body)
		}
		req, err := http.NewRequestWithContext(ctxFor(t, time.Minute), method, srv.URL+target, r)
		if err != nil {
			t.Error(err)
			return 0, ""
		}
		req.Header.Set(e2b.HeaderSandboxID, id)
		req.Header.Set(e2b.HeaderSandboxPort, fmt.Sprint(e2b.EnvdPort))
		req.Header.Set(e2b.HeaderAccessToken, sb.EnvdAccessToken)
		if body != "" {
			req.Header.Set("Content-Type", "application/octet-stream")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Errorf("%s %s: %v", method, target, err)
			return 0, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	burst := func(n int) {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range rounds {
					if st, b := envd("POST", file(w), content(n, w)); st != http.StatusOK {
						t.Errorf("burst %d: POST %s: %d %s", n, file(w), st, b)
					}
					if st, b := envd("GET", file(w), ""); st != http.StatusOK || b != content(n, w) {
						t.Errorf("burst %d: GET %s: %d %q", n, file(w), st, b)
					}
					if st, b := envd("GET", "/health", ""); st != http.StatusNoContent {
						t.Errorf("burst %d: GET /health: %d %s", n, st, b)
					}
				}
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
	}
	check := func(n int, after string) {
		for w := range workers {
			if st, b := envd("GET", file(w), ""); st != http.StatusOK || b != content(n, w) {
				t.Errorf("GET %s after the %s: %d %q, want %q", file(w), after, st, b, content(n, w))
			}
		}
	}
	prompt := func(what string, d time.Duration) {
		if d > manager.HibernateDrain/2 {
			t.Errorf("%s right after a burst of envd requests took %v: an idle envd connection held its drain (%v)", what, d, manager.HibernateDrain)
		}
	}

	burst(1)
	t0 := time.Now()
	if a := e2bCall(t, srv, "POST", "/sandboxes/"+id+"/pause", nil); a.Status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", a.Status, a.Body)
	}
	prompt("pause", time.Since(t0))
	if d := e2bInfo(t, srv, id); d.State != e2b.StatePaused {
		t.Fatalf("state %s after the pause", d.State)
	}
	if a := e2bCall(t, srv, "POST", "/v2/sandboxes/"+id+"/connect", e2b.ConnectRequest{Timeout: i32(300)}); a.Status/100 != 2 {
		t.Fatalf("connect: %d %s", a.Status, a.Body)
	}
	check(1, "pause and connect")

	burst(2)
	t0 = time.Now()
	hibernate(t, srv.Client, id)
	prompt("hibernate", time.Since(t0))
	if _, err := srv.Client.Resume(ctxFor(t, time.Minute), id); err != nil {
		t.Fatal(err)
	}
	check(2, "hibernate and resume")
}
