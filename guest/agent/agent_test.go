package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/guest/agent"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// startAgent serves the agent on 127.0.0.1:0 until the test ends and returns a client.
func startAgent(t *testing.T) *agentclient.Client {
	c, _ := startAgentCounting(t)
	return c
}

// startAgentCounting is startAgent that also returns the number of connections dialled.
func startAgentCounting(t *testing.T) (*agentclient.Client, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- agent.Serve(ctx, ln, agent.Options{Env: map[string]string{"SANDBOX_VAR": "from-sandbox", "SHARED": "sandbox"}})
	}()
	dial := agentclient.TCPDialer(ln.Addr().String())
	var dials atomic.Int64
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		dials.Add(1)
		return dial(ctx)
	})
	t.Cleanup(func() {
		c.CloseIdleConnections()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	if err := c.WaitReady(context.Background(), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	return c, &dials
}

// killPid kills pid with SIGKILL when the test ends.
func killPid(t *testing.T, pid int) {
	t.Helper()
	if pid <= 1 {
		t.Fatalf("bad pid %d", pid)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] != 'Z'
}

func waitDead(t *testing.T, pid int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d still alive after %v", pid, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestHealth(t *testing.T) {
	c := startAgent(t)
	h, err := c.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !h.OK || h.Pid != os.Getpid() || h.StartedAt.IsZero() {
		t.Fatalf("health = %+v", h)
	}
	// Since protocol version 2 the agent reports its version and build, and the
	// client learnt them at WaitReady.
	if h.ProtocolVersion != proto.Version || !strings.HasPrefix(h.Agent, "torpor-agent ") {
		t.Fatalf("health = %+v, want protocol_version %d and an agent build", h, proto.Version)
	}
	if v := c.ProtocolVersion(); v != proto.Version {
		t.Fatalf("client ProtocolVersion() = %d, want %d", v, proto.Version)
	}
	if b := c.AgentBuild(); b != h.Agent {
		t.Fatalf("client AgentBuild() = %q, want %q", b, h.Agent)
	}
}

func TestExec(t *testing.T) {
	c := startAgent(t)
	tmp := t.TempDir()
	tests := []struct {
		name       string
		req        proto.ExecRequest
		stdout     string
		stderr     string
		code       int
		stdoutPart bool // stdout need only contain the expected text
	}{
		{name: "stdout", req: proto.ExecRequest{Cmd: []string{"echo", "hello", "world"}}, stdout: "hello world\n"},
		{name: "stderr and exit code", req: proto.ExecRequest{Cmd: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}}, stdout: "out\n", stderr: "err\n", code: 3},
		{name: "stdin", req: proto.ExecRequest{Cmd: []string{"cat"}, Stdin: "line1\nline2"}, stdout: "line1\nline2"},
		{name: "no stdin is /dev/null", req: proto.ExecRequest{Cmd: []string{"cat"}}, stdout: ""},
		{name: "request env", req: proto.ExecRequest{Cmd: []string{"sh", "-c", `echo "$FOO"`}, Env: map[string]string{"FOO": "bar baz"}}, stdout: "bar baz\n"},
		{name: "sandbox env", req: proto.ExecRequest{Cmd: []string{"sh", "-c", `echo "$SANDBOX_VAR"`}}, stdout: "from-sandbox\n"},
		{name: "request env over sandbox env", req: proto.ExecRequest{Cmd: []string{"sh", "-c", `echo "$SHARED"`}, Env: map[string]string{"SHARED": "request"}}, stdout: "request\n"},
		{name: "default env", req: proto.ExecRequest{Cmd: []string{"sh", "-c", `echo "$HOME $LANG $PATH"`}}, stdout: "/root C.UTF-8 " + agent.DefaultPath + "\n"},
		{name: "default cwd", req: proto.ExecRequest{Cmd: []string{"pwd"}}, stdout: "/\n"},
		{name: "cwd", req: proto.ExecRequest{Cmd: []string{"pwd"}, Cwd: tmp}, stdout: tmp + "\n"},
		{name: "killed by signal", req: proto.ExecRequest{Cmd: []string{"sh", "-c", "kill -9 $$"}}, code: 137},
		{name: "absolute path", req: proto.ExecRequest{Cmd: []string{"/bin/sh", "-c", "exit 7"}}, code: 7},
		{name: "own process group", req: proto.ExecRequest{Cmd: []string{"sh", "-c", `[ "$(ps -o pgid= $$ | tr -d ' ')" = "$$" ] && echo leader`}}, stdout: "leader\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, stderr, code, err := c.Run(context.Background(), tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if string(stdout) != tt.stdout || string(stderr) != tt.stderr || code != tt.code {
				t.Fatalf("got stdout %q stderr %q code %d; want %q %q %d", stdout, stderr, code, tt.stdout, tt.stderr, tt.code)
			}
		})
	}
}

func TestExecLargeOutput(t *testing.T) {
	c := startAgent(t)
	stdout, _, code, err := c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"head", "-c", "3000000", "/dev/zero"}})
	if err != nil || code != 0 || len(stdout) != 3000000 {
		t.Fatalf("len %d code %d err %v", len(stdout), code, err)
	}
	big := strings.Repeat("x", 2<<20)
	stdout, _, code, err = c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"wc", "-c"}, Stdin: big})
	if err != nil || code != 0 || strings.TrimSpace(string(stdout)) != strconv.Itoa(len(big)) {
		t.Fatalf("wc: %q code %d err %v", stdout, code, err)
	}
}

func TestExecStreamsAsItArrives(t *testing.T) {
	c := startAgent(t)
	st, err := c.Exec(context.Background(), proto.ExecRequest{Cmd: []string{"sh", "-c", "echo first; sleep 1; echo second"}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	start := time.Now()
	ev, err := st.Next()
	if err != nil || ev.Stream != "stdout" || string(ev.Data) != "first\n" {
		t.Fatalf("first event %+v err %v", ev, err)
	}
	if d := time.Since(start); d > 700*time.Millisecond {
		t.Fatalf("first chunk took %v: not streamed", d)
	}
	if last := lastEvent(t, st); last.ExitCode == nil || *last.ExitCode != 0 {
		t.Fatalf("last event %+v", last)
	}
}

// lastEvent reads st to its end and returns its last event.
func lastEvent(t *testing.T, st *agentclient.ExecStream) proto.ExecEvent {
	t.Helper()
	var last proto.ExecEvent
	for {
		ev, err := st.Next()
		if err == io.EOF {
			return last
		}
		if err != nil {
			t.Fatalf("stream: %v", err)
		}
		last = ev
	}
}

func TestExecTimeout(t *testing.T) {
	c := startAgent(t)
	start := time.Now()
	// The grandchild sleep is in the same process group and must die too.
	stdout, stderr, code, err := c.Run(context.Background(), proto.ExecRequest{
		Cmd: []string{"sh", "-c", "sleep 30 & echo $!; wait"}, TimeoutS: 0.5})
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	pid, perr := strconv.Atoi(strings.TrimSpace(string(stdout)))
	if perr == nil {
		killPid(t, pid)
	}
	if code != 124 || !strings.HasSuffix(string(stderr), "torpor: timeout after 0.5s\n") {
		t.Fatalf("code %d stderr %q", code, stderr)
	}
	if elapsed > 1500*time.Millisecond {
		t.Fatalf("timeout of 0.5 s took %v", elapsed)
	}
	if perr != nil {
		t.Fatalf("grandchild pid: %v", perr)
	}
	waitDead(t, pid, 2*time.Second)
}

// TestExecTimeoutCountsTheWaitToStart: TimeoutS bounds the call from its
// arrival, also while the command cannot start yet (the reaper's lock held, as
// a fork that is slow to return holds it): the call answers 124 saying the
// command had not started, and the command never runs.
func TestExecTimeoutCountsTheWaitToStart(t *testing.T) {
	c := startAgent(t)
	marker := filepath.Join(t.TempDir(), "ran")
	release := agent.HoldReaper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, stderr, code, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{"touch", marker}, TimeoutS: 0.3})
	release()
	if err != nil || code != 124 || !strings.Contains(string(stderr), "torpor: timeout after 0.3s (the command had not started") {
		t.Fatalf("exec that could not start within its timeout: code %d err %v stderr %q, want 124 and the reason", code, err, stderr)
	}
	if out, _, code, err := c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"echo", "next"}}); err != nil || code != 0 || string(out) != "next\n" {
		t.Fatalf("the next exec: %q %d %v", out, code, err)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Errorf("the timed-out command ran after all (%v)", err)
	}
}

// TestExecTimeoutDoesNotWaitForTheReaper: once TimeoutS ran out and the
// command's group is killed, the call answers 124 even while its exit status
// cannot be collected (the reaper's lock held).
func TestExecTimeoutDoesNotWaitForTheReaper(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := c.Exec(ctx, proto.ExecRequest{Cmd: []string{"sh", "-c", "echo started; exec sleep 30"}, TimeoutS: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if ev, err := st.Next(); err != nil || string(ev.Data) != "started\n" {
		t.Fatalf("first event %+v %v", ev, err)
	}
	release := agent.HoldReaper()
	defer release()
	if last := lastEvent(t, st); last.ExitCode == nil || *last.ExitCode != 124 {
		t.Fatalf("last event %+v, want exit code 124", last)
	}
}

func TestExecLeavesBackgroundChildrenRunning(t *testing.T) {
	c := startAgent(t)
	for _, script := range []string{
		"sleep 30 & echo $!",                 // the child holds the stdout pipe
		"sleep 30 >/dev/null 2>&1 & echo $!", // the child let go of the pipes
		"(exec sleep 30) & echo $!; exit 5",  // exit code is the main process's
	} {
		t.Run(script, func(t *testing.T) {
			start := time.Now()
			stdout, _, code, err := c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"sh", "-c", script}})
			elapsed := time.Since(start)
			if err != nil {
				t.Fatal(err)
			}
			pid, err := strconv.Atoi(strings.TrimSpace(string(stdout)))
			if err != nil {
				t.Fatalf("stdout %q: %v", stdout, err)
			}
			killPid(t, pid)
			t.Logf("returned in %v", elapsed)
			if elapsed > 2*time.Second {
				t.Fatalf("exec with a background child took %v", elapsed)
			}
			want := 0
			if strings.Contains(script, "exit 5") {
				want = 5
			}
			if code != want {
				t.Fatalf("code %d, want %d", code, want)
			}
			time.Sleep(50 * time.Millisecond)
			if !alive(pid) {
				t.Fatalf("background child %d was killed", pid)
			}
		})
	}
}

func TestExecBackgroundFlag(t *testing.T) {
	c := startAgent(t)
	start := time.Now()
	pid, err := c.Start(context.Background(), proto.ExecRequest{Cmd: []string{"sh", "-c", "echo hi; echo oops >&2; exec sleep 30"}})
	if err != nil {
		t.Fatal(err)
	}
	killPid(t, pid)
	logPath := fmt.Sprintf("/tmp/torpor-bg-%d.log", pid)
	t.Cleanup(func() { os.Remove(logPath) })
	if d := time.Since(start); d > time.Second {
		t.Fatalf("background start took %v", d)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		b, _ := os.ReadFile(logPath)
		if string(b) == "hi\noops\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("log %s = %q", logPath, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !alive(pid) {
		t.Fatalf("background pid %d not alive", pid)
	}
	// It runs in its own session.
	if sid, _, errno := syscall.RawSyscall(syscall.SYS_GETSID, uintptr(pid), 0, 0); errno != 0 || int(sid) != pid {
		t.Fatalf("sid of %d is %d", pid, sid)
	}
	// Once killed, the agent's reaper collects it (no zombie left).
	syscall.Kill(pid, syscall.SIGKILL)
	deadline = time.Now().Add(3 * time.Second)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d not reaped", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestExecNotStarted(t *testing.T) {
	c := startAgent(t)
	_, _, code, err := c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"nosuch-torpor-cmd"}})
	var se *agentclient.StartError
	if code != 127 || !errors.As(err, &se) {
		t.Fatalf("code %d err %v", code, err)
	}
	if want := `exec: "nosuch-torpor-cmd": executable file not found in $PATH`; se.Message != want {
		t.Fatalf("message %q, want %q", se.Message, want)
	}
	_, _, code, err = c.Run(context.Background(), proto.ExecRequest{Cmd: []string{"true"}, Cwd: "/nonexistent-dir"})
	if code != 127 || !errors.As(err, &se) || !strings.Contains(se.Message, "chdir") {
		t.Fatalf("bad cwd: code %d err %v", code, err)
	}
	_, err = c.Start(context.Background(), proto.ExecRequest{Cmd: []string{"nosuch-torpor-cmd"}})
	if !errors.As(err, &se) {
		t.Fatalf("background start: %v", err)
	}
}

func TestExecBadRequest(t *testing.T) {
	c := startAgent(t)
	for _, req := range []proto.ExecRequest{{}, {Cmd: []string{""}}, {Cmd: []string{"true"}, TimeoutS: -1}} {
		_, err := c.Exec(context.Background(), req)
		var e *agentclient.Error
		if !errors.As(err, &e) || e.Status != 400 || e.Code != proto.CodeInvalidArgument {
			t.Fatalf("%+v: err %v", req, err)
		}
	}
}

func TestExecClientGoneKillsGroup(t *testing.T) {
	c := startAgent(t)
	st, err := c.Exec(context.Background(), proto.ExecRequest{Cmd: []string{"sh", "-c", "echo $$; sleep 30"}})
	if err != nil {
		t.Fatal(err)
	}
	ev, err := st.Next()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(ev.Data)))
	if err != nil {
		t.Fatal(err)
	}
	killPid(t, pid)
	st.Close()
	waitDead(t, pid, 3*time.Second)
}

func TestFiles(t *testing.T) {
	c := startAgent(t)
	ctx := context.Background()
	dir := t.TempDir()
	data := make([]byte, 1<<20)
	rand.Read(data)
	p := filepath.Join(dir, "a", "b", "blob.bin")
	if err := c.WriteFile(ctx, p, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	rc, size, err := c.ReadFile(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || size != int64(len(data)) || !bytes.Equal(got, data) {
		t.Fatalf("round trip: size %d len %d err %v", size, len(got), err)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v", st.Mode())
	}
	if st, _ := os.Stat(filepath.Dir(p)); st.Mode().Perm() != 0o755 {
		t.Fatalf("dir mode %v", st.Mode())
	}

	// Overwrite with mode, unknown size (chunked), then empty.
	if err := c.WriteFileMode(ctx, p, strings.NewReader("#!/bin/sh\necho run\n"), -1, 0o755); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o755 {
		t.Fatalf("mode %v", st.Mode())
	}
	if out, _, code, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{p}}); err != nil || code != 0 || string(out) != "run\n" {
		t.Fatalf("run written script: %q %d %v", out, code, err)
	}
	empty := filepath.Join(dir, "empty")
	if err := c.WriteFile(ctx, empty, strings.NewReader(""), 0); err != nil {
		t.Fatal(err)
	}
	rc, size, err = c.ReadFile(ctx, empty)
	if err != nil || size != 0 {
		t.Fatalf("empty: size %d err %v", size, err)
	}
	rc.Close()
	entries, _ := os.ReadDir(filepath.Dir(p))
	if len(entries) != 1 {
		t.Fatalf("temporary files left: %v", entries)
	}

	var e *agentclient.Error
	for _, tc := range []struct {
		name   string
		err    error
		status int
		code   string
	}{
		{"read relative", readErr(c, "rel/path"), 400, proto.CodeInvalidArgument},
		{"write relative", c.WriteFile(ctx, "rel/path", strings.NewReader("x"), 1), 400, proto.CodeInvalidArgument},
		{"read missing", readErr(c, filepath.Join(dir, "missing")), 404, proto.CodeNotFound},
		{"read directory", readErr(c, dir), 400, proto.CodeInvalidArgument},
		// A named pipe with no writer: refused at once, not a read that waits.
		{"read named pipe", readErr(c, mkfifo(t, filepath.Join(dir, "fifo"))), 400, proto.CodeInvalidArgument},
		{"write directory", c.WriteFile(ctx, dir, strings.NewReader("x"), 1), 400, proto.CodeInvalidArgument},
	} {
		if !errors.As(tc.err, &e) || e.Status != tc.status || e.Code != tc.code {
			t.Errorf("%s: err %v, want %d %s", tc.name, tc.err, tc.status, tc.code)
		}
	}
	if !agentclient.IsNotFound(readErr(c, "/nonexistent/torpor")) {
		t.Error("IsNotFound false for a missing file")
	}
}

func readErr(c *agentclient.Client, p string) error {
	rc, _, err := c.ReadFile(context.Background(), p)
	if err == nil {
		rc.Close()
	}
	return err
}

func TestConcurrentExec(t *testing.T) {
	c := startAgent(t)
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, stderr, code, err := c.Run(context.Background(), proto.ExecRequest{
				Cmd: []string{"sh", "-c", `echo "out $0"; echo "err $0" >&2; exit $(($0 % 5))`, strconv.Itoa(i)}})
			if err != nil {
				errs <- err
				return
			}
			if string(out) != fmt.Sprintf("out %d\n", i) || string(stderr) != fmt.Sprintf("err %d\n", i) || code != i%5 {
				errs <- fmt.Errorf("exec %d: %q %q %d", i, out, stderr, code)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestExecLatency(t *testing.T) {
	c, dials := startAgentCounting(t)
	ctx := context.Background()
	if _, _, _, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	before := dials.Load()
	const n = 50
	var worst time.Duration
	start := time.Now()
	for range n {
		t0 := time.Now()
		_, _, code, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{"true"}})
		if err != nil || code != 0 {
			t.Fatalf("code %d err %v", code, err)
		}
		worst = max(worst, time.Since(t0))
	}
	t.Logf("exec of true over a keep-alive connection: mean %v, worst %v (%d runs)", time.Since(start)/n, worst, n)
	if d := dials.Load() - before; d != 0 {
		t.Fatalf("%d new connections for %d sequential execs: keep-alive not reused", d, n)
	}
}

// mkfifo makes a named pipe at p and returns p.
func mkfifo(t *testing.T, p string) string {
	t.Helper()
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
