package agentclient_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// fakeAgent imitates an agent's HTTP answers with the literal bodies given, and
// counts the requests per "METHOD /path".
type fakeAgent struct {
	health string // body of GET /health
	mu     sync.Mutex
	calls  map[string]int
	files  map[string]string // path -> content; PUT stores "mode:content"
	lastRQ proto.ResumeRequest
}

func (f *fakeAgent) count(key string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[key]
}

func (f *fakeAgent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.calls[r.Method+" "+r.URL.Path]++
	f.mu.Unlock()
	switch r.Method + " " + r.URL.Path {
	case "GET /health":
		io.WriteString(w, f.health)
	case "POST /exec":
		var req map[string]any
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/x-ndjson")
		if req["background"] == true {
			io.WriteString(w, `{"pid":42}`+"\n")
			return
		}
		// "hi\n" on stdout, "oops" on stderr, exit 3: what the version 1 agent sends.
		io.WriteString(w, `{"stream":"stdout","data":"aGkK"}`+"\n"+`{"stream":"stderr","data":"b29wcw=="}`+"\n"+`{"exit_code":3}`+"\n")
	case "GET /files":
		p := r.URL.Query().Get("path")
		f.mu.Lock()
		c, ok := f.files[p]
		f.mu.Unlock()
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, `{"error":{"code":"not_found","message":"open `+p+`: no such file or directory"}}`+"\n")
			return
		}
		io.WriteString(w, c)
	case "PUT /files":
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.files[r.URL.Query().Get("path")] = r.URL.Query().Get("mode") + ":" + string(b)
		f.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	case "POST /resume":
		f.mu.Lock()
		json.NewDecoder(r.Body).Decode(&f.lastRQ)
		f.mu.Unlock()
		io.WriteString(w, `{"event":"resume","generation":7,"forked":true,"snapshot_id":"snp_1",`+
			`"steps":[{"name":"generation","ms":0.1,"ok":true,"detail":"generation 7 written"},{"name":"reseed","ms":0.2,"ok":true}],`+
			`"clock":{"skew_ms":-1.5,"corrected":"none"},"subscribers":{"total":1,"acked":1,"timed_out":[]},`+
			`"hooks":[{"name":"10-x","exit_code":0,"ms":3,"timed_out":false,"output":"ok\n"}],"ok":true}`+"\n")
	default:
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"error":{"code":"not_found","message":"no such endpoint: `+r.URL.Path+`"}}`+"\n")
	}
}

func startFake(t *testing.T, health string) (*agentclient.Client, *fakeAgent) {
	t.Helper()
	f := &fakeAgent{health: health, calls: map[string]int{}, files: map[string]string{"/etc/hostname": "sbx\n"}}
	hs := httptest.NewServer(f)
	t.Cleanup(hs.Close)
	c := agentclient.New(agentclient.TCPDialer(strings.TrimPrefix(hs.URL, "http://")))
	t.Cleanup(c.CloseIdleConnections)
	return c, f
}

// The health answer of the agent at protocol version 1: no protocol_version, no agent.
const v1Health = `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05.123456789Z"}` + "\n"

// TestVersion1Agent drives an imitation of a version 1 agent (no version in its
// health answer) through every call the host makes.
func TestVersion1Agent(t *testing.T) {
	c, f := startFake(t, v1Health)
	ctx := context.Background()
	if v := c.ProtocolVersion(); v != 0 {
		t.Fatalf("ProtocolVersion() before WaitReady = %d, want 0", v)
	}
	if err := c.WaitReady(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if v, b := c.ProtocolVersion(), c.AgentBuild(); v != proto.Version1 || b != "" {
		t.Fatalf("ProtocolVersion() = %d, AgentBuild() = %q; want 1 and \"\" for an agent that reports no version", v, b)
	}
	h, err := c.Info(ctx)
	if err != nil || h.Pid != 1 || !h.StartedAt.Equal(time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC)) {
		t.Fatalf("Info = %+v, %v", h, err)
	}

	const n = 5
	for range n {
		out, errb, code, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{"sh", "-c", "x"}})
		if err != nil || string(out) != "hi\n" || string(errb) != "oops" || code != 3 {
			t.Fatalf("Run = %q %q %d %v", out, errb, code, err)
		}
	}
	if pid, err := c.Start(ctx, proto.ExecRequest{Cmd: []string{"sleep", "1"}}); err != nil || pid != 42 {
		t.Fatalf("Start = %d, %v", pid, err)
	}
	// The version was learnt once: execs are one request each, no health check.
	if hc, ec := f.count("GET /health"), f.count("POST /exec"); hc != 2 || ec != n+1 {
		t.Fatalf("requests: %d GET /health (want 2: WaitReady and Info), %d POST /exec (want %d)", hc, ec, n+1)
	}

	rc, size, err := c.ReadFile(ctx, "/etc/hostname")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if string(b) != "sbx\n" || size != 4 {
		t.Fatalf("ReadFile = %q (%d bytes)", b, size)
	}
	if _, _, err := c.ReadFile(ctx, "/nope"); !agentclient.IsNotFound(err) {
		t.Fatalf("ReadFile of a missing file: %v, want not_found", err)
	}
	if err := c.WriteFileMode(ctx, "/tmp/a b", bytes.NewReader([]byte("data")), 4, 0o755); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	got := f.files["/tmp/a b"]
	f.mu.Unlock()
	if got != "755:data" {
		t.Fatalf("agent got PUT /files %q, want mode 755 and the bytes", got)
	}

	at := time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	rep, err := c.Resume(ctx, proto.ResumeRequest{Generation: 7, Forked: true, SnapshotID: "snp_1", HostTime: at, HookDeadlineS: 2})
	if err != nil {
		t.Fatal(err)
	}
	if f.lastRQ.Generation != 7 || !f.lastRQ.Forked || f.lastRQ.SnapshotID != "snp_1" || !f.lastRQ.HostTime.Equal(at) || f.lastRQ.HookDeadlineS != 2 {
		t.Fatalf("agent got resume request %+v", f.lastRQ)
	}
	if !rep.OK || rep.Event != "resume" || rep.Generation != 7 || len(rep.Steps) != 2 || rep.Steps[0].Detail != "generation 7 written" ||
		rep.Clock.SkewMS != -1.5 || rep.Subscribers.Acked != 1 || len(rep.Hooks) != 1 || rep.Hooks[0].Output != "ok\n" {
		t.Fatalf("resume report = %+v", rep)
	}
}

func TestVersions(t *testing.T) {
	for _, tc := range []struct {
		name    string
		health  string
		want    int  // ProtocolVersion after WaitReady
		refused bool // WaitReady fails with ErrUnsupportedVersion
	}{
		{"version 1 (absent)", v1Health, 1, false},
		{"version 2", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05Z","protocol_version":2,"agent":"torpor-agent x"}`, 2, false},
		{"newer than this host", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05Z","protocol_version":99,"agent":"torpor-agent future"}`, 0, true},
		{"below the minimum", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05Z","protocol_version":-1}`, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, f := startFake(t, tc.health)
			t0 := time.Now()
			err := c.WaitReady(context.Background(), 5*time.Second)
			if tc.refused {
				var ve *agentclient.VersionError
				if !errors.Is(err, agentclient.ErrUnsupportedVersion) || !errors.As(err, &ve) {
					t.Fatalf("WaitReady = %v, want ErrUnsupportedVersion", err)
				}
				if ve.Min != proto.MinVersion || ve.Max != proto.Version || ve.Version == proto.Version {
					t.Fatalf("VersionError = %+v", ve)
				}
				// Refused at the first answer, not retried until the timeout.
				if d := time.Since(t0); d > 2*time.Second || f.count("GET /health") != 1 {
					t.Fatalf("refusal took %v and %d health checks", d, f.count("GET /health"))
				}
				t.Logf("refused: %v", err)
			} else if err != nil {
				t.Fatal(err)
			}
			if v := c.ProtocolVersion(); v != tc.want {
				t.Fatalf("ProtocolVersion() = %d, want %d", v, tc.want)
			}
		})
	}
}

// TestEnvdVersion: an agent before protocol version 3 (a sandbox resumed from an
// old snapshot) is refused for envd at once, with an error that says why; a
// version 3 agent is accepted.
func TestEnvdVersion(t *testing.T) {
	for _, tc := range []struct {
		name   string
		health string
		ok     bool
	}{
		{"version 1", v1Health, false},
		{"version 2", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05Z","protocol_version":2,"agent":"torpor-agent old"}`, false},
		{"version 3", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05Z","protocol_version":3,"agent":"torpor-agent new"}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, f := startFake(t, tc.health)
			if err := c.Envd(); !errors.Is(err, agentclient.ErrNoEnvd) {
				t.Fatalf("Envd() before WaitReady = %v, want ErrNoEnvd", err)
			}
			if err := c.WaitReady(context.Background(), 5*time.Second); err != nil {
				t.Fatal(err)
			}
			err := c.Envd()
			if tc.ok {
				if err != nil {
					t.Fatalf("Envd() = %v, want nil", err)
				}
				return
			}
			var ve *agentclient.EnvdVersionError
			if !errors.Is(err, agentclient.ErrNoEnvd) || !errors.As(err, &ve) || ve.Version != proto.VersionOf(mustHealth(t, tc.health)) {
				t.Fatalf("Envd() = %v, want an EnvdVersionError naming the version", err)
			}
			if !strings.Contains(err.Error(), "predates E2B's envd") {
				t.Fatalf("Envd() = %q: does not say why", err)
			}
			if n := f.count("GET /health"); n != 1 {
				t.Fatalf("Envd made requests: %d health checks, want the one of WaitReady", n)
			}
		})
	}
}

func mustHealth(t *testing.T, body string) proto.Health {
	var h proto.Health
	if err := json.Unmarshal([]byte(body), &h); err != nil {
		t.Fatal(err)
	}
	return h
}

// TestEnvdTransport: envd's paths reach the agent rewritten by proto.EnvdPath,
// the query kept.
func TestEnvdTransport(t *testing.T) {
	var mu sync.Mutex
	var got []string
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.RequestURI())
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(hs.Close)
	tr := agentclient.NewEnvdTransport(agentclient.TCPDialer(strings.TrimPrefix(hs.URL, "http://")))
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr}
	for _, p := range []string{"/health", "/files?path=%2Ftmp%2Fa+b&username=root", "/envs", "/process.Process/Start", "/exec"} {
		resp, err := hc.Get("http://sbx-1.example.org:49983" + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	want := []string{"GET /envd/health", "GET /envd/files?path=%2Ftmp%2Fa+b&username=root", "GET /envd/envs", "GET /process.Process/Start", "GET /envd/exec"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("agent got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestEnvdTransportUploadStreamed: an upload to envd's /files of known length
// reaches the agent as it is written, not once it is whole (the agent answers
// here after its first bytes, before the rest is sent).
func TestEnvdTransportUploadStreamed(t *testing.T) {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b := make([]byte, 5)
		if _, err := io.ReadFull(r.Body, b); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Connection", "close")
		w.Write(b)
	}))
	t.Cleanup(hs.Close)
	tr := agentclient.NewEnvdTransport(agentclient.TCPDialer(strings.TrimPrefix(hs.URL, "http://")))
	t.Cleanup(tr.CloseIdleConnections)

	pr, pw := io.Pipe()
	defer pw.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://envd/files?path=/tmp/up", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = 64 << 10
	req.Header.Set("Content-Type", "application/octet-stream")
	go pw.Write([]byte("first"))
	type answer struct {
		resp *http.Response
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := tr.RoundTrip(req)
		done <- answer{resp, err}
	}()
	var resp *http.Response
	select {
	case a := <-done:
		if a.err != nil {
			t.Fatalf("the upload's answer before its end: %v", a.err)
		}
		resp = a.resp
	case <-time.After(5 * time.Second):
		pw.CloseWithError(errors.New("test over"))
		t.Fatal("no answer after 5 s: the upload was held back until whole")
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "first" {
		t.Fatalf("the agent read %q first, want %q", b, "first")
	}
}

// rawChunks serves one connection at a time on a loopback listener, reading
// each request's chunked body frame by frame: it sends the sizes of a
// request's chunks, and whether the body ended with its last (0) chunk, on the
// returned channel, and answers 204.
func rawChunks(t *testing.T) (addr string, bodies <-chan chunkedBody) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan chunkedBody, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			br := bufio.NewReader(c)
			for {
				tp := textproto.NewReader(br)
				if _, err := tp.ReadLine(); err != nil {
					break
				}
				if _, err := tp.ReadMIMEHeader(); err != nil {
					break
				}
				var b chunkedBody
				for {
					line, err := tp.ReadLine()
					if err != nil {
						break
					}
					n, err := strconv.ParseInt(line, 16, 64)
					if err != nil {
						break
					}
					if n == 0 {
						tp.ReadLine()
						b.ended = true
						break
					}
					data := make([]byte, n+2)
					if _, err := io.ReadFull(br, data); err != nil {
						break
					}
					b.sizes = append(b.sizes, int(n))
					b.data = append(b.data, data[:n]...)
				}
				ch <- b
				if !b.ended {
					break
				}
				io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
			}
			c.Close()
		}
	}()
	return ln.Addr().String(), ch
}

type chunkedBody struct {
	sizes []int
	data  []byte
	ended bool
}

// trickle is a body of unknown length read in pieces of at most 16 KiB (as a
// front reads a client's chunked upload), ending with err after its bytes.
type trickle struct {
	b   []byte
	err error
}

func (r *trickle) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, r.err
	}
	n := copy(p[:min(len(p), 16<<10)], r.b)
	r.b = r.b[n:]
	return n, nil
}

// TestEnvdTransportUnsizedUpload: an upload to envd's /files of unknown length
// reaches the agent whole, in chunks of at least 64 KiB but the last (not one
// per read of the body), and one cut short by its client is not ended as if
// it were whole.
func TestEnvdTransportUnsizedUpload(t *testing.T) {
	addr, bodies := rawChunks(t)
	tr := agentclient.NewEnvdTransport(agentclient.TCPDialer(addr))
	t.Cleanup(tr.CloseIdleConnections)
	up := make([]byte, 1<<20+12345)
	for i := range up {
		up[i] = byte(i * 7)
	}
	send := func(body io.Reader) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://envd/files?path=/tmp/up", io.NopCloser(body))
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = -1
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := tr.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := send(&trickle{b: up, err: io.EOF}); err != nil {
		t.Fatal(err)
	}
	b := <-bodies
	if !b.ended || !bytes.Equal(b.data, up) {
		t.Fatalf("the agent got %d bytes (ended %v), want the %d sent", len(b.data), b.ended, len(up))
	}
	for i, n := range b.sizes[:len(b.sizes)-1] {
		if n < 64<<10 {
			t.Fatalf("chunk %d of %d is %d bytes, want at least 64 KiB: %v", i, len(b.sizes), n, b.sizes)
		}
	}

	if err := send(&trickle{b: up[:100<<10], err: io.ErrUnexpectedEOF}); err == nil {
		t.Error("an upload cut short was answered")
	}
	if b := <-bodies; b.ended {
		t.Fatalf("an upload cut short after %d bytes reached the agent as a whole body", len(b.data))
	}
}
