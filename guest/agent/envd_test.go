package agent_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"mime/multipart"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
	"github.com/torpor/torpor/guest/agent"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// envdEnv is the sandbox env of the test agent.
var envdEnv = map[string]string{"SANDBOX_VAR": "from-sandbox", "SHARED": "sandbox"}

// envdAgent is an agent serving envd on loopback, reached the way a host front
// reaches it: through agentclient.EnvdTransport.
type envdAgent struct {
	addr string
	log  *syncBuffer         // the agent's log
	ac   *agentclient.Client // torpor's protocol
	hc   *http.Client        // envd's paths, rewritten; Authorization: Basic root: unless set
	// proc and fs are Connect clients with the JSON codec (what E2B's SDK uses)
	// and, in binProc/binFS, the binary codec.
	proc, binProc processconnect.ProcessClient
	fs, binFS     filesystemconnect.FilesystemClient
}

// asUser adds "Authorization: Basic base64(<user>:)" to requests that carry
// none: the test host has no "user" account, so tests name root.
type asUser struct {
	rt   http.RoundTripper
	user string
}

func (a asUser) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Header.Get("Authorization") == "" && a.user != "" {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", basicUser(a.user))
	}
	return a.rt.RoundTrip(r)
}

func basicUser(name string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(name+":"))
}

const envdURL = "http://sandbox.invalid:49983"

func startEnvd(t *testing.T, runDir string) *envdAgent {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	lg := &syncBuffer{}
	go func() {
		done <- agent.Serve(ctx, ln, agent.Options{Env: envdEnv, RunDir: runDir, Log: log.New(lg, "", log.Lmicroseconds)})
	}()
	dial := agentclient.TCPDialer(ln.Addr().String())
	tr := agentclient.NewEnvdTransport(dial)
	a := &envdAgent{addr: ln.Addr().String(), log: lg, ac: agentclient.New(dial),
		hc: &http.Client{Transport: asUser{tr, "root"}}}
	a.proc = processconnect.NewProcessClient(a.hc, envdURL, connect.WithProtoJSON())
	a.binProc = processconnect.NewProcessClient(a.hc, envdURL)
	a.fs = filesystemconnect.NewFilesystemClient(a.hc, envdURL, connect.WithProtoJSON())
	a.binFS = filesystemconnect.NewFilesystemClient(a.hc, envdURL)
	t.Cleanup(func() {
		// Kill what the test left running.
		if res, err := a.proc.List(context.Background(), connect.NewRequest(&process.ListRequest{})); err == nil {
			for _, p := range res.Msg.GetProcesses() {
				syscall.Kill(-int(p.GetPid()), syscall.SIGKILL)
			}
		}
		tr.CloseIdleConnections()
		a.ac.CloseIdleConnections()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	if err := a.ac.WaitReady(context.Background(), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if v := a.ac.ProtocolVersion(); v != proto.Version {
		t.Fatalf("agent protocol version %d, want %d", v, proto.Version)
	}
	if err := a.ac.Envd(); err != nil {
		t.Fatal(err)
	}
	return a
}

// codecs runs f with the JSON and the binary codec's process client.
func (a *envdAgent) codecs(t *testing.T, f func(t *testing.T, pc processconnect.ProcessClient)) {
	t.Run("json", func(t *testing.T) { f(t, a.proc) })
	t.Run("binary", func(t *testing.T) { f(t, a.binProc) })
}

// eventStream is what Start and Connect answer.
type eventStream interface {
	Receive() bool
	Err() error
	Close() error
}

// events reads a Start or Connect stream.
type events struct {
	t   *testing.T
	s   eventStream
	msg func() *process.ProcessEvent
}

func startEvents(t *testing.T, s *connect.ServerStreamForClient[process.StartResponse]) *events {
	return &events{t: t, s: s, msg: func() *process.ProcessEvent { return s.Msg().GetEvent() }}
}

func connectEvents(t *testing.T, s *connect.ServerStreamForClient[process.ConnectResponse]) *events {
	return &events{t: t, s: s, msg: func() *process.ProcessEvent { return s.Msg().GetEvent() }}
}

// next returns the next event, or nil and the stream's error at its end.
func (e *events) next() (*process.ProcessEvent, error) {
	if e.s.Receive() {
		return e.msg(), nil
	}
	return nil, e.s.Err()
}

// pid reads the start event.
func (e *events) pid() uint32 {
	e.t.Helper()
	ev, err := e.next()
	if err != nil || ev.GetStart() == nil || ev.GetStart().GetPid() == 0 {
		e.t.Fatalf("first event %v (%v), want a start event with a pid", ev, err)
	}
	return ev.GetStart().GetPid()
}

// collected is a process's output up to its end.
type collected struct {
	stdout, stderr, pty string
	end                 *process.ProcessEvent_EndEvent
	keepalives          int
	err                 error
}

// until reads events until the end event, the stream's end, or stop says so
// (called after each data event with what was collected).
func (e *events) until(stop func(c *collected) bool) *collected {
	c := &collected{}
	for {
		ev, err := e.next()
		if err != nil || ev == nil {
			c.err = err
			return c
		}
		switch {
		case ev.GetData() != nil:
			d := ev.GetData()
			c.stdout += string(d.GetStdout())
			c.stderr += string(d.GetStderr())
			c.pty += string(d.GetPty())
			if stop != nil && stop(c) {
				return c
			}
		case ev.GetEnd() != nil:
			c.end = ev.GetEnd()
		case ev.GetKeepalive() != nil:
			c.keepalives++
		case ev.GetStart() != nil:
			e.t.Fatalf("a second start event: %v", ev)
		}
	}
}

// start starts req and reads its start event.
func start(t *testing.T, ctx context.Context, pc processconnect.ProcessClient, req *connect.Request[process.StartRequest]) (*events, uint32) {
	t.Helper()
	s, err := pc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	ev := startEvents(t, s)
	return ev, ev.pid()
}

// shell runs script with bash. E2B's SDK sends "/bin/bash -l -c"; the tests
// leave out -l, which on a test host reads its login profile (pyenv's rehash
// lock there can stall a login shell for a minute).
func shell(script string) *process.ProcessConfig {
	return &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", script}}
}

func ptr[T any](v T) *T { return &v }

func TestEnvdStart(t *testing.T) {
	a := startEnvd(t, "")
	a.codecs(t, func(t *testing.T, pc processconnect.ProcessClient) {
		ctx := ctxT(t, 30*time.Second)
		req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{
			Cmd:  "/bin/bash",
			Args: []string{"-c", `echo out; echo err >&2; echo "$SANDBOX_VAR $SHARED $REQ_VAR $HOME $USER $LOGNAME"; pwd; exit 3`},
			Envs: map[string]string{"SHARED": "request", "REQ_VAR": "r"},
			Cwd:  ptr("/tmp"),
		}, Stdin: ptr(false)})
		ev, _ := start(t, ctx, pc, req)
		c := ev.until(nil)
		if c.err != nil {
			t.Fatalf("stream: %v", c.err)
		}
		root, _ := user.Lookup("root")
		if want := "out\nfrom-sandbox request r " + root.HomeDir + " root root\n/tmp\n"; c.stdout != want || c.stderr != "err\n" {
			t.Fatalf("stdout %q stderr %q, want %q and \"err\\n\"", c.stdout, c.stderr, want)
		}
		if e := c.end; e == nil || e.GetExitCode() != 3 || !e.GetExited() || e.GetStatus() != "exit status 3" || e.GetError() != "exit status 3" {
			t.Fatalf("end %v, want exit code 3, exited, status and error \"exit status 3\"", c.end)
		}

		// Exit 0 carries no error; cwd defaults to the user's home.
		ev, _ = start(t, ctx, pc, connect.NewRequest(&process.StartRequest{Process: shell("pwd")}))
		c = ev.until(nil)
		if c.stdout != root.HomeDir+"\n" || c.end == nil || c.end.GetExitCode() != 0 || !c.end.GetExited() || c.end.Error != nil || c.end.GetStatus() != "exit status 0" {
			t.Fatalf("pwd: stdout %q end %v", c.stdout, c.end)
		}
	})
}

func TestEnvdStartErrors(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	for _, tc := range []struct {
		name string
		req  *process.StartRequest
		hdr  string
		code connect.Code
		msg  string
	}{
		{"empty cmd", &process.StartRequest{Process: &process.ProcessConfig{}}, "", connect.CodeInvalidArgument, "cmd is empty"},
		{"missing program", &process.StartRequest{Process: &process.ProcessConfig{Cmd: "no-such-program-xyz"}}, "", connect.CodeInvalidArgument, "not found"},
		{"missing cwd", &process.StartRequest{Process: &process.ProcessConfig{Cmd: "true", Cwd: ptr("/no/such/dir")}}, "", connect.CodeInvalidArgument, "/no/such/dir"},
		{"unknown user", &process.StartRequest{Process: &process.ProcessConfig{Cmd: "true"}}, basicUser("no-such-user-xyz"), connect.CodeInvalidArgument, `user "no-such-user-xyz" does not exist`},
		{"default user absent", &process.StartRequest{Process: &process.ProcessConfig{Cmd: "true"}}, "-", connect.CodeInvalidArgument, `name one, e.g. "root"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.hdr == "-" {
				if _, err := user.Lookup(proto.EnvdDefaultUser); err == nil {
					t.Skipf("this host has a %q account", proto.EnvdDefaultUser)
				}
			}
			req := connect.NewRequest(tc.req)
			if tc.hdr == "-" {
				req.Header().Set("Authorization", basicUser(""))
			} else if tc.hdr != "" {
				req.Header().Set("Authorization", tc.hdr)
			}
			s, err := a.proc.Start(ctx, req)
			if err == nil {
				s.Receive()
				err = s.Err()
			}
			if connect.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("Start: %v, want %v containing %q", err, tc.code, tc.msg)
			}
		})
	}
}

// TestEnvdBackground: a process outlives its Start stream, List shows it with
// its tag and config, Connect by pid and by tag re-attaches to its output from
// then on, SIGKILL ends it with exited false, and then it is gone.
func TestEnvdBackground(t *testing.T) {
	a := startEnvd(t, "")
	a.codecs(t, func(t *testing.T, pc processconnect.ProcessClient) {
		ctx := ctxT(t, 60*time.Second)
		tag := "counter-" + t.Name()
		cfg := shell(`i=0; while true; do i=$((i+1)); echo $i; sleep 0.05; done`)
		sctx, cancel := context.WithCancel(ctx)
		ev, pid := start(t, sctx, pc, connect.NewRequest(&process.StartRequest{Process: cfg, Tag: &tag, Stdin: ptr(false)}))
		first := ev.until(func(c *collected) bool { return strings.Count(c.stdout, "\n") >= 2 })
		cancel() // the client goes away; the process goes on
		ev.s.Close()
		last := lastNumber(t, first.stdout)

		res, err := pc.List(ctx, connect.NewRequest(&process.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		var found *process.ProcessInfo
		for _, p := range res.Msg.GetProcesses() {
			if p.GetPid() == pid {
				found = p
			}
		}
		if found == nil || found.GetTag() != tag || found.GetConfig().GetCmd() != "/bin/bash" || strings.Join(found.GetConfig().GetArgs(), " ") != strings.Join(cfg.Args, " ") {
			t.Fatalf("List = %v, want pid %d with tag %q and its config", res.Msg.GetProcesses(), pid, tag)
		}

		for _, sel := range []*process.ProcessSelector{
			{Selector: &process.ProcessSelector_Pid{Pid: pid}},
			{Selector: &process.ProcessSelector_Tag{Tag: tag}},
		} {
			time.Sleep(300 * time.Millisecond) // detached meanwhile
			cctx, ccancel := context.WithCancel(ctx)
			cs, err := pc.Connect(cctx, connect.NewRequest(&process.ConnectRequest{Process: sel}))
			if err != nil {
				t.Fatal(err)
			}
			cev := connectEvents(t, cs)
			if got := cev.pid(); got != pid {
				t.Fatalf("Connect(%v) start pid %d, want %d", sel, got, pid)
			}
			c := cev.until(func(c *collected) bool { return strings.Count(c.stdout, "\n") >= 2 })
			// Output from now on: it kept counting while nobody followed it.
			if n := firstNumber(t, c.stdout); n <= last+2 {
				t.Fatalf("Connect(%v): first number %d, want well past %d (the process ran on, detached)", sel, n, last)
			}
			last = lastNumber(t, c.stdout)
			ccancel()
			cs.Close()
		}

		// Kill it while a Connect follows: the follower sees the end.
		cs, err := pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}}))
		if err != nil {
			t.Fatal(err)
		}
		cev := connectEvents(t, cs)
		cev.pid()
		if _, err := pc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
			t.Fatal(err)
		}
		c := cev.until(nil)
		if e := c.end; c.err != nil || e == nil || e.GetExited() || e.GetStatus() != "signal: killed" || e.GetExitCode() != -1 {
			t.Fatalf("end after SIGKILL: %v (stream %v), want exited false, status \"signal: killed\"", c.end, c.err)
		}
		_, err = pc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
			Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGKILL}))
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("SendSignal to a process that is gone: %v, want not_found", err)
		}
		_, err = pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: tag}}}))
		if err == nil {
			cs, _ := pc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: tag}}}))
			cs.Receive()
			err = cs.Err()
		}
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("Connect to a process that is gone: %v, want not_found", err)
		}
	})
}

func numbers(t *testing.T, out string) []int {
	t.Helper()
	var ns []int
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		n, err := strconv.Atoi(strings.TrimSpace(l))
		if err != nil {
			continue // a line cut by the chunking
		}
		ns = append(ns, n)
	}
	if len(ns) == 0 {
		t.Fatalf("no numbers in %q", out)
	}
	return ns
}

func firstNumber(t *testing.T, out string) int { n := numbers(t, out); return n[0] }
func lastNumber(t *testing.T, out string) int  { n := numbers(t, out); return n[len(n)-1] }

// TestEnvdSignalTerm: SIGTERM reaches the process's group.
func TestEnvdSignalTerm(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	ev, pid := start(t, ctx, a.proc, connect.NewRequest(&process.StartRequest{Process: shell("sleep 60 | cat; echo never")}))
	if _, err := a.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGTERM})); err != nil {
		t.Fatal(err)
	}
	c := ev.until(nil)
	if c.end == nil || c.end.GetExited() || c.end.GetStatus() != "signal: terminated" || strings.Contains(c.stdout, "never") {
		t.Fatalf("after SIGTERM: end %v stdout %q", c.end, c.stdout)
	}
	if _, err := a.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("SendSignal without a signal: %v, want invalid_argument", err)
	}
}

// TestEnvdStdin: stdin true (and absent) keeps a pipe for SendInput and
// StreamInput until CloseStdin; false gives /dev/null.
func TestEnvdStdin(t *testing.T) {
	a := startEnvd(t, "")
	a.codecs(t, func(t *testing.T, pc processconnect.ProcessClient) {
		ctx := ctxT(t, 30*time.Second)
		for _, stdin := range []*bool{ptr(true), nil} {
			ev, pid := start(t, ctx, pc, connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "cat"}, Stdin: stdin}))
			sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
			if _, err := pc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
				Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte("hello\n")}}})); err != nil {
				t.Fatal(err)
			}
			c := ev.until(func(c *collected) bool { return c.stdout == "hello\n" })
			if c.stdout != "hello\n" {
				t.Fatalf("stdin %v: echoed %q", stdin, c.stdout)
			}
			if _, err := pc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
				Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte("x")}}})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
				t.Fatalf("pty input to a process without a pty: %v, want failed_precondition", err)
			}
			in := pc.StreamInput(ctx)
			in.Send(&process.StreamInputRequest{Event: &process.StreamInputRequest_Start{Start: &process.StreamInputRequest_StartEvent{Process: sel}}})
			for _, w := range []string{"a", "b", "c\n"} {
				in.Send(&process.StreamInputRequest{Event: &process.StreamInputRequest_Data{Data: &process.StreamInputRequest_DataEvent{
					Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte(w)}}}}})
			}
			if _, err := in.CloseAndReceive(); err != nil {
				t.Fatalf("StreamInput: %v", err)
			}
			if _, err := pc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: sel})); err != nil {
				t.Fatal(err)
			}
			c = ev.until(nil)
			if c.stdout != "abc\n" || c.end == nil || c.end.GetExitCode() != 0 || !c.end.GetExited() {
				t.Fatalf("after StreamInput and CloseStdin: stdout %q end %v", c.stdout, c.end)
			}
		}

		// stdin false: /dev/null, cat ends at once; no input can be sent.
		ev, _ := start(t, ctx, pc, connect.NewRequest(&process.StartRequest{Process: shell("cat; echo done"), Stdin: ptr(false)}))
		c := ev.until(nil)
		if c.stdout != "done\n" || c.end.GetExitCode() != 0 {
			t.Fatalf("stdin false: stdout %q end %v", c.stdout, c.end)
		}
	})
}

// TestEnvdPTY: a terminal of the asked size as controlling terminal, input as
// pty bytes, resize with Update.
func TestEnvdPTY(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	ev, pid := start(t, ctx, a.proc, connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", `tty >/dev/null && echo is-a-tty; stty size; read -r line; echo "got:$line"; stty size; read -r _`},
			Envs: map[string]string{"TERM": "xterm-256color"}},
		Pty: &process.PTY{Size: &process.PTY_Size{Cols: 80, Rows: 24}},
	}))
	sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
	c := ev.until(func(c *collected) bool { return strings.Contains(c.pty, "24 80") })
	if !strings.Contains(c.pty, "is-a-tty") || !strings.Contains(c.pty, "24 80") || c.stdout != "" {
		t.Fatalf("pty output %q (stdout %q), want is-a-tty and \"24 80\"", c.pty, c.stdout)
	}
	if _, err := a.proc.Update(ctx, connect.NewRequest(&process.UpdateRequest{Process: sel, Pty: &process.PTY{Size: &process.PTY_Size{Cols: 120, Rows: 40}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := a.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
		Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte("hi\n")}}})); err != nil {
		t.Fatal(err)
	}
	c = ev.until(func(c *collected) bool { return strings.Contains(c.pty, "40 120") })
	if !strings.Contains(c.pty, "got:hi") || !strings.Contains(c.pty, "40 120") {
		t.Fatalf("pty output %q, want got:hi and the new size \"40 120\"", c.pty)
	}
	if _, err := a.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: sel})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("CloseStdin on a pty: %v, want failed_precondition", err)
	}
	if _, err := a.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
		Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte("x")}}})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("stdin input to a pty process: %v, want failed_precondition", err)
	}
	if _, err := a.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
		Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte("bye\n")}}})); err != nil {
		t.Fatal(err)
	}
	c = ev.until(nil)
	if c.end == nil || c.end.GetExitCode() != 0 {
		t.Fatalf("pty process end %v (stream %v)", c.end, c.err)
	}
}

// TestEnvdKeepalive: a quiet stream gets keepalives at the asked interval.
func TestEnvdKeepalive(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	req := connect.NewRequest(&process.StartRequest{Process: shell("sleep 2.5; echo x")})
	req.Header().Set("Keepalive-Ping-Interval", "1")
	ev, _ := start(t, ctx, a.proc, req)
	c := ev.until(nil)
	if c.keepalives < 1 || c.keepalives > 3 || c.stdout != "x\n" {
		t.Fatalf("%d keepalives in 2.5 s at 1 s, stdout %q", c.keepalives, c.stdout)
	}
}

// TestEnvdTimeoutKills: as E2B's envd, a command dies when its Start call's
// timeout passes.
func TestEnvdTimeoutKills(t *testing.T) {
	a := startEnvd(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	ev, pid := start(t, ctx, a.proc, connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "sleep", Args: []string{"60"}}}))
	c := ev.until(nil)
	if connect.CodeOf(c.err) != connect.CodeDeadlineExceeded {
		t.Fatalf("stream ended with %v, want deadline_exceeded", c.err)
	}
	waitDead(t, int(pid), 5*time.Second)
}

// TestEnvdUser runs a command, makes a directory and writes a file as another
// user (nobody): uid, groups, HOME/USER/LOGNAME and ownership are that user's.
func TestEnvdUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("switching users needs root")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Skip("no nobody account")
	}
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/sh",
		Args: []string{"-c", `id -u; id -g; echo "$HOME $USER $LOGNAME"`}, Cwd: ptr("/")}})
	req.Header().Set("Authorization", basicUser("nobody"))
	ev, _ := start(t, ctx, a.proc, req)
	c := ev.until(nil)
	if want := nobody.Uid + "\n" + nobody.Gid + "\n" + nobody.HomeDir + " nobody nobody\n"; c.stdout != want {
		t.Fatalf("as nobody: %q (stderr %q), want %q", c.stdout, c.stderr, want)
	}

	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	mk := connect.NewRequest(&filesystem.MakeDirRequest{Path: dir + "/made/by"})
	mk.Header().Set("Authorization", basicUser("nobody"))
	res, err := a.fs.MakeDir(ctx, mk)
	if err != nil {
		t.Fatal(err)
	}
	if res.Msg.GetEntry().GetOwner() != "nobody" {
		t.Fatalf("MakeDir as nobody: owner %q", res.Msg.GetEntry().GetOwner())
	}
	for _, p := range []string{dir + "/made", dir + "/made/by"} {
		if st, _ := os.Stat(p); st == nil || st.Sys().(*syscall.Stat_t).Uid != uint32(atoi(t, nobody.Uid)) {
			t.Fatalf("%s is not owned by nobody", p)
		}
	}
	status, body := a.upload(t, dir+"/files/f.txt", "nobody", "application/octet-stream", "", strings.NewReader("x"))
	if status != 200 {
		t.Fatalf("upload as nobody: %d %s", status, body)
	}
	for _, p := range []string{dir + "/files", dir + "/files/f.txt"} {
		if st, _ := os.Stat(p); st == nil || st.Sys().(*syscall.Stat_t).Uid != uint32(atoi(t, nobody.Uid)) {
			t.Fatalf("%s is not owned by nobody", p)
		}
	}
}

func atoi(t *testing.T, s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnvdFilesystem(t *testing.T) {
	a := startEnvd(t, "")
	for _, codec := range []struct {
		name string
		fc   filesystemconnect.FilesystemClient
	}{{"json", a.fs}, {"binary", a.binFS}} {
		t.Run(codec.name, func(t *testing.T) {
			fc := codec.fc
			ctx := ctxT(t, 30*time.Second)
			dir := t.TempDir()
			mk, err := fc.MakeDir(ctx, connect.NewRequest(&filesystem.MakeDirRequest{Path: dir + "/a/b/c"}))
			if err != nil {
				t.Fatal(err)
			}
			if e := mk.Msg.GetEntry(); e.GetName() != "c" || e.GetPath() != dir+"/a/b/c" || e.GetType() != filesystem.FileType_FILE_TYPE_DIRECTORY {
				t.Fatalf("MakeDir entry %v", e)
			}
			if _, err := fc.MakeDir(ctx, connect.NewRequest(&filesystem.MakeDirRequest{Path: dir + "/a/b"})); connect.CodeOf(err) != connect.CodeAlreadyExists {
				t.Fatalf("MakeDir of an existing directory: %v, want already_exists", err)
			}
			if err := os.WriteFile(dir+"/a/f.txt", []byte("hello"), 0o640); err != nil {
				t.Fatal(err)
			}
			mtime := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
			os.Chtimes(dir+"/a/f.txt", mtime, mtime)
			os.Symlink("f.txt", dir+"/a/link")
			if _, err := fc.MakeDir(ctx, connect.NewRequest(&filesystem.MakeDirRequest{Path: dir + "/a/f.txt"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("MakeDir over a file: %v, want invalid_argument", err)
			}

			st, err := fc.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: dir + "/a/f.txt"}))
			if err != nil {
				t.Fatal(err)
			}
			me, _ := user.Current()
			grp, _ := user.LookupGroupId(me.Gid)
			e := st.Msg.GetEntry()
			if e.GetName() != "f.txt" || e.GetType() != filesystem.FileType_FILE_TYPE_FILE || e.GetPath() != dir+"/a/f.txt" || e.GetSize() != 5 ||
				e.GetMode() != 0o640 || e.GetPermissions() != "-rw-r-----" || e.GetOwner() != me.Username || e.GetGroup() != grp.Name ||
				!e.GetModifiedTime().AsTime().Equal(mtime) || e.SymlinkTarget != nil {
				t.Fatalf("Stat = %v", e)
			}
			st, err = fc.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: dir + "/a/link"}))
			if err != nil {
				t.Fatal(err)
			}
			if e := st.Msg.GetEntry(); e.GetSymlinkTarget() != dir+"/a/f.txt" || e.GetType() != filesystem.FileType_FILE_TYPE_FILE || !strings.HasPrefix(e.GetPermissions(), "L") {
				t.Fatalf("Stat of a symlink = %v", e)
			}
			if _, err := fc.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: dir + "/nope"})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Fatalf("Stat of a missing path: %v, want not_found", err)
			}
			// A relative path is taken from the user's home.
			home, _ := user.Lookup("root")
			st, err = fc.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "."}))
			if err != nil || st.Msg.GetEntry().GetPath() != home.HomeDir {
				t.Fatalf("Stat(\".\") = %v, %v; want root's home %s", st, err, home.HomeDir)
			}

			list := func(p string, depth uint32) []string {
				t.Helper()
				res, err := fc.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: p, Depth: depth}))
				if err != nil {
					t.Fatal(err)
				}
				var names []string
				for _, e := range res.Msg.GetEntries() {
					names = append(names, strings.TrimPrefix(e.GetPath(), dir+"/"))
				}
				sort.Strings(names)
				return names
			}
			if got := strings.Join(list(dir+"/a", 1), " "); got != "a/b a/f.txt a/link" {
				t.Fatalf("ListDir depth 1 = %s", got)
			}
			if got := strings.Join(list(dir+"/a", 0), " "); got != "a/b a/f.txt a/link" {
				t.Fatalf("ListDir depth 0 (= 1) = %s", got)
			}
			if got := strings.Join(list(dir+"/a", 2), " "); got != "a/b a/b/c a/f.txt a/link" {
				t.Fatalf("ListDir depth 2 = %s", got)
			}
			if _, err := fc.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: dir + "/a/f.txt"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("ListDir of a file: %v, want invalid_argument", err)
			}
			if _, err := fc.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: dir + "/nope"})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Fatalf("ListDir of a missing directory: %v, want not_found", err)
			}

			mv, err := fc.Move(ctx, connect.NewRequest(&filesystem.MoveRequest{Source: dir + "/a/f.txt", Destination: dir + "/moved/g.txt"}))
			if err != nil {
				t.Fatal(err)
			}
			if e := mv.Msg.GetEntry(); e.GetPath() != dir+"/moved/g.txt" || e.GetSize() != 5 {
				t.Fatalf("Move entry %v", e)
			}
			if b, _ := os.ReadFile(dir + "/moved/g.txt"); string(b) != "hello" {
				t.Fatalf("moved file holds %q", b)
			}
			if _, err := fc.Move(ctx, connect.NewRequest(&filesystem.MoveRequest{Source: dir + "/a/f.txt", Destination: dir + "/x"})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Fatalf("Move of a missing file: %v, want not_found", err)
			}
			if _, err := fc.Remove(ctx, connect.NewRequest(&filesystem.RemoveRequest{Path: dir + "/a"})); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(dir + "/a"); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("Remove left %s: %v", dir+"/a", err)
			}
		})
	}
}

// TestEnvdWatch: WatchDir streams events, recursive or not; the polled watcher
// gathers them for GetWatcherEvents.
func TestEnvdWatch(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	for _, recursive := range []bool{true, false} {
		t.Run(fmt.Sprintf("recursive=%v", recursive), func(t *testing.T) {
			dir := t.TempDir()
			os.Mkdir(dir+"/old", 0o755)
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			s, err := a.fs.WatchDir(wctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: dir, Recursive: recursive}))
			if err != nil {
				t.Fatal(err)
			}
			if !s.Receive() || s.Msg().GetStart() == nil {
				t.Fatalf("first watch event %v (%v), want start", s.Msg(), s.Err())
			}
			os.WriteFile(dir+"/f", []byte("x"), 0o644)
			os.WriteFile(dir+"/old/g", []byte("x"), 0o644)
			os.Mkdir(dir+"/new", 0o755)
			time.Sleep(100 * time.Millisecond) // the new directory is added on its create event
			os.WriteFile(dir+"/new/h", []byte("x"), 0o644)
			os.Remove(dir + "/f")
			os.WriteFile(dir+"/end", nil, 0o644)
			seen := map[string]bool{}
			for s.Receive() {
				fe := s.Msg().GetFilesystem()
				if fe == nil {
					continue
				}
				seen[fe.GetName()+" "+fe.GetType().String()] = true
				if fe.GetName() == "end" {
					break
				}
			}
			for _, want := range []string{"f EVENT_TYPE_CREATE", "f EVENT_TYPE_WRITE", "f EVENT_TYPE_REMOVE", "new EVENT_TYPE_CREATE"} {
				if !seen[want] {
					t.Errorf("no event %q in %v", want, seen)
				}
			}
			for _, sub := range []string{"old/g EVENT_TYPE_CREATE", "new/h EVENT_TYPE_CREATE"} {
				if seen[sub] != recursive {
					t.Errorf("event %q seen %v, want %v (recursive %v): %v", sub, seen[sub], recursive, recursive, seen)
				}
			}
		})
	}
	if _, err := a.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: "/no/such/dir"})); err == nil {
		s, _ := a.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: "/no/such/dir"}))
		s.Receive()
		if connect.CodeOf(s.Err()) != connect.CodeNotFound {
			t.Fatalf("WatchDir of a missing directory: %v, want not_found", s.Err())
		}
	}

	dir := t.TempDir()
	cw, err := a.fs.CreateWatcher(ctx, connect.NewRequest(&filesystem.CreateWatcherRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.GetWatcherId()
	os.WriteFile(dir+"/p", []byte("x"), 0o644)
	var got []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && len(got) < 2; time.Sleep(20 * time.Millisecond) {
		res, err := a.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystem.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, fe := range res.Msg.GetEvents() {
			got = append(got, fe.GetName()+" "+fe.GetType().String())
		}
	}
	if len(got) < 2 || got[0] != "p EVENT_TYPE_CREATE" || got[1] != "p EVENT_TYPE_WRITE" {
		t.Fatalf("polled events %v, want p's create and write", got)
	}
	if _, err := a.fs.RemoveWatcher(ctx, connect.NewRequest(&filesystem.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := a.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystem.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("GetWatcherEvents after RemoveWatcher: %v, want not_found", err)
	}
}

// upload POSTs body to envd's /files (path and username in the query when not
// "") and returns the status and body.
func (a *envdAgent) upload(t *testing.T, path, username, ctype, cenc string, body io.Reader) (int, string) {
	t.Helper()
	q := url.Values{}
	if path != "" {
		q.Set("path", path)
	}
	if username != "" {
		q.Set("username", username)
	}
	req, _ := http.NewRequest(http.MethodPost, envdURL+"/files?"+q.Encode(), body)
	req.Header.Set("Content-Type", ctype)
	if cenc != "" {
		req.Header.Set("Content-Encoding", cenc)
	}
	resp, err := a.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (a *envdAgent) get(t *testing.T, path string, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	return a.do(t, http.MethodGet, path, hdr, nil)
}

// do sends an envd request with the headers hdr and answers the response and
// its body.
func (a *envdAgent) do(t *testing.T, method, path string, hdr map[string]string, body io.Reader) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, envdURL+path, body)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := a.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestEnvdHTTP: /files (octet-stream, multipart with several files, gzip both
// ways, errors), /envs and /health, reached through the path rewrite.
func TestEnvdHTTP(t *testing.T) {
	a := startEnvd(t, "")
	dir := t.TempDir()

	status, body := a.upload(t, dir+"/raw/one.bin", "root", "application/octet-stream", "", strings.NewReader("raw bytes"))
	if status != 200 || body != `[{"path":"`+dir+`/raw/one.bin","name":"one.bin","type":"file"}]` {
		t.Fatalf("octet-stream upload: %d %s", status, body)
	}
	resp, b := a.get(t, "/files?path="+url.QueryEscape(dir+"/raw/one.bin"), nil)
	if resp.StatusCode != 200 || string(b) != "raw bytes" {
		t.Fatalf("GET /files: %d %q", resp.StatusCode, b)
	}

	// Several files in one multipart body, their paths in the file names (as
	// the SDK's writeFiles sends them).
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for _, f := range []struct{ name, data string }{{dir + "/m/x.txt", "xx"}, {dir + "/m/sub/y.txt", "yyy"}} {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", fmt.Sprintf(`form-data; name="file"; filename=%q`, f.name))
		h.Set("Content-Type", "application/octet-stream")
		w, _ := mw.CreatePart(h)
		io.WriteString(w, f.data)
	}
	mw.Close()
	status, body = a.upload(t, "", "", mw.FormDataContentType(), "", &mp)
	var written []map[string]string
	if status != 200 || json.Unmarshal([]byte(body), &written) != nil || len(written) != 2 || written[1]["path"] != dir+"/m/sub/y.txt" || written[1]["name"] != "y.txt" || written[1]["type"] != "file" {
		t.Fatalf("multipart upload: %d %s", status, body)
	}
	if b, _ := os.ReadFile(dir + "/m/sub/y.txt"); string(b) != "yyy" {
		t.Fatalf("multipart file holds %q", b)
	}

	// One multipart file at ?path=, gzip-encoded.
	mp.Reset()
	mw = multipart.NewWriter(&mp)
	w, _ := mw.CreateFormFile("file", "ignored-name")
	io.WriteString(w, "via path")
	mw.Close()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(mp.Bytes())
	zw.Close()
	status, body = a.upload(t, dir+"/gz.txt", "", mw.FormDataContentType(), "gzip", &gz)
	if b, _ := os.ReadFile(dir + "/gz.txt"); status != 200 || string(b) != "via path" {
		t.Fatalf("gzip multipart upload: %d %s; file holds %q", status, body, b)
	}

	// A gzip answer when asked for (the transport does not decompress).
	resp, b = a.get(t, "/files?path="+url.QueryEscape(dir+"/gz.txt"), map[string]string{"Accept-Encoding": "gzip"})
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("GET with Accept-Encoding gzip: Content-Encoding %q", resp.Header.Get("Content-Encoding"))
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if plain, _ := io.ReadAll(zr); string(plain) != "via path" {
		t.Fatalf("gzip answer decodes to %q", plain)
	}

	for _, tc := range []struct {
		name, path string
		status     int
		msg        string
	}{
		{"missing", "/files?path=" + url.QueryEscape(dir+"/nope"), 404, "does not exist"},
		{"directory", "/files?path=" + url.QueryEscape(dir), 400, "is a directory"},
		{"unknown user", "/files?username=no-such-user-xyz&path=" + url.QueryEscape(dir+"/gz.txt"), 400, "does not exist in this sandbox"},
	} {
		resp, b := a.get(t, tc.path, nil)
		var eb struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if resp.StatusCode != tc.status || json.Unmarshal(b, &eb) != nil || eb.Code != tc.status || !strings.Contains(eb.Message, tc.msg) {
			t.Errorf("GET /files %s: %d %s, want %d {code,message} with %q", tc.name, resp.StatusCode, b, tc.status, tc.msg)
		}
	}
	if status, body := a.upload(t, "", "", "application/octet-stream", "", strings.NewReader("x")); status != 400 || !strings.Contains(body, "path") {
		t.Fatalf("octet-stream upload without a path: %d %s", status, body)
	}
	if status, body := a.upload(t, dir+"/t", "", "text/plain", "", strings.NewReader("x")); status != 400 || !strings.Contains(body, "unsupported content type") {
		t.Fatalf("text/plain upload: %d %s", status, body)
	}

	resp, b = a.get(t, "/envs", nil)
	var env map[string]string
	if resp.StatusCode != 200 || json.Unmarshal(b, &env) != nil || env["SANDBOX_VAR"] != "from-sandbox" || len(env) != len(envdEnv) {
		t.Fatalf("GET /envs: %d %s", resp.StatusCode, b)
	}
	if resp, b := a.get(t, "/health", nil); resp.StatusCode != 204 || len(b) != 0 {
		t.Fatalf("GET /health (envd): %d %q, want 204", resp.StatusCode, b)
	}
	// torpor's own routes are not reachable through envd's paths.
	for _, p := range []string{"/exec", "/resume", "/envd/health", proto.PathPrepareHibernate} {
		if resp, b := a.get(t, p, nil); resp.StatusCode != 404 {
			t.Fatalf("GET %s through envd: %d %s, want 404", p, resp.StatusCode, b)
		}
	}
	// torpor's own /health and /files are unchanged beside envd's.
	if h, err := a.ac.Info(context.Background()); err != nil || h.ProtocolVersion != proto.Version {
		t.Fatalf("torpor health: %+v, %v", h, err)
	}
	rc, _, err := a.ac.ReadFile(context.Background(), dir+"/gz.txt")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(rc); string(b) != "via path" {
		t.Fatalf("torpor GET /files: %q", b)
	}
	rc.Close()
}

// TestEnvdGRPC: the same handler answers gRPC over cleartext HTTP/2.
func TestEnvdGRPC(t *testing.T) {
	a := startEnvd(t, "")
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: asUser{&http.Transport{Protocols: &protocols,
		DialTLSContext:  func(ctx context.Context, network, addr string) (net.Conn, error) { return nil, errors.New("no tls") },
		TLSClientConfig: &tls.Config{}}, "root"}}
	pc := processconnect.NewProcessClient(h2, "http://"+a.addr, connect.WithGRPC())
	ctx := ctxT(t, 30*time.Second)
	ev, _ := start(t, ctx, pc, connect.NewRequest(&process.StartRequest{Process: shell("echo grpc")}))
	if c := ev.until(nil); c.stdout != "grpc\n" || c.end.GetExitCode() != 0 {
		t.Fatalf("gRPC Start: stdout %q end %v err %v", c.stdout, c.end, c.err)
	}
}

// TestEnvdStreamsCutOnResume: a resume announced to the agent ends the envd
// streams opened before it (their client's connection did not survive the
// checkpoint); the processes run on and can be re-attached.
func TestEnvdStreamsCutOnResume(t *testing.T) {
	testEnvdStreamsCut(t, "a resume", func(ctx context.Context, a *envdAgent) error {
		_, err := a.ac.Resume(ctx, proto.ResumeRequest{Generation: 2, HostTime: time.Now()})
		return err
	})
}

// TestEnvdStreamsEndedForHibernate: POST /hibernate/prepare ends the open
// envd streams (a command's output, a watch) and counts them; the processes
// run on and can be re-attached, as after the resume.
func TestEnvdStreamsEndedForHibernate(t *testing.T) {
	testEnvdStreamsCut(t, "a hibernate's prepare", func(ctx context.Context, a *envdAgent) error {
		n, err := a.ac.PrepareHibernate(ctx)
		if err == nil && n != 2 {
			err = fmt.Errorf("prepare ended %d streams, want 2 (Start and WatchDir)", n)
		}
		return err
	})
}

// testEnvdStreamsCut opens a Start stream of a command that goes on printing
// and a WatchDir stream, calls cut, and checks that both streams end with
// unavailable within seconds and that Connect re-attaches to the command.
func testEnvdStreamsCut(t *testing.T, what string, cut func(context.Context, *envdAgent) error) {
	a := startEnvd(t, filepath.Join(t.TempDir(), "run"))
	ctx := ctxT(t, 30*time.Second)
	ev, pid := start(t, ctx, a.proc, connect.NewRequest(&process.StartRequest{Process: shell("while true; do echo tick; sleep 0.05; done")}))
	ev.until(func(c *collected) bool { return strings.Contains(c.stdout, "tick") })
	w, err := a.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: t.TempDir()}))
	if err != nil {
		t.Fatal(err)
	}
	w.Receive()

	if err := cut(ctx, a); err != nil {
		t.Fatal(err)
	}
	done := make(chan *collected, 1)
	go func() { done <- ev.until(nil) }()
	select {
	case c := <-done:
		if connect.CodeOf(c.err) != connect.CodeUnavailable || c.end != nil {
			t.Fatalf("Start stream after %s ended with %v (end %v), want unavailable", what, c.err, c.end)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("the Start stream was not cut by %s", what)
	}
	for w.Receive() {
	}
	if connect.CodeOf(w.Err()) != connect.CodeUnavailable {
		t.Fatalf("WatchDir stream after %s ended with %v, want unavailable", what, w.Err())
	}
	cs, err := a.proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	cev := connectEvents(t, cs)
	cev.pid()
	if c := cev.until(func(c *collected) bool { return strings.Contains(c.stdout, "tick") }); !strings.Contains(c.stdout, "tick") {
		t.Fatalf("re-attached after %s: %q (%v)", what, c.stdout, c.err)
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestEnvdFileMetadata: X-Metadata-* headers of an upload become the file's
// metadata (user.e2b.* extended attributes, keys lower-cased), answered by the
// upload and by Stat and ListDir; an upload replaces the whole set; bad
// metadata is refused with 400 and writes nothing.
func TestEnvdFileMetadata(t *testing.T) {
	a := startEnvd(t, "")
	ctx := ctxT(t, 30*time.Second)
	dir := t.TempDir()
	post := func(path string, hdr map[string]string, multi bool) (int, []map[string]any) {
		t.Helper()
		body, ctype := io.Reader(strings.NewReader("data")), "application/octet-stream"
		if multi {
			var mp bytes.Buffer
			mw := multipart.NewWriter(&mp)
			w, _ := mw.CreateFormFile("file", path)
			io.WriteString(w, "data")
			mw.Close()
			body, ctype = &mp, mw.FormDataContentType()
		}
		h := map[string]string{"Content-Type": ctype}
		for k, v := range hdr {
			h[k] = v
		}
		resp, b := a.do(t, http.MethodPost, "/files?path="+url.QueryEscape(path), h, body)
		var out []map[string]any
		if resp.StatusCode == 200 {
			if err := json.Unmarshal(b, &out); err != nil || len(out) != 1 {
				t.Fatalf("upload answer %s: %v", b, err)
			}
		}
		return resp.StatusCode, out
	}
	stat := func(path string) map[string]string {
		t.Helper()
		res, err := a.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: path}))
		if err != nil {
			t.Fatal(err)
		}
		return res.Msg.GetEntry().GetMetadata()
	}
	f := dir + "/m.txt"
	for _, multi := range []bool{false, true} {
		status, out := post(f, map[string]string{"X-Metadata-Author": "mish", "x-metadata-purpose": "upload test", "X-Other": "no"}, multi)
		want := map[string]any{"author": "mish", "purpose": "upload test"}
		if status != 200 || !reflect.DeepEqual(out[0]["metadata"], want) {
			t.Fatalf("upload (multipart %v) with metadata: %d %v, want metadata %v", multi, status, out, want)
		}
		if got := stat(f); !reflect.DeepEqual(got, map[string]string{"author": "mish", "purpose": "upload test"}) {
			t.Fatalf("Stat metadata %v", got)
		}
	}
	if v, err := unix.Getxattr(f, "user.e2b.author", make([]byte, 16)); err != nil || v != 4 {
		t.Fatalf("xattr user.e2b.author: %d bytes, %v", v, err)
	}
	res, err := a.fs.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: dir}))
	if err != nil || len(res.Msg.GetEntries()) != 1 || res.Msg.GetEntries()[0].GetMetadata()["author"] != "mish" {
		t.Fatalf("ListDir: %v %v", res.Msg.GetEntries(), err)
	}

	// Written again: the new set replaces the old one, keys left out go.
	if status, out := post(f, map[string]string{"X-Metadata-Author": "ana"}, false); status != 200 || !reflect.DeepEqual(out[0]["metadata"], map[string]any{"author": "ana"}) {
		t.Fatalf("second upload: %d %v", status, out)
	}
	if status, out := post(f, nil, false); status != 200 || out[0]["metadata"] != nil {
		t.Fatalf("upload without metadata: %d %v, want no metadata", status, out)
	}
	if got := stat(f); got != nil {
		t.Fatalf("Stat after an upload without metadata: %v", got)
	}

	for _, bad := range []map[string]string{
		{"X-Metadata-K": "caf\u00e9"},
		{"X-Metadata-" + strings.Repeat("k", 250): "v"},
		{"X-Metadata-Big": strings.Repeat("v", 4100)},
	} {
		if status, _ := post(dir+"/bad.txt", bad, false); status != 400 {
			t.Errorf("upload with metadata %.40v: %d, want 400", bad, status)
		}
	}
	if _, err := os.Stat(dir + "/bad.txt"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused upload wrote its file: %v", err)
	}
}
