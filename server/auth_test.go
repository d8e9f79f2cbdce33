package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/server"
)

func TestResolveAuth(t *testing.T) {
	for _, c := range []struct {
		mode     server.AuthMode
		listen   string
		required bool
		refused  bool
	}{
		{server.AuthAuto, "", false, false},
		{server.AuthAuto, "127.0.0.1:7070", false, false},
		{"", "127.0.0.1:7070", false, false},
		{server.AuthAuto, "127.9.9.9:1", false, false},
		{server.AuthAuto, "[::1]:7070", false, false},
		{server.AuthAuto, "localhost:7070", false, false},
		{server.AuthAuto, "0.0.0.0:7070", true, false},
		{server.AuthAuto, ":7070", true, false},
		{server.AuthAuto, "[::]:7070", true, false},
		{server.AuthAuto, "10.1.2.3:7070", true, false},
		{server.AuthAuto, "myhost:7070", true, false},
		{server.AuthRequired, "127.0.0.1:7070", true, false},
		{server.AuthRequired, "0.0.0.0:7070", true, false},
		{server.AuthNone, "127.0.0.1:7070", false, false},
		{server.AuthNone, "0.0.0.0:7070", false, true},
		{server.AuthNone, ":7070", false, true},
		{server.AuthNone, "192.168.1.5:7070", false, true},
		{"sometimes", "127.0.0.1:7070", false, true},
	} {
		required, err := server.ResolveAuth(c.mode, c.listen)
		if (err != nil) != c.refused || required != c.required {
			t.Errorf("ResolveAuth(%q, %q) = %v, %v; want required %v, refused %v", c.mode, c.listen, required, err, c.required, c.refused)
		}
		if c.mode == server.AuthNone && err != nil && !strings.Contains(err.Error(), "--auth required") {
			t.Errorf("the refusal does not say what to do: %v", err)
		}
	}
}

// lockedBuffer is a log the server writes from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// authServer is a server with keys required on the fake engine (no root, no
// runsc), served over real HTTP on loopback, with image "tiny".
type authServer struct {
	srv    *server.Server
	url    string
	dir    string
	eng    *fake.Engine
	log    *lockedBuffer
	key    string
	keyID  string
	client *client.Client
}

func startAuthServer(t *testing.T) *authServer {
	t.Helper()
	logs := &lockedBuffer{}
	srv, url, dir, eng := startFake(t, server.Config{Auth: server.AuthRequired, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if !srv.AuthRequired {
		t.Fatal("Auth required did not require keys")
	}
	a := &authServer{srv: srv, url: url, dir: dir, eng: eng, log: logs}
	if !strings.Contains(logs.String(), "there is none") {
		t.Errorf("no warning that no key exists:\n%s", logs.String())
	}
	ctx := context.Background()
	key, rec, err := apikey.Create(ctx, srv.Keys(), "test", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	a.key, a.keyID = key, rec.ID
	a.client = client.New(url)
	a.client.APIKey = key
	return a
}

// startFake is server.StartFake (fakeserver_test.go).
func startFake(t *testing.T, cfg server.Config) (*server.Server, string, string, *fake.Engine) {
	t.Helper()
	return server.StartFake(t, cfg)
}

// do sends method path with the Authorization header auth ("" = none) from
// 127.0.0.1.
func (a *authServer) do(t *testing.T, method, path, auth string) (*http.Response, string) {
	return a.doFrom(t, 1, method, path, auth)
}

// doFrom is do from the loopback address 127.0.0.<from>: refusals are
// counted per address, so tests that make many spread them.
func (a *authServer) doFrom(t *testing.T, from int, method, path, auth string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, a.url+path, nil)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	local := &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(from))}
	hc := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{LocalAddr: local}).DialContext}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestAuthRequired: with keys required, every REST v1 call, the port proxy
// and /metrics answer 401 in the API's error shape without a key or with a
// wrong one, and /healthz stays open; the right key is admitted; a refusal
// says only that the key is missing or wrong.
func TestAuthRequired(t *testing.T) {
	a := startAuthServer(t)
	wrong, _ := apikey.Generate()
	paths := []string{"/v1/sandboxes", "/v1/sandboxes/sbx-none", "/v1/images", "/v1/snapshots", "/v1/store", "/v1/volumes", "/v1/nodes",
		"/v1/openapi.json", "/v1/sandboxes/sbx-none/ports/8080/x", "/v1/no-such-route", "/metrics"}
	for i, p := range paths {
		for _, auth := range []string{"", "Bearer " + wrong, "Bearer not-a-key", "Basic " + a.key, a.key} {
			resp, body := a.doFrom(t, 10+i, "GET", p, auth) // 5 refusals per address, fewer than its burst
			var eb apiv1.ErrorBody
			if resp.StatusCode != 401 || json.Unmarshal([]byte(body), &eb) != nil || eb.Error.Code != apiv1.CodeUnauthenticated {
				t.Errorf("GET %s with %q: %d %s, want 401 unauthenticated", p, auth, resp.StatusCode, body)
				continue
			}
			if !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
				t.Errorf("GET %s: WWW-Authenticate %q", p, resp.Header.Get("WWW-Authenticate"))
			}
			if want := map[bool]string{true: "missing API key: send Authorization: Bearer <key>", false: "invalid API key"}[apikey.FromBearer(&http.Request{Header: http.Header{"Authorization": {auth}}}) == ""]; eb.Error.Message != want {
				t.Errorf("GET %s with %q: message %q, want %q", p, auth, eb.Error.Message, want)
			}
		}
	}
	if resp, body := a.doFrom(t, 2, "DELETE", "/v1/sandboxes/sbx-none", ""); resp.StatusCode != 401 {
		t.Errorf("DELETE without a key: %d %s", resp.StatusCode, body)
	}
	if resp, body := a.do(t, "GET", "/healthz", ""); resp.StatusCode != 200 || !strings.Contains(body, "true") {
		t.Errorf("/healthz without a key: %d %s", resp.StatusCode, body)
	}
	for p, want := range map[string]int{"/v1/sandboxes": 200, "/v1/images": 200, "/v1/sandboxes/sbx-none": 404, "/v1/openapi.json": 200,
		"/v1/sandboxes/sbx-none/ports/8080/x": 404, "/metrics": 200} {
		if resp, body := a.do(t, "GET", p, "Bearer "+a.key); resp.StatusCode != want {
			t.Errorf("GET %s with the key: %d %s, want %d", p, resp.StatusCode, body, want)
		}
		if resp, _ := a.do(t, "GET", p, "bearer "+a.key); resp.StatusCode != want {
			t.Errorf("GET %s with the key, scheme in lower case: %d", p, resp.StatusCode)
		}
	}
	if resp, body := a.do(t, "GET", "/metrics", "Bearer "+a.key); !strings.Contains(body, "torpor_sandboxes") {
		t.Errorf("/metrics with the key: %d, no torpor metrics", resp.StatusCode)
	}
	// The log names refusals by address, never with a key past its prefix.
	logs := a.log.String()
	if !strings.Contains(logs, "api key refused") || !strings.Contains(logs, "addr=127.0.0.10 ") || !strings.Contains(logs, "prefix="+wrong[:12]) {
		t.Errorf("refusals not logged with the address and prefix:\n%s", logs)
	}
	if strings.Contains(logs, wrong[12:]) || strings.Contains(logs, a.key[12:]) {
		t.Errorf("the log shows key material:\n%s", logs)
	}
}

// TestAuthSandboxAndProxy: with the key, the client creates a sandbox and
// runs a command in it; the port proxy admits the key and does not pass it on
// to the sandbox.
func TestAuthSandboxAndProxy(t *testing.T) {
	a := startAuthServer(t)
	ctx := context.Background()
	sb, err := a.client.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "tiny"})
	if err != nil {
		t.Fatalf("create with the key: %v", err)
	}
	stdout, _, code, err := a.client.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"echo", "keyed"}})
	if err != nil || strings.TrimSpace(string(stdout)) != "keyed" || code != 0 {
		t.Fatalf("exec with the key: %q %d %v", stdout, code, err)
	}
	keyless := client.New(a.url)
	keyless.APIKey = ""
	if _, err := keyless.GetSandbox(ctx, sb.ID); !client.IsUnauthenticated(err) {
		t.Errorf("get without a key: %v, want unauthenticated", err)
	}

	infos, err := a.eng.List(ctx)
	if err != nil || len(infos) != 1 {
		t.Fatalf("instances: %+v %v", infos, err)
	}
	ln, err := a.eng.Listen(infos[0].ID, 8080)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan http.Header, 1)
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		fmt.Fprint(w, "from the sandbox")
	}))
	resp, err := a.client.Do(ctx, "GET", "/v1/sandboxes/"+sb.ID+"/ports/8080/hello", nil, http.Header{"X-Mine": {"1"}})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "from the sandbox" {
		t.Fatalf("proxy with the key: %d %s", resp.StatusCode, body)
	}
	h := <-seen
	if h.Get("Authorization") != "" || h.Get("X-Mine") != "1" {
		t.Errorf("the sandbox saw headers %v: want X-Mine and no Authorization", h)
	}
	if resp, _ := a.do(t, "GET", "/v1/sandboxes/"+sb.ID+"/ports/8080/hello", ""); resp.StatusCode != 401 {
		t.Errorf("proxy without a key: %d", resp.StatusCode)
	}
	if err := a.client.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}

// TestAuthRevocation: a key removed from the database by another process
// (as `torpor key rm` does) is refused by the next call, and a key made the
// same way works at once.
func TestAuthRevocation(t *testing.T) {
	a := startAuthServer(t)
	ctx := context.Background()
	if _, err := a.client.ListSandboxes(ctx); err != nil {
		t.Fatalf("with the key: %v", err)
	}
	other, err := sqlite.Open(filepath.Join(a.dir, "torpor.db")) // a second connection, as the CLI opens
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	fresh, _, err := apikey.Create(ctx, other, "fresh", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if resp, body := a.do(t, "GET", "/v1/sandboxes", "Bearer "+fresh); resp.StatusCode != 200 {
		t.Errorf("a key made by another connection: %d %s", resp.StatusCode, body)
	}
	if err := other.DeleteAPIKey(ctx, a.keyID); err != nil {
		t.Fatal(err)
	}
	if _, err := a.client.ListSandboxes(ctx); !client.IsUnauthenticated(err) {
		t.Fatalf("the call right after the removal: %v, want 401", err)
	}
	if resp, _ := a.do(t, "GET", "/v1/sandboxes", "Bearer "+fresh); resp.StatusCode != 200 {
		t.Errorf("the other key after the removal: %d", resp.StatusCode)
	}
}

// TestAuthRateLimited: an address that keeps presenting wrong keys gets 429
// with Retry-After for them; a good key from it is still admitted.
func TestAuthRateLimited(t *testing.T) {
	a := startAuthServer(t)
	wrong, _ := apikey.Generate()
	var last *http.Response
	for i := 0; i < 20; i++ {
		last, _ = a.do(t, "GET", "/v1/sandboxes", "Bearer "+wrong)
		if last.StatusCode == 429 {
			break
		}
	}
	if last.StatusCode != 429 || last.Header.Get("Retry-After") == "" {
		t.Fatalf("20 wrong keys: last answer %d, Retry-After %q; want 429 with Retry-After", last.StatusCode, last.Header.Get("Retry-After"))
	}
	resp, body := a.do(t, "GET", "/v1/sandboxes", "Bearer "+wrong)
	var eb apiv1.ErrorBody
	if resp.StatusCode != 429 || json.Unmarshal([]byte(body), &eb) != nil || eb.Error.Code != apiv1.CodeRateLimited {
		t.Fatalf("a wrong key from the limited address: %d %s, want 429 rate_limited", resp.StatusCode, body)
	}
	// Only failed attempts are throttled: the good key passes.
	if resp, body := a.do(t, "GET", "/v1/sandboxes", "Bearer "+a.key); resp.StatusCode != 200 {
		t.Fatalf("the good key from the limited address: %d %s, want 200", resp.StatusCode, body)
	}
	if resp, _ := a.do(t, "GET", "/healthz", ""); resp.StatusCode != 200 {
		t.Errorf("/healthz from the limited address: %d", resp.StatusCode)
	}
}
