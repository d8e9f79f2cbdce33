package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
)

// fake records the last request and answers from a table of handlers.
type fake struct {
	t        *testing.T
	srv      *httptest.Server
	handlers map[string]http.HandlerFunc // "METHOD /path"
}

func newFake(t *testing.T) (*fake, *Client) {
	f := &fake{t: t, handlers: map[string]http.HandlerFunc{}}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, ok := f.handlers[r.Method+" "+r.URL.Path]
		if !ok {
			writeErr(w, 404, apiv1.CodeNotFound, "no route "+r.Method+" "+r.URL.Path)
			return
		}
		h(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f, New(f.srv.URL + "/")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: code, Message: msg}})
}

func decode[T any](t *testing.T, r *http.Request) T {
	t.Helper()
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", r.Method, r.URL.Path, ct)
	}
	var v T
	if err := json.NewDecoder(r.Body).Decode(&v); err != nil {
		t.Fatalf("decode %s: %v", r.URL.Path, err)
	}
	return v
}

func TestNewDefaults(t *testing.T) {
	t.Setenv("TORPOR_URL", "")
	if got := New("").BaseURL; got != DefaultURL {
		t.Errorf("New(\"\") = %q", got)
	}
	t.Setenv("TORPOR_URL", "http://example:1/")
	if got := New("").BaseURL; got != "http://example:1" {
		t.Errorf("env: %q", got)
	}
	if got := New("10.0.0.1:7070").BaseURL; got != "http://10.0.0.1:7070" {
		t.Errorf("no scheme: %q", got)
	}
	if New("").HTTP.Timeout != 0 {
		t.Error("http client has an overall timeout")
	}
}

func TestSandboxCalls(t *testing.T) {
	f, c := newFake(t)
	ctx := context.Background()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	sb := apiv1.Sandbox{ID: "sb-1", State: apiv1.StateRunning, Image: "base", MemoryMiB: 256, CPUs: 0.5, Generation: 1, CreatedAt: now}

	f.handlers["POST /v1/sandboxes"] = func(w http.ResponseWriter, r *http.Request) {
		req := decode[apiv1.CreateSandboxRequest](t, r)
		if req.Image != "base" || req.MemoryMiB != 256 || req.CPUs != 0.5 || req.Env["A"] != "1" {
			t.Errorf("create request %+v", req)
		}
		writeJSON(w, 201, sb)
	}
	got, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: 256, CPUs: 0.5, Env: map[string]string{"A": "1"}})
	if err != nil || got.ID != "sb-1" || !got.CreatedAt.Equal(now) {
		t.Fatalf("CreateSandbox = %+v, %v", got, err)
	}

	f.handlers["GET /v1/sandboxes"] = func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, apiv1.ListSandboxesResponse{Sandboxes: []apiv1.Sandbox{sb, sb}})
	}
	list, err := c.ListSandboxes(ctx)
	if err != nil || len(list) != 2 {
		t.Fatalf("ListSandboxes = %v, %v", list, err)
	}

	f.handlers["GET /v1/sandboxes/sb-1"] = func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, sb) }
	if got, err := c.GetSandbox(ctx, "sb-1"); err != nil || got.ID != "sb-1" {
		t.Fatalf("GetSandbox = %+v, %v", got, err)
	}
	_, err = c.GetSandbox(ctx, "nope")
	if !IsNotFound(err) || IsConflict(err) {
		t.Fatalf("GetSandbox(nope) err = %v", err)
	}
	var ae *APIError
	if !errors.As(err, &ae) || ae.Status != 404 || ae.Error() != "torpor: not_found: no route GET /v1/sandboxes/nope" {
		t.Fatalf("APIError = %#v", err)
	}

	deleted := false
	f.handlers["DELETE /v1/sandboxes/sb-1"] = func(w http.ResponseWriter, r *http.Request) { deleted = true; w.WriteHeader(204) }
	if err := c.DeleteSandbox(ctx, "sb-1"); err != nil || !deleted {
		t.Fatalf("DeleteSandbox: %v", err)
	}

	f.handlers["POST /v1/sandboxes/sb-1/hibernate"] = func(w http.ResponseWriter, r *http.Request) {
		h := sb
		h.State = apiv1.StateHibernated
		h.Snapshot = &apiv1.Snapshot{ID: "snap-1", SandboxID: "sb-1", Bytes: 3 << 20, HibernateMS: 420}
		writeJSON(w, 200, h)
	}
	h, err := c.Hibernate(ctx, "sb-1")
	if err != nil || h.State != apiv1.StateHibernated || h.Snapshot == nil || h.Snapshot.ID != "snap-1" || h.Snapshot.HibernateMS != 420 {
		t.Fatalf("Hibernate = %+v, %v", h, err)
	}

	f.handlers["POST /v1/sandboxes/sb-1/resume"] = func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 409, apiv1.CodeConflict, "sandbox sb-1 is running")
	}
	if _, err := c.Resume(ctx, "sb-1"); !IsConflict(err) {
		t.Fatalf("Resume err = %v", err)
	}
	f.handlers["POST /v1/sandboxes/sb-1/resume"] = func(w http.ResponseWriter, r *http.Request) {
		s := sb
		s.ResumeMS = 87
		writeJSON(w, 200, s)
	}
	if r, err := c.Resume(ctx, "sb-1"); err != nil || r.ResumeMS != 87 {
		t.Fatalf("Resume = %+v, %v", r, err)
	}

	f.handlers["POST /v1/sandboxes/sb-1/fork"] = func(w http.ResponseWriter, r *http.Request) {
		req := decode[apiv1.ForkRequest](t, r)
		var out apiv1.ForkResponse
		for i := range req.Count {
			out.Sandboxes = append(out.Sandboxes, apiv1.Sandbox{ID: fmt.Sprintf("sb-f%d", i), ForkedFrom: "sb-1"})
		}
		writeJSON(w, 201, out)
	}
	forks, err := c.Fork(ctx, "sb-1", 3)
	if err != nil || len(forks) != 3 || forks[2].ID != "sb-f2" {
		t.Fatalf("Fork = %+v, %v", forks, err)
	}
	if forks, err := c.Fork(ctx, "sb-1", 0); err != nil || len(forks) != 1 {
		t.Fatalf("Fork(0) = %+v, %v", forks, err)
	}
}

func TestErrorWithoutBody(t *testing.T) {
	f, c := newFake(t)
	f.handlers["GET /v1/sandboxes"] = func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream down", 503)
	}
	_, err := c.ListSandboxes(context.Background())
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != apiv1.CodeUnavailable || ae.Message != "upstream down" || ae.Status != 503 {
		t.Fatalf("err = %#v", err)
	}
}

func ndjson(w http.ResponseWriter, lines ...any) {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(200)
	enc := json.NewEncoder(w)
	for _, l := range lines {
		_ = enc.Encode(l)
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
}

func intp(i int) *int { return &i }

func TestExec(t *testing.T) {
	f, c := newFake(t)
	ctx := context.Background()
	f.handlers["POST /v1/sandboxes/sb-1/exec"] = func(w http.ResponseWriter, r *http.Request) {
		req := decode[apiv1.ExecRequest](t, r)
		switch req.Cmd[0] {
		case "echo":
			if req.Cwd != "/tmp" || req.Env["X"] != "y" || req.TimeoutS != 5 || req.Stdin != "in" {
				t.Errorf("exec request %+v", req)
			}
			// Raw lines, as the server writes them, to pin the wire format.
			w.Header().Set("Content-Type", "application/x-ndjson")
			io.WriteString(w, `{"stream":"stdout","data":"aGVsbG8K"}`+"\n")
			io.WriteString(w, `{"stream":"stderr","data":"b29wcw=="}`+"\n\n")
			io.WriteString(w, `{"stream":"stdout","data":"d29ybGQK"}`+"\n")
			io.WriteString(w, `{"exit_code":3}`+"\n")
		case "bg":
			if !req.Background {
				t.Error("background not set")
			}
			ndjson(w, map[string]int{"pid": 42})
		case "missing":
			ndjson(w, map[string]any{"error": "exec: missing: not found", "exit_code": 127})
		case "cut":
			ndjson(w, apiv1.ExecEvent{Stream: "stdout", Data: []byte("partial")})
		}
	}
	req := apiv1.ExecRequest{Cmd: []string{"echo"}, Cwd: "/tmp", Env: map[string]string{"X": "y"}, TimeoutS: 5, Stdin: "in"}

	out, errb, code, err := c.ExecCollect(ctx, "sb-1", req)
	if err != nil || string(out) != "hello\nworld\n" || string(errb) != "oops" || code != 3 {
		t.Fatalf("ExecCollect = %q %q %d %v", out, errb, code, err)
	}

	s, err := c.Exec(ctx, "sb-1", req)
	if err != nil {
		t.Fatal(err)
	}
	var evs []apiv1.ExecEvent
	for {
		ev, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
	}
	s.Close()
	if len(evs) != 4 || evs[3].ExitCode == nil || *evs[3].ExitCode != 3 || evs[1].Stream != "stderr" {
		t.Fatalf("events %+v", evs)
	}

	pid, err := c.ExecBackground(ctx, "sb-1", apiv1.ExecRequest{Cmd: []string{"bg"}})
	if err != nil || pid != 42 {
		t.Fatalf("ExecBackground = %d, %v", pid, err)
	}
	code, err = c.ExecStream(ctx, "sb-1", apiv1.ExecRequest{Cmd: []string{"bg"}, Background: true}, nil, nil)
	if err != nil || code != 0 {
		t.Fatalf("ExecStream(bg) = %d, %v", code, err)
	}

	_, _, code, err = c.ExecCollect(ctx, "sb-1", apiv1.ExecRequest{Cmd: []string{"missing"}})
	var ee *ExecError
	if !errors.As(err, &ee) || code != 127 || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("missing: code %d err %v", code, err)
	}

	var buf bytes.Buffer
	_, err = c.ExecStream(ctx, "sb-1", apiv1.ExecRequest{Cmd: []string{"cut"}}, &buf, nil)
	if !errors.Is(err, io.ErrUnexpectedEOF) || buf.String() != "partial" {
		t.Fatalf("cut stream: %q %v", buf.String(), err)
	}

	_, err = c.Exec(ctx, "nope", req)
	if !IsNotFound(err) {
		t.Fatalf("exec on missing sandbox: %v", err)
	}
}

func TestExecHonoursContext(t *testing.T) {
	f, c := newFake(t)
	release := make(chan struct{})
	defer close(release)
	f.handlers["POST /v1/sandboxes/sb-1/exec"] = func(w http.ResponseWriter, r *http.Request) {
		ndjson(w, apiv1.ExecEvent{Stream: "stdout", Data: []byte("x")})
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.ExecStream(ctx, "sb-1", apiv1.ExecRequest{Cmd: []string{"sleep"}}, nil, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("context not honoured")
	}
}

func TestFiles(t *testing.T) {
	f, c := newFake(t)
	ctx := context.Background()
	store := map[string][]byte{}
	f.handlers["PUT /v1/sandboxes/sb-1/files"] = func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		store[r.URL.Query().Get("path")] = b
		w.WriteHeader(204)
	}
	f.handlers["GET /v1/sandboxes/sb-1/files"] = func(w http.ResponseWriter, r *http.Request) {
		b, ok := store[r.URL.Query().Get("path")]
		if !ok {
			writeErr(w, 404, apiv1.CodeNotFound, "no such file")
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(b)
	}
	const p = "/work/a b&c?.txt"
	if err := c.WriteFile(ctx, "sb-1", p, io.MultiReader(strings.NewReader("he"), strings.NewReader("llo"))); err != nil {
		t.Fatal(err)
	}
	if string(store[p]) != "hello" {
		t.Fatalf("stored %q", store)
	}
	rc, err := c.ReadFile(ctx, "sb-1", p)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "hello" {
		t.Fatalf("read %q", b)
	}
	if _, err := c.ReadFile(ctx, "sb-1", "/nope"); !IsNotFound(err) {
		t.Fatalf("missing file err %v", err)
	}
	if err := c.WriteFile(ctx, "sb-1", "/empty", nil); err != nil || len(store["/empty"]) != 0 {
		t.Fatalf("empty write: %v", err)
	}
}

func TestImages(t *testing.T) {
	f, c := newFake(t)
	ctx := context.Background()
	f.handlers["GET /v1/images"] = func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, apiv1.ListImagesResponse{Images: []apiv1.Image{{Name: "base", Digest: "sha256:ab"}}})
	}
	imgs, err := c.ListImages(ctx)
	if err != nil || len(imgs) != 1 || imgs[0].Name != "base" {
		t.Fatalf("ListImages = %+v, %v", imgs, err)
	}

	f.handlers["POST /v1/images/build"] = func(w http.ResponseWriter, r *http.Request) {
		req := decode[apiv1.BuildImageRequest](t, r)
		if req.Name == "bad" {
			ndjson(w, map[string]string{"log": "starting"}, apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: "internal", Message: "mmdebstrap failed"}})
			return
		}
		if req.Name != "py" || strings.Join(req.Packages, ",") != "python3,git" {
			t.Errorf("build request %+v", req)
		}
		ndjson(w, map[string]string{"log": "one"}, map[string]string{"log": "two"}, map[string]any{"image": apiv1.Image{Name: "py", Digest: "sha256:cd"}})
	}
	var lines []string
	img, err := c.BuildImage(ctx, apiv1.BuildImageRequest{Name: "py", Packages: []string{"python3", "git"}}, func(l string) { lines = append(lines, l) })
	if err != nil || img.Digest != "sha256:cd" || strings.Join(lines, "|") != "one|two" {
		t.Fatalf("BuildImage = %+v %v %v", img, lines, err)
	}
	_, err = c.BuildImage(ctx, apiv1.BuildImageRequest{Name: "bad"}, nil)
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != "internal" || ae.Message != "mmdebstrap failed" {
		t.Fatalf("bad build err %v", err)
	}

	f.handlers["POST /v1/images/import"] = func(w http.ResponseWriter, r *http.Request) {
		if ct := r.Header.Get("Content-Type"); ct != "application/x-tar" {
			t.Errorf("import Content-Type %q", ct)
		}
		b, _ := io.ReadAll(r.Body)
		if r.ContentLength != int64(len(b)) || string(b) != "TARDATA" {
			t.Errorf("import body %q len %d", b, r.ContentLength)
		}
		writeJSON(w, 201, apiv1.Image{Name: r.URL.Query().Get("name"), Bytes: int64(len(b))})
	}
	img, err = c.ImportImage(ctx, "my img", struct{ io.Reader }{strings.NewReader("TARDATA")}, 7)
	if err != nil || img.Name != "my img" || img.Bytes != 7 {
		t.Fatalf("ImportImage = %+v, %v", img, err)
	}
}

func TestHealthPortURLAndDo(t *testing.T) {
	f, c := newFake(t)
	ctx := context.Background()
	f.handlers["GET /healthz"] = func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, map[string]bool{"ok": true}) }
	if err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	u := c.PortURL("sb-1", 8080, "/api/x")
	if u != f.srv.URL+"/v1/sandboxes/sb-1/ports/8080/api/x" {
		t.Fatalf("PortURL = %q", u)
	}
	if u := c.PortURL("sb-1", 80, ""); !strings.HasSuffix(u, "/ports/80/") {
		t.Fatalf("PortURL empty path = %q", u)
	}
	f.handlers["POST /v1/sandboxes/sb-1/ports/8080/api/x"] = func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Echo", r.Header.Get("X-In"))
		w.WriteHeader(202)
		w.Write(bytes.ToUpper(b))
	}
	resp, err := c.Do(ctx, "POST", "/v1/sandboxes/sb-1/ports/8080/api/x", strings.NewReader("ping"), http.Header{"X-In": {"v"}})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 202 || string(b) != "PING" || resp.Header.Get("X-Echo") != "v" {
		t.Fatalf("Do = %d %q %v", resp.StatusCode, b, resp.Header)
	}
}

// An id of "." or ".." is refused before any request: URL path cleaning would
// turn "/v1/snapshots/.." into "/v1".
func TestDotIDsRefused(t *testing.T) {
	c := New("http://127.0.0.1:1") // nothing listens: no request may be sent
	for _, id := range []string{".", ".."} {
		_, err := c.GetSnapshot(context.Background(), id)
		var ae *APIError
		if !errors.As(err, &ae) || ae.Code != apiv1.CodeInvalidArgument || !strings.Contains(ae.Message, id) {
			t.Fatalf("GetSnapshot(%q): %v", id, err)
		}
	}
}

// TestAPIKey: New takes the key from TORPOR_API_KEY, and every kind of
// request (JSON calls, streams, uploads, Do) sends it as a Bearer token; a
// 401 is IsUnauthenticated; without a key nothing is sent.
func TestAPIKey(t *testing.T) {
	var (
		mu   sync.Mutex
		seen []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		if r.Header.Get("Authorization") != "Bearer e2b_0123" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(401)
			fmt.Fprint(w, `{"error":{"code":"unauthenticated","message":"invalid API key"}}`)
			return
		}
		switch r.URL.Path {
		case "/v1/sandboxes":
			fmt.Fprint(w, `{"sandboxes":[]}`)
		case "/v1/images/import":
			w.WriteHeader(201)
			fmt.Fprint(w, `{"name":"x"}`)
		default:
			w.Header().Set("Content-Type", "application/x-ndjson")
			fmt.Fprint(w, `{"exit_code":0}`+"\n")
		}
	}))
	defer srv.Close()
	ctx := context.Background()
	t.Setenv("TORPOR_API_KEY", " e2b_0123\n")
	c := New(srv.URL)
	if c.APIKey != "e2b_0123" {
		t.Fatalf("APIKey from the environment: %q", c.APIKey)
	}
	if _, err := c.ListSandboxes(ctx); err != nil {
		t.Errorf("list: %v", err)
	}
	if _, err := c.ImportImage(ctx, "x", strings.NewReader("tar"), 3); err != nil {
		t.Errorf("import: %v", err)
	}
	if _, _, _, err := c.ExecCollect(ctx, "sbx", apiv1.ExecRequest{Cmd: []string{"true"}}); err != nil {
		t.Errorf("exec: %v", err)
	}
	resp, err := c.Do(ctx, "GET", "/v1/sandboxes/sbx/ports/80/", nil, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Errorf("do: %v", err)
	} else {
		resp.Body.Close()
	}
	c.APIKey = "e2b_wrong"
	if _, err := c.ListSandboxes(ctx); !IsUnauthenticated(err) {
		t.Errorf("a wrong key: %v, want IsUnauthenticated", err)
	}
	t.Setenv("TORPOR_API_KEY", "")
	New(srv.URL).ListSandboxes(ctx)
	mu.Lock()
	defer mu.Unlock()
	want := []string{"GET /v1/sandboxes Bearer e2b_0123", "POST /v1/images/import Bearer e2b_0123", "POST /v1/sandboxes/sbx/exec Bearer e2b_0123",
		"GET /v1/sandboxes/sbx/ports/80/ Bearer e2b_0123", "GET /v1/sandboxes Bearer e2b_wrong", "GET /v1/sandboxes "}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") {
		t.Errorf("requests:\n%s\nwant\n%s", strings.Join(seen, "\n"), strings.Join(want, "\n"))
	}
}
