package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/server/servertest"
)

// rootUser names root on every envd request that names no user: the default
// image has no "user" account (E2B's default), so the calls say whom they run as.
type rootUser struct{ rt http.RoundTripper }

func (r rootUser) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get("Authorization") == "" {
		req = req.Clone(req.Context())
		req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte("root:")))
	}
	return r.rt.RoundTrip(req)
}

// TestEnvd drives E2B's envd in a real sandbox the way a host front does:
// connections to the sandbox's agent through the manager (DialAgent, which wakes
// a hibernated sandbox and waits for its resume contract), envd's paths
// rewritten by agentclient.EnvdTransport, Connect with the JSON codec. It runs a
// command, writes and reads a file, drives a PTY, and checks that a background
// command survives a hibernate and resume: List still shows it, it kept its
// count, and Connect re-attaches to it.
func TestEnvd(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, Env: map[string]string{"SBX_VAR": "from-create"}})
	id := sb.ID

	tr := agentclient.NewEnvdTransport(func(ctx context.Context) (net.Conn, error) {
		return srv.Manager.DialAgent(ctx, id)
	})
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: rootUser{tr}}
	const base = "http://envd.sandbox.invalid"
	pc := processconnect.NewProcessClient(hc, base, connect.WithProtoJSON())

	startCmd := func(ctx context.Context, req *process.StartRequest) (*connect.ServerStreamForClient[process.StartResponse], uint32) {
		t.Helper()
		s, err := pc.Start(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetEvent().GetStart() == nil {
			t.Fatalf("first event %v (%v), want start", s.Msg(), s.Err())
		}
		return s, s.Msg().GetEvent().GetStart().GetPid()
	}
	// collect reads a stream's output until stop says so or the end event.
	collect := func(s interface {
		Receive() bool
		Err() error
	}, msg func() *process.ProcessEvent, stop func(out string) bool) (string, *process.ProcessEvent_EndEvent) {
		var out strings.Builder
		for s.Receive() {
			ev := msg()
			if d := ev.GetData(); d != nil {
				out.Write(d.GetStdout())
				out.Write(d.GetStderr())
				out.Write(d.GetPty())
				if stop != nil && stop(out.String()) {
					return out.String(), nil
				}
			}
			if e := ev.GetEnd(); e != nil {
				return out.String(), e
			}
		}
		t.Fatalf("stream ended without an end event: %v (output %q)", s.Err(), out.String())
		return "", nil
	}

	t.Run("command", func(t *testing.T) {
		s, _ := startCmd(ctx, &process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/sh",
			Args: []string{"-c", `echo "$SBX_VAR $HOME $USER"; pwd; exit 4`}}, Stdin: new(bool)})
		defer s.Close()
		out, end := collect(s, func() *process.ProcessEvent { return s.Msg().GetEvent() }, nil)
		if out != "from-create /root root\n/root\n" || end.GetExitCode() != 4 || !end.GetExited() || end.GetStatus() != "exit status 4" {
			t.Fatalf("output %q end %v", out, end)
		}
	})

	// upload POSTs body to envd's /files at path (octet-stream) and returns
	// the answer's status and body.
	upload := func(t *testing.T, path string, body io.Reader) (int, []byte) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/files?path="+url.QueryEscape(path), body)
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}

	t.Run("files", func(t *testing.T) {
		status, b := upload(t, "/tmp/envd/hello.txt", strings.NewReader("hello envd"))
		if status != 200 || !strings.Contains(string(b), `"path":"/tmp/envd/hello.txt"`) {
			t.Fatalf("POST /files: %d %s", status, b)
		}
		resp, err := hc.Get(base + "/files?path=" + url.QueryEscape("/tmp/envd/hello.txt"))
		if err != nil {
			t.Fatal(err)
		}
		b, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != "hello envd" {
			t.Fatalf("GET /files: %d %q", resp.StatusCode, b)
		}
		// torpor's own API sees the same file.
		if got := string(readFile(t, c, id, "/tmp/envd/hello.txt")); got != "hello envd" {
			t.Fatalf("torpor read %q", got)
		}
	})

	t.Run("files into a full sandbox", func(t *testing.T) {
		// /tmp is a quarter of the 256 MiB: 64 MiB; the upload is larger.
		status, b := upload(t, "/tmp/full.bin", bytes.NewReader(make([]byte, 96<<20)))
		t.Logf("POST /files of 96 MiB into /tmp: %d %s", status, b)
		if status != http.StatusInsufficientStorage || !strings.Contains(string(b), "the sandbox's file system of") ||
			!strings.Contains(string(b), "the host's disk is not full") {
			t.Errorf("upload beyond /tmp's bound: %d %s, want 507 naming the sandbox's own file system", status, b)
		}
		if out := sh(t, c, id, "ls /tmp/full.bin 2>&1 || true"); !strings.Contains(out, "No such file") {
			t.Errorf("the cut upload left its part: %s", out)
		}
	})

	t.Run("pty", func(t *testing.T) {
		s, pid := startCmd(ctx, &process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/sh",
			Args: []string{"-c", `stty size; read -r line; echo "got:$line"; stty size`}},
			Pty: &process.PTY{Size: &process.PTY_Size{Cols: 100, Rows: 30}}})
		defer s.Close()
		msg := func() *process.ProcessEvent { return s.Msg().GetEvent() }
		if out, _ := collect(s, msg, func(o string) bool { return strings.Contains(o, "30 100") }); !strings.Contains(out, "30 100") {
			t.Fatalf("pty: %q", out)
		}
		sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
		if _, err := pc.Update(ctx, connect.NewRequest(&process.UpdateRequest{Process: sel, Pty: &process.PTY{Size: &process.PTY_Size{Cols: 132, Rows: 50}}})); err != nil {
			t.Fatal(err)
		}
		if _, err := pc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
			Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte("typed\n")}}})); err != nil {
			t.Fatal(err)
		}
		out, end := collect(s, msg, nil)
		if !strings.Contains(out, "got:typed") || !strings.Contains(out, "50 132") || end.GetExitCode() != 0 {
			t.Fatalf("pty after input and resize: %q end %v", out, end)
		}
	})

	t.Run("background survives hibernate", func(t *testing.T) {
		sctx, cancel := context.WithCancel(ctx)
		s, pid := startCmd(sctx, &process.StartRequest{Tag: ptrTo("counter"), Stdin: new(bool), Process: &process.ProcessConfig{Cmd: "/bin/sh",
			Args: []string{"-c", `i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv -f /tmp/count.new /tmp/count; echo $i; sleep 0.1; done`}}})
		collect(s, func() *process.ProcessEvent { return s.Msg().GetEvent() }, func(o string) bool { return strings.Count(o, "\n") >= 3 })
		cancel() // detach: the process goes on
		s.Close()
		// An open connection would hold the hibernate's drain: every stream is
		// closed, and the idle ones go now.
		tr.CloseIdleConnections()
		time.Sleep(300 * time.Millisecond)
		before := countIn(t, string(readFile(t, c, id, "/tmp/count")))

		t0 := time.Now()
		hibernate(t, c, id)
		if d := time.Since(t0); d > 8*time.Second {
			t.Errorf("hibernate took %v: an envd connection was left open and held the drain", d)
		}
		// List wakes the sandbox (DialAgent resumes it) and still shows the process.
		res, err := pc.List(ctx, connect.NewRequest(&process.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, p := range res.Msg.GetProcesses() {
			found = found || (p.GetPid() == pid && p.GetTag() == "counter")
		}
		if !found {
			t.Fatalf("List after resume: %v, want pid %d tagged counter", res.Msg.GetProcesses(), pid)
		}
		wantState(t, c, id, apiv1.StateRunning)
		cs, err := pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: "counter"}}}))
		if err != nil {
			t.Fatal(err)
		}
		if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
			t.Fatalf("Connect after resume: %v (%v), want start with pid %d", cs.Msg(), cs.Err(), pid)
		}
		out, _ := collect(cs, func() *process.ProcessEvent { return cs.Msg().GetEvent() }, func(o string) bool { return strings.Count(o, "\n") >= 3 })
		lines := strings.Split(strings.TrimSpace(out), "\n")
		n := countIn(t, lines[len(lines)-1])
		// Memory kept: it counts on from where it was, not from 1.
		if n <= before {
			t.Fatalf("after resume the counter is at %d, want past %d (it ran before the hibernate)", n, before)
		}
		cs.Close()
		if _, err := pc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("file metadata survives hibernate", func(t *testing.T) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/files?path="+url.QueryEscape("/root/meta.txt"), strings.NewReader("m"))
		req.Header.Set("Content-Type", "application/octet-stream")
		req.Header.Set("X-Metadata-Owner-Team", "agents")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"metadata":{"owner-team":"agents"}`) {
			t.Fatalf("POST /files with metadata: %d %s", resp.StatusCode, b)
		}
		tr.CloseIdleConnections()
		hibernate(t, c, id)
		fc := filesystemconnect.NewFilesystemClient(hc, base, connect.WithProtoJSON())
		st, err := fc.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/root/meta.txt"}))
		if err != nil {
			t.Fatal(err)
		}
		if md := st.Msg.GetEntry().GetMetadata(); len(md) != 1 || md["owner-team"] != "agents" {
			t.Fatalf("metadata after hibernate and resume: %v", md)
		}
	})

	t.Run("stream ended for hibernate", func(t *testing.T) {
		// The stream has its own transport, closed when the stream ends, as
		// the E2B front does for each request (an idle kept-alive connection
		// would count as a request in flight).
		str := agentclient.NewEnvdTransport(func(ctx context.Context) (net.Conn, error) {
			return srv.Manager.DialAgent(ctx, id)
		})
		spc := processconnect.NewProcessClient(&http.Client{Transport: rootUser{str}}, base, connect.WithProtoJSON())
		s, err := spc.Start(ctx, connect.NewRequest(&process.StartRequest{Stdin: new(bool), Process: &process.ProcessConfig{Cmd: "/bin/sh",
			Args: []string{"-c", `i=0; while :; do i=$((i+1)); echo $i > /tmp/count2.new; mv -f /tmp/count2.new /tmp/count2; echo $i; sleep 0.1; done`}}}))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetEvent().GetStart() == nil {
			t.Fatalf("first event %v (%v), want start", s.Msg(), s.Err())
		}
		pid := s.Msg().GetEvent().GetStart().GetPid()
		collect(s, func() *process.ProcessEvent { return s.Msg().GetEvent() }, func(o string) bool { return strings.Count(o, "\n") >= 2 })
		ended := make(chan error, 1)
		go func() {
			for s.Receive() {
			}
			err := s.Err()
			s.Close()
			str.CloseIdleConnections()
			ended <- err
		}()
		// The hibernate asks the agent to end the open stream before its
		// drain (HibernateDrain, 10 s), so it is not held by it.
		t0 := time.Now()
		tr.CloseIdleConnections() // the other subtests' calls; the stream is on str
		hibernate(t, c, id)
		if d := time.Since(t0); d > 5*time.Second {
			t.Errorf("hibernate with an open envd stream took %v: the stream held the drain", d)
		}
		select {
		case err := <-ended:
			if connect.CodeOf(err) != connect.CodeUnavailable {
				t.Fatalf("the stream ended for the hibernate with %v, want unavailable (not an end event: the process runs on)", err)
			}
			t.Logf("stream ended for the hibernate in %v: %v", time.Since(t0).Round(time.Millisecond), err)
		case <-time.After(30 * time.Second):
			t.Fatal("the Start stream still hangs 30 s after the hibernate")
		}
		before := countIn(t, string(readFile(t, c, id, "/tmp/count2"))) // resumes the sandbox
		cs, err := pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}}))
		if err != nil {
			t.Fatal(err)
		}
		if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
			t.Fatalf("Connect after resume: %v (%v), want start with pid %d", cs.Msg(), cs.Err(), pid)
		}
		out, _ := collect(cs, func() *process.ProcessEvent { return cs.Msg().GetEvent() }, func(o string) bool { return strings.Count(o, "\n") >= 3 })
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if n := countIn(t, lines[len(lines)-1]); n <= before {
			t.Fatalf("after connect the counter is at %d, want past %d: the process does not run on", n, before)
		}
		cs.Close()
		if _, err := pc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
			t.Fatal(err)
		}
	})
}

func countIn(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		t.Fatalf("count %q: %v", s, err)
	}
	return n
}

func ptrTo[T any](v T) *T { return &v }
