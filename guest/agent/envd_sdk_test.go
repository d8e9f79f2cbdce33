package agent_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/e2e/e2bsdk"
	"github.com/torpor/torpor/guest/agentclient"
)

// sdkFront stands in for torpor's E2B front: it answers create and kill, and
// forwards every in-sandbox request for envd to the agent through
// agentclient.EnvdTransport (which applies proto.EnvdPath).
func sdkFront(t *testing.T, a *envdAgent) *httptest.Server {
	tr := agentclient.NewEnvdTransport(agentclient.TCPDialer(a.addr))
	t.Cleanup(tr.CloseIdleConnections)
	proxy := &httputil.ReverseProxy{Transport: tr, FlushInterval: -1,
		Rewrite: func(r *httputil.ProxyRequest) { r.Out.URL.Scheme, r.Out.URL.Host = "http", "agent" }}
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == "POST" && (r.URL.Path == "/v2/sandboxes" || r.URL.Path == "/sandboxes"):
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(201)
			json.NewEncoder(w).Encode(e2b.Sandbox{TemplateID: "base", SandboxID: "sbx-agent", ClientID: e2b.ClientID,
				EnvdVersion: e2b.EnvdVersion, EnvdAccessToken: "token"})
		case r.Method == "DELETE" && strings.HasPrefix(r.URL.Path, "/sandboxes/"):
			w.WriteHeader(204)
		default:
			if route, ok, _ := e2b.RouteOf(r.Header, r.Host, ""); !ok || route.Port != e2b.EnvdPort {
				http.Error(w, "not envd", 404)
				return
			}
			proxy.ServeHTTP(w, r)
		}
	}))
}

// TestEnvdSDK runs E2B's real SDK, each pinned version, against the agent:
// commands (cwd, envs, a failure, background, list, kill, stdin), files
// (write, read, makeDir, list with depth, exists, a missing file) and a PTY.
func TestEnvdSDK(t *testing.T) {
	node := e2bsdk.Node(t)
	a := startEnvd(t, "")
	front := sdkFront(t, a)
	defer front.Close()
	for pkg, version := range e2bsdk.Packages {
		t.Run(version, func(t *testing.T) {
			dir := t.TempDir()
			cmd := exec.Command(node, filepath.Join("testdata", "sdk_agent.mjs"), e2bsdk.Module(pkg), dir)
			cmd.Env = append(os.Environ(), "E2B_API_URL="+front.URL, "E2B_SANDBOX_URL="+front.URL, "E2B_API_KEY=e2b_00ff")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("sdk_agent.mjs: %v\n%s\nagent log:\n%s", err, stderr.String(), a.log.String())
			}
			var got map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("sdk_agent.mjs printed %q: %v", out, err)
			}
			want := map[string]any{
				"run":           map[string]any{"stdout": "hi from " + dir + "\n", "stderr": "oops\n", "exitCode": 0.0},
				"failed":        map[string]any{"name": "CommandExitError", "exitCode": 3.0},
				"list":          []any{map[string]any{"cmd": "/bin/bash", "args": []any{"-l", "-c", "sleep 30"}}},
				"kill":          true,
				"killedEnd":     map[string]any{"name": "CommandExitError", "exitCode": -1.0, "error": "signal: killed"},
				"killAgain":     false,
				"stdin":         "piped\n",
				"written":       map[string]any{"path": dir + "/sub/hello.txt", "name": "hello.txt"},
				"read":          "hello from the sdk",
				"made":          true,
				"madeAgain":     false,
				"list2":         []any{"made:dir", "sub/hello.txt:file", "sub:dir"},
				"exists":        true,
				"existsMissing": false,
				"readMissing":   "FileNotFoundError",
				"pty":           true,
			}
			if m, ok := got["failedMessage"]; ok {
				t.Logf("failed: %v", m)
			}
			for k, w := range want {
				if !reflect.DeepEqual(got[k], w) {
					t.Errorf("%s: SDK read %#v, want %#v", k, got[k], w)
				}
			}
		})
	}
}
