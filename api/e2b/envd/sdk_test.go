package envd

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
	"github.com/torpor/torpor/e2e/e2bsdk"
)

// sandboxFront is what torpor's E2B front will do in the small: answer a create with a
// sandbox id and access token (api/e2b wire types), and pass in-sandbox requests to
// envd only when they name that sandbox and envd's port and carry its token.
type sandboxFront struct {
	t     *testing.T
	envd  http.Handler
	mu    sync.Mutex
	kills []string
}

const (
	frontSandboxID = "sbx-smoke"
	frontToken     = "envd-token-smoke"
)

func (s *sandboxFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	writeJSON := func(status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(v)
	}
	switch {
	case r.Method == "POST" && (r.URL.Path == "/v2/sandboxes" || r.URL.Path == "/sandboxes"):
		var req e2b.NewSandbox
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			writeJSON(400, e2b.Error{Code: 400, Message: err.Error()})
			return
		}
		writeJSON(201, e2b.Sandbox{TemplateID: req.TemplateID, SandboxID: frontSandboxID, ClientID: e2b.ClientID,
			EnvdVersion: e2b.EnvdVersion, EnvdAccessToken: frontToken})
		return
	case r.Method == "DELETE" && strings.HasPrefix(r.URL.Path, "/sandboxes/"):
		s.mu.Lock()
		s.kills = append(s.kills, strings.TrimPrefix(r.URL.Path, "/sandboxes/"))
		s.mu.Unlock()
		w.WriteHeader(204)
		return
	}
	route, ok, err := e2b.RouteOf(r.Header, r.Host, "")
	if err != nil || !ok || route != (e2b.Route{SandboxID: frontSandboxID, Port: e2b.EnvdPort}) {
		s.t.Errorf("%s %s routed to %+v, %v, %v; want %s port %d", r.Method, r.URL.Path, route, ok, err, frontSandboxID, e2b.EnvdPort)
		http.Error(w, "no such sandbox", 404)
		return
	}
	if got := r.Header.Get(e2b.HeaderAccessToken); got != frontToken {
		s.t.Errorf("%s %s carried %s %q, want %q", r.Method, r.URL.Path, e2b.HeaderAccessToken, got, frontToken)
		http.Error(w, "bad access token", 401)
		return
	}
	s.envd.ServeHTTP(w, r)
}

// sdkEnvdResult is what testdata/sdk_envd.mjs prints.
type sdkEnvdResult struct {
	SandboxID string
	Run       struct {
		Stdout, Stderr string
		ExitCode       int
	}
	Failed struct {
		Name     string
		ExitCode int
	}
	Background struct{ Pid uint32 }
	List       []struct {
		Pid  uint32
		Cmd  string
		Args []string
	}
	Kill, KillAgain bool
	KilledEnd       struct {
		Name     string
		ExitCode int
	}
	Info struct {
		Name, Type, Path, Permissions, Owner, Group, ModifiedTime string
		Size                                                      int64
		Mode                                                      uint32
	}
	Exists, ExistsMissing bool
	InfoMissing           string
}

// TestSDKDrivesEnvd runs E2B's real SDK, each pinned version, against the fake envd
// behind a stand-in front (E2B_API_URL and E2B_SANDBOX_URL both at it): commands.run
// with cwd, envs and a user, a failing command, a background command listed and
// killed, files.getInfo and files.exists. It checks what the SDK read and what the
// server decoded and received (routing headers, access token, Connect headers).
func TestSDKDrivesEnvd(t *testing.T) {
	node := e2bsdk.Node(t)
	if _, err := os.Stat("/bin/bash"); err != nil {
		t.Skip("no /bin/bash: the SDK's commands.run runs /bin/bash -l -c")
	}
	for pkg, version := range e2bsdk.Packages {
		t.Run(version, func(t *testing.T) {
			f := newFakeEnvd(t)
			front := &sandboxFront{t: t, envd: f.handler()}
			srv := httptest.NewServer(front)
			defer srv.Close()
			dir := t.TempDir()
			file := writeFile(t, dir, "report.csv", 4321)
			cmd := exec.Command(node, filepath.Join("testdata", "sdk_envd.mjs"), e2bsdk.Module(pkg), dir, file)
			cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "E2B_API_KEY=e2b_00ff")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("sdk_envd.mjs: %v\n%s", err, stderr.String())
			}
			var got sdkEnvdResult
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("sdk_envd.mjs printed %q: %v", out, err)
			}

			if want := "hi from " + dir + "\n"; got.Run.Stdout != want || got.Run.Stderr != "oops\n" || got.Run.ExitCode != 0 {
				t.Errorf("commands.run read %+v, want stdout %q stderr oops", got.Run, want)
			}
			if got.Failed.Name != "CommandExitError" || got.Failed.ExitCode != 3 {
				t.Errorf("run(exit 3) threw %+v, want CommandExitError with exit code 3", got.Failed)
			}
			if len(got.List) != 1 || got.List[0].Pid != got.Background.Pid || got.List[0].Cmd != "/bin/bash" ||
				!reflect.DeepEqual(got.List[0].Args, []string{"-l", "-c", "sleep 30"}) {
				t.Errorf("commands.list read %+v, want only the background pid %d", got.List, got.Background.Pid)
			}
			if !got.Kill || got.KillAgain {
				t.Errorf("kill = %v, kill again = %v; want true, false (not_found)", got.Kill, got.KillAgain)
			}
			if got.KilledEnd.Name != "CommandExitError" {
				t.Errorf("wait() on the killed command: %+v, want CommandExitError", got.KilledEnd)
			}
			fi, _ := os.Stat(file)
			if i := got.Info; i.Name != "report.csv" || i.Type != "file" || i.Path != file || i.Size != 4321 || i.Mode != 0o640 ||
				i.Permissions != "-rw-r-----" || i.Owner == "" || i.ModifiedTime != fi.ModTime().UTC().Truncate(time.Millisecond).Format("2006-01-02T15:04:05.000Z") {
				t.Errorf("files.getInfo read %+v", i)
			}
			if !got.Exists || got.ExistsMissing || got.InfoMissing != "FileNotFoundError" {
				t.Errorf("exists %v, exists(missing) %v, getInfo(missing) %s; want true, false, FileNotFoundError",
					got.Exists, got.ExistsMissing, got.InfoMissing)
			}
			if !reflect.DeepEqual(front.kills, []string{frontSandboxID}) {
				t.Errorf("sandbox.kill() sent DELETE for %v", front.kills)
			}

			// What the server decoded and received.
			starts := f.callsOf(processconnect.ProcessStartProcedure)
			if len(starts) != 4 {
				t.Fatalf("%d Start calls, want 4", len(starts))
			}
			first := starts[0].msg.(*process.StartRequest)
			if c := first.GetProcess(); c.GetCmd() != "/bin/bash" || c.GetCwd() != dir || c.GetEnvs()["GREETING"] != "hi" ||
				first.Stdin == nil || first.GetStdin() {
				t.Errorf("first Start decoded as %v; want /bin/bash in %s with GREETING, stdin false", first, dir)
			}
			h := starts[0].header
			if h.Get("Content-Type") != "application/connect+json" || h.Get("Connect-Protocol-Version") != "1" ||
				h.Get("Keepalive-Ping-Interval") == "" || h.Get("Authorization") != "" {
				t.Errorf("Start headers %v; want connect+json, protocol 1, a keepalive interval, no user", h)
			}
			// envd ≥ 0.4.0: the SDK names a user only when the caller does.
			if got, want := starts[2].header.Get("Authorization"), "Basic "+base64.StdEncoding.EncodeToString([]byte("root:")); got != want {
				t.Errorf("run with user root sent Authorization %q, want %q", got, want)
			}
			if h := f.callsOf(processconnect.ProcessListProcedure)[0].header; h.Get("Content-Type") != "application/json" {
				t.Errorf("List Content-Type %q, want application/json (unary Connect JSON)", h.Get("Content-Type"))
			}
		})
	}
}
