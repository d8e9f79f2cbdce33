package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/torpor/torpor/apiv1"
)

// fakeServer is a small in-memory implementation of API v1, enough to drive the
// client commands: sandboxes, files, canned exec streams, images.
type fakeServer struct {
	t         *testing.T
	srv       *httptest.Server
	mu        sync.Mutex
	sandboxes map[string]*apiv1.Sandbox
	files     map[string][]byte // "id:/path"
	images    []apiv1.Image
	lastExec  apiv1.ExecRequest
	lastFork  apiv1.ForkRequest
	lastReq   *http.Request
	next      int
}

func newFakeServer(t *testing.T) *fakeServer {
	f := &fakeServer{t: t, sandboxes: map[string]*apiv1.Sandbox{}, files: map[string][]byte{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes", f.create)
	mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		var out apiv1.ListSandboxesResponse
		ids := make([]string, 0, len(f.sandboxes))
		for id := range f.sandboxes {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			out.Sandboxes = append(out.Sandboxes, *f.sandboxes[id])
		}
		writeJSON(w, 200, out)
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		writeJSON(w, 200, sb)
	}))
	mux.HandleFunc("GET /v1/sandboxes/{id}/metrics", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		if sb.State != apiv1.StateRunning && sb.State != apiv1.StatePaused {
			writeJSON(w, 409, apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: apiv1.CodeConflict, Message: "no instance"}})
			return
		}
		writeJSON(w, 200, apiv1.SandboxMetrics{State: string(sb.State), CPUTimeS: 1.5, MemoryBytes: 30 << 20, MemoryLimitBytes: 512 << 20})
	}))
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		delete(f.sandboxes, sb.ID)
		w.WriteHeader(204)
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/hibernate", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		if sb.State == apiv1.StateHibernated { // as the server: answered as it is
			writeJSON(w, 200, apiv1.HibernateResponse{Sandbox: *sb, Unchanged: true})
			return
		}
		if sb.State != apiv1.StateRunning {
			writeErr(w, 409, apiv1.CodeConflict, "sandbox "+sb.ID+" is "+string(sb.State))
			return
		}
		var req apiv1.HibernateRequest
		if b, _ := io.ReadAll(r.Body); len(b) > 0 {
			if err := json.Unmarshal(b, &req); err != nil {
				writeErr(w, 400, apiv1.CodeInvalidArgument, err.Error())
				return
			}
		}
		sb.State = apiv1.StateHibernated
		durable := req.AsyncUpload == nil || !*req.AsyncUpload
		sb.Snapshot = &apiv1.Snapshot{ID: "snap-" + sb.ID, SandboxID: sb.ID, Bytes: 150 << 20, HibernateMS: 1234, Engine: "gvisor", Durable: durable}
		writeJSON(w, 200, sb)
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/resume", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		if sb.State == apiv1.StateRunning { // as the server: answered as it is
			writeJSON(w, 200, apiv1.ResumeResponse{Sandbox: *sb, Unchanged: true})
			return
		}
		if sb.State != apiv1.StateHibernated {
			writeErr(w, 409, apiv1.CodeConflict, "sandbox "+sb.ID+" is "+string(sb.State))
			return
		}
		sb.State = apiv1.StateRunning
		sb.Generation++
		sb.ResumeMS = 87
		writeJSON(w, 200, sb)
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/fork", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		var req apiv1.ForkRequest
		json.NewDecoder(r.Body).Decode(&req)
		f.lastFork = req
		var out apiv1.ForkResponse
		for range req.Count {
			f.next++
			c := *sb
			c.ID = fmt.Sprintf("sb%d", f.next)
			c.ForkedFrom = sb.ID
			c.State = apiv1.StateRunning
			f.sandboxes[c.ID] = &c
			out.Sandboxes = append(out.Sandboxes, c)
		}
		writeJSON(w, 201, out)
	}))
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", f.withSandbox(f.exec))
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		b, ok := f.files[sb.ID+":"+r.URL.Query().Get("path")]
		if !ok {
			writeErr(w, 404, apiv1.CodeNotFound, "no such file: "+r.URL.Query().Get("path"))
			return
		}
		w.Write(b)
	}))
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files", f.withSandbox(func(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
		b, _ := io.ReadAll(r.Body)
		f.files[sb.ID+":"+r.URL.Query().Get("path")] = b
		w.WriteHeader(204)
	}))
	mux.HandleFunc("GET /v1/images", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		writeJSON(w, 200, apiv1.ListImagesResponse{Images: f.images})
	})
	mux.HandleFunc("POST /v1/images/build", func(w http.ResponseWriter, r *http.Request) {
		var req apiv1.BuildImageRequest
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/x-ndjson")
		enc := json.NewEncoder(w)
		enc.Encode(map[string]string{"log": "resolving " + strings.Join(req.Packages, " ")})
		enc.Encode(map[string]string{"log": "unpacking"})
		if req.Name == "broken" {
			enc.Encode(apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: apiv1.CodeInternal, Message: "mmdebstrap exited 1"}})
			return
		}
		img := apiv1.Image{Name: req.Name, Digest: "sha256:0123456789abcdef0123", Bytes: 200 << 20, Source: "mmdebstrap:" + strings.Join(req.Packages, ","), CreatedAt: time.Now()}
		f.mu.Lock()
		f.images = append(f.images, img)
		f.mu.Unlock()
		enc.Encode(map[string]any{"image": img})
	})
	mux.HandleFunc("POST /v1/images/import", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Header.Get("Content-Type") != "application/x-tar" {
			writeErr(w, 400, apiv1.CodeInvalidArgument, "want application/x-tar")
			return
		}
		img := apiv1.Image{Name: r.URL.Query().Get("name"), Digest: "sha256:feed", Bytes: int64(len(b)), Source: "import:" + string(b), CreatedAt: time.Now()}
		f.mu.Lock()
		f.images = append(f.images, img)
		f.mu.Unlock()
		writeJSON(w, 201, img)
	})
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.lastReq = r
		f.mu.Unlock()
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeServer) withSandbox(h func(http.ResponseWriter, *http.Request, *apiv1.Sandbox)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		sb, ok := f.sandboxes[r.PathValue("id")]
		if !ok {
			writeErr(w, 404, apiv1.CodeNotFound, "sandbox "+r.PathValue("id")+" not found")
			return
		}
		h(w, r, sb)
	}
}

func (f *fakeServer) create(w http.ResponseWriter, r *http.Request) {
	var req apiv1.CreateSandboxRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeErr(w, 400, apiv1.CodeInvalidArgument, err.Error())
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	sb := &apiv1.Sandbox{ID: fmt.Sprintf("sb%d", f.next), State: apiv1.StateRunning, Image: req.Image, ImageDigest: "sha256:ab",
		MemoryMiB: req.MemoryMiB, CPUs: req.CPUs, Env: req.Env, Generation: 1, CreatedAt: time.Now().Add(-90 * time.Second)}
	f.sandboxes[sb.ID] = sb
	writeJSON(w, 201, sb)
}

// exec answers from the command name: "echo" echoes args, "fail N" exits N,
// "cat" echoes stdin, "nosuch" cannot start, "bg" with --background gives a pid,
// "cut" ends the stream without an exit status (the server went away).
func (f *fakeServer) exec(w http.ResponseWriter, r *http.Request, sb *apiv1.Sandbox) {
	var req apiv1.ExecRequest
	json.NewDecoder(r.Body).Decode(&req)
	f.lastExec = req
	w.Header().Set("Content-Type", "application/x-ndjson")
	enc := json.NewEncoder(w)
	code := 0
	if req.Background {
		enc.Encode(map[string]int{"pid": 4242})
		return
	}
	switch req.Cmd[0] {
	case "echo":
		enc.Encode(apiv1.ExecEvent{Stream: "stdout", Data: []byte(strings.Join(req.Cmd[1:], " ") + "\n")})
	case "fail":
		enc.Encode(apiv1.ExecEvent{Stream: "stdout", Data: []byte("partial out\n")})
		enc.Encode(apiv1.ExecEvent{Stream: "stderr", Data: []byte("bad thing\n")})
		fmt.Sscan(req.Cmd[1], &code)
	case "cat":
		enc.Encode(apiv1.ExecEvent{Stream: "stdout", Data: []byte(req.Stdin)})
	case "cut":
		enc.Encode(apiv1.ExecEvent{Stream: "stdout", Data: []byte("partial\n")})
		return
	case "nosuch":
		code = 127
		enc.Encode(apiv1.ExecEvent{ExitCode: &code, Error: `exec: "nosuch": executable file not found in $PATH`})
		return
	}
	enc.Encode(apiv1.ExecEvent{ExitCode: &code})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: code, Message: msg}})
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs torpor against f with args and stdin.
func (f *fakeServer) run(stdin string, args ...string) result {
	f.t.Helper()
	var out, errb bytes.Buffer
	code := Run(context.Background(), append([]string{"--url", f.srv.URL}, args...), strings.NewReader(stdin), &out, &errb)
	return result{code, out.String(), errb.String()}
}

func (f *fakeServer) mustRun(args ...string) string {
	f.t.Helper()
	r := f.run("", args...)
	if r.code != 0 {
		f.t.Fatalf("torpor %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

func TestCreateLsInspect(t *testing.T) {
	f := newFakeServer(t)
	id := strings.TrimSpace(f.mustRun("create", "--image", "py", "--memory", "1024", "--cpus", "2.5", "--env", "A=1", "-e", "B=x=y"))
	if id != "sb1" {
		t.Fatalf("create printed %q", id)
	}
	sb := f.sandboxes["sb1"]
	if sb.Image != "py" || sb.MemoryMiB != 1024 || sb.CPUs != 2.5 || sb.Env["A"] != "1" || sb.Env["B"] != "x=y" {
		t.Fatalf("created %+v", sb)
	}
	var created apiv1.Sandbox
	if err := json.Unmarshal([]byte(f.mustRun("create", "--json")), &created); err != nil || created.ID != "sb2" || created.Image != "base" || created.MemoryMiB != 512 || created.CPUs != 1 {
		t.Fatalf("create --json: %+v %v", created, err)
	}
	f.mustRun("hibernate", "sb2")

	out := f.mustRun("ls")
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("ls:\n%s", out)
	}
	if fields := strings.Fields(lines[0]); strings.Join(fields, " ") != "ID STATE IMAGE MEM GEN SNAPSHOT AGE" {
		t.Fatalf("header %q", lines[0])
	}
	if fields := strings.Fields(lines[1]); strings.Join(fields, " ") != "sb1 running py 1024MiB 1 - 1m" {
		t.Fatalf("row 1 %q", lines[1])
	}
	if fields := strings.Fields(lines[2]); strings.Join(fields, " ") != "sb2 hibernated base 512MiB 1 snap-sb2 (150.0 MiB) 1m" {
		t.Fatalf("row 2 %q", lines[2])
	}

	var list apiv1.ListSandboxesResponse
	if err := json.Unmarshal([]byte(f.mustRun("ls", "--json")), &list); err != nil || len(list.Sandboxes) != 2 || list.Sandboxes[1].Snapshot == nil {
		t.Fatalf("ls --json: %+v %v", list, err)
	}

	var got apiv1.Sandbox
	if err := json.Unmarshal([]byte(f.mustRun("inspect", "sb1")), &got); err != nil || got.ID != "sb1" || got.Env["A"] != "1" {
		t.Fatalf("inspect: %+v %v", got, err)
	}
	r := f.run("", "inspect", "nope")
	if r.code != 1 || r.stderr != "torpor: sandbox nope not found\n" {
		t.Fatalf("inspect nope: %+v", r)
	}
}

func TestUsageErrors(t *testing.T) {
	f := newFakeServer(t)
	for _, args := range [][]string{
		{"inspect"},
		{"inspect", "a", "b"},
		{"create", "--env", "NOEQUALS"},
		{"create", "--memory", "lots"},
		{"nosuchcommand"},
		{"exec", "sb1"},
		{"cp", "a", "b"},
		{"rm"},
		{"image", "build"},
		{"image", "warm", "py-git"}, // only built-in images
		{"fork", "sb1", "--count", "0"},
		{"bench", "resume", "--working-set", "big"},
		{"hibernate", ""},
		{"rm", "sb1", " "},
		{"serve", "--spare-networks", "-1"},
		{"serve", "--spare-networks", "65"},
		{"serve", "--prepared-containers", "65"},
		{"serve", "--restores", "-2"},
		{"fork", "sb1", "--wait", "half"},
	} {
		r := f.run("", args...)
		if r.code != 2 || !strings.HasPrefix(r.stderr, "torpor: ") || !strings.Contains(r.stderr, "--help") {
			t.Errorf("torpor %v: exit %d, stderr %q; want 2 and a usage hint", args, r.code, r.stderr)
		}
	}
}

func TestCpRelativeSandboxPath(t *testing.T) {
	f := newFakeServer(t)
	r := f.run("", "cp", "./local.txt", "sb1:work/x.txt")
	if r.code != 2 || !strings.Contains(r.stderr, `"sb1:work/x.txt": the path after sb1: must be absolute`) {
		t.Fatalf("cp to a relative sandbox path: exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestExecExitCodePassthrough(t *testing.T) {
	f := newFakeServer(t)
	f.mustRun("create")

	r := f.run("", "exec", "sb1", "--", "echo", "hello", "-n", "world")
	if r.code != 0 || r.stdout != "hello -n world\n" || r.stderr != "" {
		t.Fatalf("echo: %+v", r)
	}

	r = f.run("", "exec", "sb1", "--env", "K=V", "--cwd", "/work", "--timeout", "2.5", "--", "fail", "3")
	if r.code != 3 || r.stdout != "partial out\n" || r.stderr != "bad thing\n" {
		t.Fatalf("fail 3: %+v", r)
	}
	if e := f.lastExec; e.Env["K"] != "V" || e.Cwd != "/work" || e.TimeoutS != 2.5 || e.Stdin != "" || strings.Join(e.Cmd, " ") != "fail 3" {
		t.Fatalf("exec request %+v", e)
	}
	if r := f.run("", "exec", "sb1", "--", "fail", "255"); r.code != 255 {
		t.Fatalf("fail 255: exit %d", r.code)
	}

	r = f.run("piped input", "exec", "sb1", "--stdin", "--", "cat")
	if r.code != 0 || r.stdout != "piped input" {
		t.Fatalf("cat: %+v", r)
	}
	r = f.run("ignored", "exec", "sb1", "--", "cat")
	if r.code != 0 || r.stdout != "" {
		t.Fatalf("stdin without --stdin: %+v", r)
	}

	r = f.run("", "exec", "sb1", "--", "nosuch")
	if r.code != 127 || !strings.Contains(r.stderr, "executable file not found") {
		t.Fatalf("nosuch: %+v", r)
	}

	// A stream cut before its exit status: 255 (not 1, which the command may
	// return), naming the broken stream.
	r = f.run("", "exec", "sb1", "--", "cut")
	if r.code != 255 || r.stdout != "partial\n" || !strings.Contains(r.stderr, "exec stream broken") {
		t.Fatalf("cut stream: %+v", r)
	}

	r = f.run("", "exec", "sb1", "--background", "--", "sleep", "100")
	if r.code != 0 || r.stdout != "4242\n" || !f.lastExec.Background {
		t.Fatalf("background: %+v", r)
	}

	r = f.run("", "exec", "nope", "--", "echo")
	if r.code != 1 || r.stderr != "torpor: sandbox nope not found\n" {
		t.Fatalf("missing sandbox: %+v", r)
	}
}

func TestCp(t *testing.T) {
	f := newFakeServer(t)
	f.mustRun("create")
	f.mustRun("create")
	dir := t.TempDir()
	local := filepath.Join(dir, "in.txt")
	os.WriteFile(local, []byte("local content"), 0o600)

	f.mustRun("cp", local, "sb1:/work/in.txt")
	if string(f.files["sb1:/work/in.txt"]) != "local content" {
		t.Fatalf("upload: %q", f.files)
	}
	f.mustRun("cp", local, "sb1:/work/")
	if string(f.files["sb1:/work/in.txt"]) != "local content" {
		t.Fatalf("upload to dir: %q", f.files)
	}
	if r := f.run("from stdin", "cp", "-", "sb1:/work/stdin.txt"); r.code != 0 || string(f.files["sb1:/work/stdin.txt"]) != "from stdin" {
		t.Fatalf("upload stdin: %+v %q", r, f.files)
	}

	out := filepath.Join(dir, "out.txt")
	f.mustRun("cp", "sb1:/work/stdin.txt", out)
	if b, _ := os.ReadFile(out); string(b) != "from stdin" {
		t.Fatalf("download: %q", b)
	}
	f.mustRun("cp", "sb1:/work/stdin.txt", dir)
	if b, _ := os.ReadFile(filepath.Join(dir, "stdin.txt")); string(b) != "from stdin" {
		t.Fatalf("download into dir: %q", b)
	}
	if got := f.mustRun("cp", "sb1:/work/in.txt", "-"); got != "local content" {
		t.Fatalf("download stdout: %q", got)
	}

	f.mustRun("cp", "sb1:/work/in.txt", "sb2:/copied")
	if string(f.files["sb2:/copied"]) != "local content" {
		t.Fatalf("sandbox to sandbox: %q", f.files)
	}

	r := f.run("", "cp", "sb1:/missing", filepath.Join(dir, "missing"))
	if r.code != 1 || r.stderr != "torpor: no such file: /missing\n" {
		t.Fatalf("missing: %+v", r)
	}
	if _, err := os.Stat(filepath.Join(dir, "missing")); !os.IsNotExist(err) {
		t.Fatal("failed download left a file")
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 3 {
		t.Fatalf("temp files left: %v", entries)
	}
	if r := f.run("", "cp", filepath.Join(dir, "nonexistent"), "sb1:/x"); r.code != 1 {
		t.Fatalf("missing local: %+v", r)
	}
}

func TestHibernateResumeForkRm(t *testing.T) {
	f := newFakeServer(t)
	f.mustRun("create")

	if out := f.mustRun("hibernate", "sb1"); out != "hibernated sb1: snapshot snap-sb1, 150.0 MiB, 1234 ms\n" {
		t.Fatalf("hibernate: %q", out)
	}
	if out := f.mustRun("hibernate", "sb1"); out != "sb1 was already hibernated (snapshot snap-sb1)\n" {
		t.Fatalf("hibernate twice: %q", out)
	}
	if out := f.mustRun("resume", "sb1"); out != "resumed sb1 in 87 ms (generation 2)\n" {
		t.Fatalf("resume: %q", out)
	}
	if out := f.mustRun("resume", "sb1"); out != "sb1 was already running (generation 2)\n" {
		t.Fatalf("resume twice: %q", out)
	}
	if out := f.mustRun("hibernate", "--async-upload", "sb1"); out != "hibernated sb1: snapshot snap-sb1, 150.0 MiB, 1234 ms (not durable yet: uploading in the background)\n" {
		t.Fatalf("hibernate --async-upload: %q", out)
	}
	f.mustRun("resume", "sb1")
	f.mustRun("hibernate", "sb1")
	var sb apiv1.Sandbox
	if err := json.Unmarshal([]byte(f.mustRun("resume", "--json", "sb1")), &sb); err != nil || sb.ResumeMS != 87 || sb.State != apiv1.StateRunning {
		t.Fatalf("resume --json: %+v %v", sb, err)
	}
	if err := json.Unmarshal([]byte(f.mustRun("hibernate", "--json", "sb1")), &sb); err != nil || sb.Snapshot.HibernateMS != 1234 {
		t.Fatalf("hibernate --json: %+v %v", sb, err)
	}

	if out := f.mustRun("fork", "sb1", "--count", "3"); out != "sb2\nsb3\nsb4\n" {
		t.Fatalf("fork: %q", out)
	}
	if out := f.mustRun("fork", "sb1"); out != "sb5\n" || f.lastFork.Volumes != "" {
		t.Fatalf("fork default: %q, volumes %q", out, f.lastFork.Volumes)
	}
	// --volumes is the fork call's "volumes" (clones of a sandbox with volumes).
	if out := f.mustRun("fork", "sb1", "--volumes", "copy"); out != "sb6\n" || f.lastFork != (apiv1.ForkRequest{Count: 1, Volumes: "copy", Wait: apiv1.ForkWaitAll}) {
		t.Fatalf("fork --volumes copy: %q, sent %+v", out, f.lastFork)
	}
	// --wait is the fork call's "wait": first answers with the first clone.
	if out := f.mustRun("fork", "sb1", "--count", "2", "--wait", "first"); out != "sb7\nsb8\n" || f.lastFork != (apiv1.ForkRequest{Count: 2, Wait: apiv1.ForkWaitFirst}) {
		t.Fatalf("fork --wait first: %q, sent %+v", out, f.lastFork)
	}
	if r := f.run("", "fork", "sb1", "--wait", "some"); r.code != 2 || !strings.Contains(r.stderr, `--wait "some"`) {
		t.Fatalf("fork --wait some: %+v", r)
	}
	if r := f.run("", "fork", "sb1", "--volumes", "share"); r.code != 2 || !strings.Contains(r.stderr, `--volumes "share": want copy`) {
		t.Fatalf("fork --volumes share: %+v", r)
	}

	// The server's message names the id: it is printed once; a repeated id is
	// deleted once.
	r := f.run("", "rm", "sb2", "nope", "sb3", "sb2")
	if r.code != 1 || r.stdout != "sb2\nsb3\n" || r.stderr != "torpor: sandbox nope not found\n" {
		t.Fatalf("rm: %+v", r)
	}
	if err := f.mustRun("rm", "sb6"); err != "sb6\n" {
		t.Fatalf("rm sb6: %q", err)
	}
	if _, ok := f.sandboxes["sb3"]; ok {
		t.Fatal("sb3 not deleted")
	}
	if out := f.mustRun("rm", "sb4", "sb5"); out != "sb4\nsb5\n" {
		t.Fatalf("rm: %q", out)
	}
}

func TestImages(t *testing.T) {
	f := newFakeServer(t)
	r := f.run("", "image", "build", "py", "--packages", "python3,git")
	if r.code != 0 || r.stdout != "py sha256:0123456789abcdef0123 200.0 MiB\n" || r.stderr != "resolving python3 git\nunpacking\n" {
		t.Fatalf("build: %+v", r)
	}
	r = f.run("", "image", "build", "broken")
	if r.code != 1 || !strings.HasSuffix(r.stderr, "torpor: mmdebstrap exited 1\n") {
		t.Fatalf("broken build: %+v", r)
	}

	tarPath := filepath.Join(t.TempDir(), "rootfs.tar")
	os.WriteFile(tarPath, []byte("TAR"), 0o644)
	if out := f.mustRun("image", "import", "mine", tarPath); out != "mine sha256:feed 0.0 MiB\n" {
		t.Fatalf("import: %q", out)
	}
	if r := f.run("STDINTAR", "image", "import", "--json", "piped", "-"); r.code != 0 || !strings.Contains(r.stdout, `"source": "import:STDINTAR"`) {
		t.Fatalf("import stdin: %+v", r)
	}

	out := f.mustRun("image", "ls")
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 4 || strings.Join(strings.Fields(lines[0]), " ") != "NAME DIGEST SIZE SOURCE AGE" ||
		strings.Join(strings.Fields(lines[1]), " ") != "py sha256:0123456789ab 200.0 MiB mmdebstrap:python3,git 0s" {
		t.Fatalf("image ls:\n%s", out)
	}
	var imgs apiv1.ListImagesResponse
	if err := json.Unmarshal([]byte(f.mustRun("image", "ls", "--json")), &imgs); err != nil || len(imgs.Images) != 3 || imgs.Images[1].Bytes != 3 {
		t.Fatalf("image ls --json: %+v %v", imgs, err)
	}
}

func TestURLFromEnvAndUnreachable(t *testing.T) {
	f := newFakeServer(t)
	t.Setenv("TORPOR_URL", f.srv.URL)
	var out, errb bytes.Buffer
	if code := Run(context.Background(), []string{"ls", "--json"}, strings.NewReader(""), &out, &errb); code != 0 || !sameJSON(out.String(), `{"sandboxes": []}`) {
		t.Fatalf("ls via TORPOR_URL: %d %q %q", code, out.String(), errb.String())
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	out.Reset()
	errb.Reset()
	if code := Run(context.Background(), []string{"--url", dead.URL, "ls"}, strings.NewReader(""), &out, &errb); code != 1 || !strings.Contains(errb.String(), "cannot reach the torpor server at "+dead.URL) {
		t.Fatalf("unreachable: %d %q", code, errb.String())
	}
}

func TestStubsAndParsing(t *testing.T) {
	got, err := parseSizesMiB("64MiB, 512MiB,1GiB,128")
	if err != nil || fmt.Sprint(got) != "[64 512 1024 128]" {
		t.Fatalf("parseSizesMiB = %v %v", got, err)
	}
	for _, bad := range []string{"", "0MiB", "-1", "lots"} {
		if _, err := parseSizesMiB(bad); err == nil {
			t.Errorf("parseSizesMiB(%q) accepted", bad)
		}
	}
	for _, c := range []struct {
		in       string
		id, path string
		ok       bool
	}{
		{"sb1:/work/x", "sb1", "/work/x", true},
		{"./sb1:/x", "", "", false},
		{"file.txt", "", "", false},
		{"sb1:relative", "", "", false},
		{"-", "", "", false},
		{":/x", "", "", false},
	} {
		id, p, ok := remoteSpec(c.in)
		if id != c.id || p != c.path || ok != c.ok {
			t.Errorf("remoteSpec(%q) = %q %q %v", c.in, id, p, ok)
		}
	}
	if humanAge(90*time.Second) != "1m" || humanAge(3*time.Hour) != "3h" || humanAge(72*time.Hour) != "3d" {
		t.Error("humanAge")
	}
}

// TestJSONIsTheAPIAnswer: every --json of a client command prints the API's
// answer to the call it makes, in the API's shape (apiv1): a GET's body exactly,
// and for calls that change something an object of the API's response type with
// no other field.
func TestJSONIsTheAPIAnswer(t *testing.T) {
	f := newFakeServer(t)
	f.mustRun("create")
	f.mustRun("create")
	f.mustRun("hibernate", "sb2")
	f.mustRun("image", "build", "py", "--packages", "python3")
	api := func(path string) string {
		resp, err := http.Get(f.srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	for _, c := range []struct {
		args []string
		path string
	}{
		{[]string{"ls", "--json"}, "/v1/sandboxes"},
		{[]string{"usage", "--json"}, "/v1/sandboxes"},
		{[]string{"usage", "--json", "sb1"}, "/v1/sandboxes/sb1"},
		{[]string{"inspect", "sb2"}, "/v1/sandboxes/sb2"},
		{[]string{"metrics", "--json", "sb1"}, "/v1/sandboxes/sb1/metrics"},
		{[]string{"image", "ls", "--json"}, "/v1/images"},
	} {
		if out, want := f.mustRun(c.args...), api(c.path); !sameJSON(out, want) {
			t.Errorf("torpor %s printed\n%s\nwant GET %s's answer\n%s", strings.Join(c.args, " "), out, c.path, want)
		}
	}
	for _, c := range []struct {
		args []string
		into any
		key  string // a field the answer must have
	}{
		{[]string{"fork", "--json", "sb1", "--count", "2"}, &apiv1.ForkResponse{}, "sandboxes"},
		{[]string{"create", "--json"}, &apiv1.Sandbox{}, "id"},
		{[]string{"hibernate", "--json", "sb1"}, &apiv1.HibernateResponse{}, "snapshot"},
		{[]string{"resume", "--json", "sb1"}, &apiv1.ResumeResponse{}, "generation"},
	} {
		out := f.mustRun(c.args...)
		dec := json.NewDecoder(strings.NewReader(out))
		dec.DisallowUnknownFields()
		var fields map[string]json.RawMessage
		if err := dec.Decode(c.into); err != nil || json.Unmarshal([]byte(out), &fields) != nil || fields[c.key] == nil {
			t.Errorf("torpor %s printed %s: not a %T with %q (%v)", strings.Join(c.args, " "), out, c.into, c.key, err)
		}
	}
	var fork apiv1.ForkResponse
	if err := json.Unmarshal([]byte(f.mustRun("fork", "--json", "sb1")), &fork); err != nil || len(fork.Sandboxes) != 1 || fork.Sandboxes[0].ForkedFrom != "sb1" {
		t.Errorf("fork --json: %+v %v", fork, err)
	}
}

// sameJSON reports whether a and b are JSON documents of equal value.
func sameJSON(a, b string) bool {
	var va, vb any
	if json.Unmarshal([]byte(a), &va) != nil || json.Unmarshal([]byte(b), &vb) != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

// TestFlagUsagesHaveNoBackticks: pflag takes text in backticks in a flag's
// usage as the name of its value, so `serve --help` once showed
// "--auth torpor key create".
func TestFlagUsagesHaveNoBackticks(t *testing.T) {
	a := &app{stdin: strings.NewReader(""), stdout: io.Discard, stderr: io.Discard}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, fs := range []*pflag.FlagSet{c.LocalFlags(), c.PersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) {
				if strings.Contains(f.Usage, "`") {
					name, _ := pflag.UnquoteUsage(f)
					t.Errorf("%s --%s: usage has a backtick (help shows it as --%s %s): %q", c.CommandPath(), f.Name, f.Name, name, f.Usage)
				}
			})
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(a.rootCommand())
}

// TestLsShortensDigestsAndSizes: a sandbox created by image digest shows the
// digest as image ls does (sha256: + 12 hex), and a small snapshot (filesystem
// mode) shows KiB, not "0.0 MiB".
func TestLsShortensDigestsAndSizes(t *testing.T) {
	f := newFakeServer(t)
	digest := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	id := strings.TrimSpace(f.mustRun("create", "--image", digest))
	f.mu.Lock()
	f.sandboxes[id].State = apiv1.StateHibernated
	f.sandboxes[id].Snapshot = &apiv1.Snapshot{ID: "snap-fs", Bytes: 6 << 10}
	f.mu.Unlock()
	lines := strings.Split(strings.TrimRight(f.mustRun("ls"), "\n"), "\n")
	if len(lines) != 2 || strings.Join(strings.Fields(lines[1]), " ") != id+" hibernated sha256:0123456789ab 512MiB 1 snap-fs (6.0 KiB) 1m" {
		t.Fatalf("ls:\n%s", strings.Join(lines, "\n"))
	}
	for _, c := range []struct {
		bytes int64
		want  string
	}{{0, "0 B"}, {1023, "1023 B"}, {1 << 10, "1.0 KiB"}, {(1 << 20) - 1, "1024.0 KiB"}, {1 << 20, "1.0 MiB"}, {150 << 20, "150.0 MiB"}} {
		if got := size(c.bytes); got != c.want {
			t.Errorf("size(%d) = %q, want %q", c.bytes, got, c.want)
		}
	}
}

// TestServerClosedMidCall: a call whose connection ends without an answer (the
// server was killed mid-call) says so and that its effect is unknown, instead
// of `Post "http://…/hibernate": EOF`.
func TestServerClosedMidCall(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		conn, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		conn.Close()
	}))
	defer srv.Close()
	r := runTorpor("--url", srv.URL, "hibernate", "sb1")
	if r.code != 1 || !strings.Contains(r.stderr, "closed the connection before answering POST /v1/sandboxes/sb1/hibernate") ||
		!strings.Contains(r.stderr, "may or may not have taken effect") || strings.Contains(r.stderr, "EOF") {
		t.Errorf("hibernate cut by the server: %+v", r)
	}
}
