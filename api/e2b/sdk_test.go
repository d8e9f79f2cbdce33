package e2b

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os/exec"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/e2e/e2bsdk"
)

// recorded is one request the SDK sent to the stand-in control plane.
type recorded struct {
	Method, Path string
	Query        url.Values
	Body         []byte
	APIKey       string
}

// controlPlane is a stand-in for torpor's E2B control plane: it answers with this
// package's wire types and records every request. Bodies are decoded strictly
// (unknown fields are an error answer, which fails the SDK run), so a field the SDK
// sends and the wire types lack shows up.
type controlPlane struct {
	t       *testing.T
	mu      sync.Mutex
	reqs    []recorded
	created int
	paused  map[string]bool
	started time.Time
}

func strictDecode(body []byte, v any) error {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, Error{Code: status, Message: msg})
}

func (cp *controlPlane) sandbox(id, template string) Sandbox {
	return Sandbox{TemplateID: template, SandboxID: id, ClientID: ClientID, EnvdVersion: EnvdVersion, EnvdAccessToken: "token-" + id}
}

func (cp *controlPlane) handler() http.Handler {
	mux := http.NewServeMux()
	create := func(w http.ResponseWriter, r *http.Request, body []byte) {
		var req NewSandbox
		if err := strictDecode(body, &req); err != nil {
			writeError(w, 400, err.Error())
			return
		}
		cp.mu.Lock()
		cp.created++
		id := fmt.Sprintf("sbx%d", cp.created)
		cp.mu.Unlock()
		writeJSON(w, http.StatusCreated, cp.sandbox(id, req.TemplateID))
	}
	connect := func(w http.ResponseWriter, r *http.Request, body []byte) {
		var req ConnectRequest
		if err := strictDecode(body, &req); err != nil {
			writeError(w, 400, err.Error())
			return
		}
		id := r.PathValue("id")
		cp.mu.Lock()
		status := http.StatusOK
		if cp.paused[id] {
			status = http.StatusCreated
			delete(cp.paused, id)
		}
		cp.mu.Unlock()
		writeJSON(w, status, cp.sandbox(id, "tmpl"))
	}
	routes := map[string]func(http.ResponseWriter, *http.Request, []byte){
		"POST /v2/sandboxes": create,
		"POST /sandboxes":    create,
		"GET /sandboxes/{id}": func(w http.ResponseWriter, r *http.Request, _ []byte) {
			id := r.PathValue("id")
			if id == "missing" {
				writeError(w, 404, "sandbox missing not found")
				return
			}
			domain := "sandboxes.torpor.test"
			writeJSON(w, 200, SandboxDetail{
				ListedSandbox: ListedSandbox{
					TemplateID: "tmpl", SandboxID: id, ClientID: ClientID,
					StartedAt: cp.started, EndAt: cp.started.Add(DefaultTimeout),
					CPUCount: 2, MemoryMB: 512, DiskSizeMB: 1024,
					Metadata: map[string]string{"user": "abc"}, State: StateRunning, EnvdVersion: EnvdVersion,
				},
				Domain:    &domain,
				Lifecycle: &Lifecycle{AutoResume: true, OnTimeout: OnTimeoutPause},
			})
		},
		"GET /v2/sandboxes": func(w http.ResponseWriter, r *http.Request, _ []byte) {
			q, err := ParseListQuery(r.URL.Query())
			if err != nil {
				writeError(w, 400, err.Error())
				return
			}
			entry := func(id string, st State) ListedSandbox {
				return ListedSandbox{TemplateID: "tmpl", SandboxID: id, ClientID: ClientID, StartedAt: cp.started,
					EndAt: cp.started.Add(time.Hour), CPUCount: 1, MemoryMB: 256, DiskSizeMB: 512,
					Metadata: q.Metadata, State: st, EnvdVersion: EnvdVersion}
			}
			if q.NextToken == "" {
				w.Header().Set(HeaderNextToken, "page-2")
				writeJSON(w, 200, []ListedSandbox{entry("sbx1", StateRunning), entry("sbx2", StatePaused)})
				return
			}
			writeJSON(w, 200, []ListedSandbox{entry("sbx3", StateRunning)})
		},
		"POST /sandboxes/{id}/timeout": func(w http.ResponseWriter, r *http.Request, body []byte) {
			var req TimeoutRequest
			if err := strictDecode(body, &req); err != nil {
				writeError(w, 400, err.Error())
				return
			}
			w.WriteHeader(http.StatusNoContent)
		},
		"POST /sandboxes/{id}/pause": func(w http.ResponseWriter, r *http.Request, body []byte) {
			var req PauseRequest
			if err := strictDecode(body, &req); err != nil {
				writeError(w, 400, err.Error())
				return
			}
			id := r.PathValue("id")
			cp.mu.Lock()
			already := cp.paused[id]
			cp.paused[id] = true
			cp.mu.Unlock()
			if already {
				writeError(w, http.StatusConflict, "sandbox "+id+" is already paused")
				return
			}
			w.WriteHeader(http.StatusNoContent)
		},
		"POST /v2/sandboxes/{id}/connect": connect,
		"POST /sandboxes/{id}/connect":    connect,
		"POST /sandboxes/{id}/snapshots": func(w http.ResponseWriter, r *http.Request, body []byte) {
			var req SnapshotRequest
			if err := strictDecode(body, &req); err != nil {
				writeError(w, 400, err.Error())
				return
			}
			writeJSON(w, http.StatusCreated, SnapshotInfo{SnapshotID: "snap-" + r.PathValue("id") + ":default", Names: []string{"local/" + req.Name + ":default"}})
		},
		"POST /sandboxes/{id}/fork": func(w http.ResponseWriter, r *http.Request, body []byte) {
			var req ForkRequest
			if err := strictDecode(body, &req); err != nil {
				writeError(w, 400, err.Error())
				return
			}
			n, err := req.N()
			if err != nil {
				writeError(w, 400, err.Error())
				return
			}
			// The first fork starts; every later one fails as if refused by a limit.
			results := []ForkResult{{Sandbox: ptr(cp.sandbox(r.PathValue("id")+"-fork1", "tmpl"))}}
			for i := 1; i < n; i++ {
				results = append(results, ForkResult{Error: &Error{Code: http.StatusTooManyRequests, Message: "too many sandboxes"}})
			}
			writeJSON(w, http.StatusCreated, results)
		},
		"GET /sandboxes/{id}/metrics": func(w http.ResponseWriter, r *http.Request, _ []byte) {
			at := cp.started.Add(time.Minute)
			writeJSON(w, 200, []Metric{{Timestamp: at, TimestampUnix: at.Unix(), CPUCount: 2, CPUUsedPct: 12.5,
				MemUsed: 100 << 20, MemTotal: 512 << 20, MemCache: 10 << 20, DiskUsed: 1 << 30, DiskTotal: 4 << 30}})
		},
		"DELETE /sandboxes/{id}": func(w http.ResponseWriter, r *http.Request, _ []byte) {
			if r.PathValue("id") == "missing" {
				writeError(w, 404, "sandbox missing not found")
				return
			}
			w.WriteHeader(http.StatusNoContent)
		},
	}
	for pattern, h := range routes {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			cp.mu.Lock()
			cp.reqs = append(cp.reqs, recorded{Method: r.Method, Path: r.URL.Path, Query: r.URL.Query(), Body: body, APIKey: r.Header.Get(HeaderAPIKey)})
			cp.mu.Unlock()
			h(w, r, body)
		})
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		cp.t.Errorf("SDK called %s %s, which the stand-in does not serve", r.Method, r.URL)
		writeError(w, 404, "no route")
	})
	return mux
}

func ptr[T any](v T) *T { return &v }

// bodiesOf answers the bodies of the recorded requests to method and path, in order.
func (cp *controlPlane) bodiesOf(method, path string) [][]byte {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var out [][]byte
	for _, r := range cp.reqs {
		if r.Method == method && r.Path == path {
			out = append(out, r.Body)
		}
	}
	return out
}

// sdkResult is what testdata/sdk_control.mjs prints.
type sdkResult struct {
	Created      struct{ SandboxID, Host string }
	CreatedPlain struct{ SandboxID string }
	Info         struct {
		SandboxID, TemplateID, EnvdVersion, State, SandboxDomain string
		StartedAt, EndAt                                         string
		CPUCount, MemoryMB                                       int
		Metadata                                                 map[string]string
		Lifecycle                                                struct {
			OnTimeout  string
			AutoResume bool
		}
	}
	InfoMissing string
	List        [][]struct {
		SandboxID, State, StartedAt string
		Metadata                    map[string]string
		CPUCount, MemoryMB          int
	}
	Pause, PauseAgain bool
	Connected         struct{ SandboxID string }
	Snapshot          struct {
		SnapshotID string
		Names      []string
	}
	Forks   []struct{ SandboxID, Error string }
	Metrics []struct {
		Timestamp                   string
		CPUCount                    int
		CPUUsedPct                  float64
		MemUsed, MemTotal, MemCache int64
		DiskUsed, DiskTotal         int64
	}
	Kill, KillMissing bool
}

// TestSDKControlPlane drives every control-plane call of each pinned SDK version
// against the stand-in: each request body must decode strictly into the wire types,
// with the fields and defaults each version is documented to send, and the SDK must
// read every answer's fields under the names the wire types give them.
func TestSDKControlPlane(t *testing.T) {
	node := e2bsdk.Node(t)
	for pkg, version := range e2bsdk.Packages {
		t.Run(version, func(t *testing.T) {
			cp := &controlPlane{t: t, paused: map[string]bool{}, started: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
			srv := httptest.NewServer(cp.handler())
			defer srv.Close()
			key := "e2b_0123456789abcdef"
			cmd := exec.Command(node, filepath.Join("testdata", "sdk_control.mjs"),
				e2bsdk.Module(pkg))
			cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_API_KEY="+key, "E2B_DOMAIN=torpor.test")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("sdk_control.mjs: %v\n%s", err, stderr.String())
			}
			var got sdkResult
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("sdk_control.mjs printed %q: %v", out, err)
			}
			checkRequests(t, cp, version, key)
			checkAnswers(t, cp, got)
		})
	}
}

func checkRequests(t *testing.T, cp *controlPlane, version, key string) {
	v251 := version == "2.51.0"
	createPath, connectPath := "/sandboxes", "/sandboxes/sbx1/connect"
	if v251 {
		createPath, connectPath = "/v2/sandboxes", "/v2/sandboxes/sbx1/connect"
	}
	for _, r := range cp.reqs {
		if r.APIKey != key {
			t.Errorf("%s %s sent %s %q, want %q", r.Method, r.Path, HeaderAPIKey, r.APIKey, key)
		}
	}

	creates := cp.bodiesOf("POST", createPath)
	if len(creates) != 3 {
		t.Fatalf("%d creates on %s, want 3 (all: %v)", len(creates), createPath, cp.reqs)
	}
	var full, plain, fsOnly NewSandbox
	for i, dst := range []*NewSandbox{&full, &plain, &fsOnly} {
		if err := json.Unmarshal(creates[i], dst); err != nil {
			t.Fatal(err)
		}
	}
	if full.TemplateID != "tmpl" || !reflect.DeepEqual(full.Metadata, map[string]string{"user": "abc"}) ||
		!reflect.DeepEqual(full.EnvVars, map[string]string{"A": "1"}) {
		t.Errorf("create body %s: template, metadata or envVars lost", creates[0])
	}
	if d, _ := full.TTL(); d != time.Minute {
		t.Errorf("create with timeoutMs 60000: TTL %v, want 1m (body %s)", d, creates[0])
	}
	if !full.PausesOnTimeout() || !full.ResumesOnRequest() || !full.KeepsMemoryOnPause() {
		t.Errorf("create with onTimeout pause, autoResume: body %s decodes to pause %v resume %v memory %v",
			creates[0], full.PausesOnTimeout(), full.ResumesOnRequest(), full.KeepsMemoryOnPause())
	}
	if plain.TemplateID != DefaultTemplate {
		t.Errorf("create with no template sent %q, want %q", plain.TemplateID, DefaultTemplate)
	}
	if d, _ := plain.TTL(); d != DefaultTimeout {
		t.Errorf("default create: TTL %v, want %v (body %s)", d, DefaultTimeout, creates[1])
	}
	if plain.PausesOnTimeout() || plain.ResumesOnRequest() || !plain.InternetAccess() || len(plain.Unsupported()) != 0 {
		t.Errorf("default create body %s: want kill on timeout, no auto-resume, internet, nothing unsupported", creates[1])
	}
	// What each version leaves to the server's defaults.
	if sent := plain.Timeout != nil; sent == v251 {
		t.Errorf("%s default create: timeout sent=%v (body %s)", version, sent, creates[1])
	}
	if sent := plain.Secure != nil; sent == v251 {
		t.Errorf("%s default create: secure sent=%v (body %s)", version, sent, creates[1])
	}
	if fsOnly.KeepsMemoryOnPause() || !fsOnly.PausesOnTimeout() || fsOnly.InternetAccess() {
		t.Errorf("create with keepMemory false, no internet: body %s decodes to memory %v pause %v internet %v",
			creates[2], fsOnly.KeepsMemoryOnPause(), fsOnly.PausesOnTimeout(), fsOnly.InternetAccess())
	}

	var lists []url.Values
	for _, r := range cp.reqs {
		if r.Method == "GET" && r.Path == "/v2/sandboxes" {
			lists = append(lists, r.Query)
		}
	}
	if len(lists) != 2 {
		t.Fatalf("%d list requests, want 2 (two pages)", len(lists))
	}
	q, err := ParseListQuery(lists[0])
	if err != nil {
		t.Fatalf("first list query %v: %v", lists[0], err)
	}
	wantMD := map[string]string{"my key": "a&b=c", "user": "abc"}
	if !reflect.DeepEqual(q.Metadata, wantMD) || q.Limit != 2 || !reflect.DeepEqual(q.States, []State{StateRunning, StatePaused}) {
		t.Errorf("list query %v decodes to metadata %v limit %d states %v; want %v, 2, running+paused", lists[0], q.Metadata, q.Limit, q.States, wantMD)
	}
	if q2, _ := ParseListQuery(lists[1]); q2.NextToken != "page-2" {
		t.Errorf("second page asked with nextToken %q, want the X-Next-Token page-2", q2.NextToken)
	}

	var tr TimeoutRequest
	if bs := cp.bodiesOf("POST", "/sandboxes/sbx1/timeout"); len(bs) != 1 || json.Unmarshal(bs[0], &tr) != nil {
		t.Fatalf("timeout bodies %q", bs)
	}
	if d, err := tr.TTL(); err != nil || d != 90*time.Second {
		t.Errorf("setTimeout(90000): TTL %v, %v; want 1m30s", d, err)
	}

	pauses := cp.bodiesOf("POST", "/sandboxes/sbx1/pause")
	if len(pauses) != 3 {
		t.Fatalf("pause bodies %q, want 3", pauses)
	}
	for i, want := range []bool{true, true, false} {
		var p PauseRequest
		if err := json.Unmarshal(pauses[i], &p); err != nil || p.KeepsMemory() != want {
			t.Errorf("pause body %s: keeps memory %v, want %v (%v)", pauses[i], p.KeepsMemory(), want, err)
		}
	}

	connects := cp.bodiesOf("POST", connectPath)
	if len(connects) != 2 {
		t.Fatalf("%d connects on %s, want 2", len(connects), connectPath)
	}
	for i, want := range []time.Duration{2 * time.Minute, DefaultTimeout} {
		var c ConnectRequest
		if err := json.Unmarshal(connects[i], &c); err != nil {
			t.Fatal(err)
		}
		if d, _ := c.TTL(); d != want || !c.KeepsMemory() {
			t.Errorf("connect body %s: TTL %v memory %v, want %v true", connects[i], d, c.KeepsMemory(), want)
		}
	}

	var sr SnapshotRequest
	if bs := cp.bodiesOf("POST", "/sandboxes/sbx1/snapshots"); len(bs) != 1 || json.Unmarshal(bs[0], &sr) != nil || sr.Name != "snap" {
		t.Errorf("snapshot bodies %q, want one naming snap", bs)
	}

	forks := cp.bodiesOf("POST", "/sandboxes/sbx1/fork")
	if len(forks) != 2 {
		t.Fatalf("fork bodies %q, want 2", forks)
	}
	for i, want := range []int{2, DefaultForkCount} {
		var f ForkRequest
		if err := json.Unmarshal(forks[i], &f); err != nil {
			t.Fatal(err)
		}
		n, err := f.N()
		if d, _ := f.TTL(); n != want || err != nil || d != DefaultTimeout {
			t.Errorf("fork body %s: count %d (%v) TTL %v; want %d, %v", forks[i], n, err, d, want, DefaultTimeout)
		}
	}
}

func checkAnswers(t *testing.T, cp *controlPlane, got sdkResult) {
	if got.Created.SandboxID != "sbx1" || got.CreatedPlain.SandboxID != "sbx2" {
		t.Errorf("created %+v, %+v; want sbx1, sbx2", got.Created, got.CreatedPlain)
	}
	if want := "8080-sbx1.torpor.test"; got.Created.Host != want {
		t.Errorf("getHost(8080) = %q, want %q", got.Created.Host, want)
	}
	i := got.Info
	if i.SandboxID != "sbx1" || i.TemplateID != "tmpl" || i.EnvdVersion != EnvdVersion || i.State != "running" ||
		i.CPUCount != 2 || i.MemoryMB != 512 || i.SandboxDomain != "sandboxes.torpor.test" ||
		i.Metadata["user"] != "abc" || i.Lifecycle.OnTimeout != "pause" || !i.Lifecycle.AutoResume {
		t.Errorf("getInfo read %+v", i)
	}
	if i.StartedAt != "2026-01-02T03:04:05.000Z" || i.EndAt != "2026-01-02T03:09:05.000Z" {
		t.Errorf("getInfo times %s, %s", i.StartedAt, i.EndAt)
	}
	if got.InfoMissing != "SandboxNotFoundError" {
		t.Errorf("getInfo of a 404 threw %s, want SandboxNotFoundError", got.InfoMissing)
	}
	if len(got.List) != 2 || len(got.List[0]) != 2 || len(got.List[1]) != 1 {
		t.Fatalf("list pages %+v, want 2 then 1", got.List)
	}
	if e := got.List[0][1]; e.SandboxID != "sbx2" || e.State != "paused" || e.CPUCount != 1 || e.MemoryMB != 256 ||
		e.Metadata["my key"] != "a&b=c" || e.StartedAt != "2026-01-02T03:04:05.000Z" {
		t.Errorf("listed entry read as %+v", e)
	}
	if !got.Pause || got.PauseAgain {
		t.Errorf("pause = %v, pause again (409) = %v; want true, false", got.Pause, got.PauseAgain)
	}
	if got.Connected.SandboxID != "sbx1" {
		t.Errorf("connect read %+v", got.Connected)
	}
	if got.Snapshot.SnapshotID != "snap-sbx1:default" || !reflect.DeepEqual(got.Snapshot.Names, []string{"local/snap:default"}) {
		t.Errorf("createSnapshot read %+v", got.Snapshot)
	}
	if len(got.Forks) != 2 || got.Forks[0].SandboxID != "sbx1-fork1" || got.Forks[1].Error != "RateLimitError" {
		t.Errorf("fork read %+v; want a sandbox then a RateLimitError", got.Forks)
	}
	if len(got.Metrics) != 1 {
		t.Fatalf("metrics %+v", got.Metrics)
	}
	if m := got.Metrics[0]; m.Timestamp != "2026-01-02T03:05:05.000Z" || m.CPUCount != 2 || m.CPUUsedPct != 12.5 ||
		m.MemUsed != 100<<20 || m.MemTotal != 512<<20 || m.MemCache != 10<<20 || m.DiskUsed != 1<<30 || m.DiskTotal != 4<<30 {
		t.Errorf("metrics read %+v", m)
	}
	if !got.Kill || got.KillMissing {
		t.Errorf("kill = %v, kill of a 404 = %v; want true, false", got.Kill, got.KillMissing)
	}
}
