package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/torpor/torpor/guest/proto"
)

// maxExecBody bounds the exec request body (it carries Stdin).
const maxExecBody = 64 << 20

// exitNotStarted is the exit code reported when a command could not be started.
const exitNotStarted = 127

// exitTimeout is the exit code reported when TimeoutS ran out.
const exitTimeout = 124

func intPtr(v int) *int { return &v }

// ndjson writes ExecEvents as lines, flushing each; after a write error it drops lines.
type ndjson struct {
	w   http.ResponseWriter
	f   http.Flusher
	err error
}

func newNDJSON(w http.ResponseWriter) *ndjson {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	f, _ := w.(http.Flusher)
	return &ndjson{w: w, f: f}
}

func (o *ndjson) write(ev proto.ExecEvent) {
	if o.err != nil {
		return
	}
	b, err := json.Marshal(ev)
	if err != nil {
		o.err = err
		return
	}
	b = append(b, '\n')
	if _, o.err = o.w.Write(b); o.err == nil && o.f != nil {
		o.f.Flush()
	}
}

func (o *ndjson) flush() {
	if o.f != nil {
		o.f.Flush()
	}
}

// childEnv merges defaults < sandbox env < request env into a sorted "K=V" list.
func (s *server) childEnv(req map[string]string) ([]string, string) {
	return s.mergeEnv(nil, req)
}

// mergeEnv merges defaults < sandbox env < over < request env into a sorted
// "K=V" list, and returns the PATH it holds.
func (s *server) mergeEnv(over, req map[string]string) ([]string, string) {
	m := map[string]string{"PATH": DefaultPath, "HOME": "/root", "LANG": "C.UTF-8"}
	for k, v := range s.env {
		m[k] = v
	}
	for k, v := range over {
		m[k] = v
	}
	for k, v := range req {
		m[k] = v
	}
	env := make([]string, 0, len(m))
	for k, v := range m {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	return env, m["PATH"]
}

// lookPath finds name in path like a shell: names with a slash are used as they are
// (relative to the command's cwd); others are searched in path's absolute directories.
// The error reads like os/exec's: exec: "x": executable file not found in $PATH.
func lookPath(name, path string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" || !filepath.IsAbs(dir) {
			continue
		}
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", &exec.Error{Name: name, Err: exec.ErrNotFound}
}

func (s *server) handleExec(w http.ResponseWriter, r *http.Request) {
	received := time.Now() // TimeoutS counts from here
	var req proto.ExecRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxExecBody)).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "bad exec request: "+err.Error())
		return
	}
	if len(req.Cmd) == 0 || req.Cmd[0] == "" {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "cmd is empty")
		return
	}
	if req.TimeoutS < 0 {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "timeout_s must be >= 0")
		return
	}
	if req.Cwd == "" {
		req.Cwd = "/"
	}
	req.Cwd = filepath.Join(s.root, req.Cwd)
	env, path := s.childEnv(req.Env)
	out := newNDJSON(w)
	argv0, err := lookPath(req.Cmd[0], path)
	if err != nil {
		out.write(proto.ExecEvent{Error: err.Error(), ExitCode: intPtr(exitNotStarted)})
		return
	}
	if req.Background {
		s.execBackground(out, argv0, req, env)
		return
	}
	var deadline time.Time
	if req.TimeoutS > 0 {
		deadline = received.Add(time.Duration(req.TimeoutS * float64(time.Second)))
	}
	s.execForeground(r, out, argv0, req, env, deadline)
}

// timeoutMessage is the last stderr chunk of an exec whose TimeoutS ran out.
func timeoutMessage(timeoutS float64, started bool) []byte {
	msg := "torpor: timeout after " + strconv.FormatFloat(timeoutS, 'g', -1, 64) + "s"
	if !started {
		msg += " (the command had not started: starting it waited that long)"
	}
	return []byte(msg + "\n")
}

// killWait is how long an exec whose TimeoutS ran out waits for its killed
// process's exit status before it answers exitTimeout anyway (the reaper may be
// held up by a fork that is slow to return).
const killWait = 500 * time.Millisecond

// startBy starts argv0 like reaper.start, but answers by deadline (zero: no
// deadline) or when stop is closed, whichever comes first: started false means
// it gave up. A fork that completes after it gave up has its process group
// killed at once. release is called once the fork is over either way (it
// closes the child's ends of the pipes, which the fork reads until then).
func (s *server) startBy(deadline time.Time, stop <-chan struct{}, argv0 string, argv []string, attr *syscall.ProcAttr, release func()) (pid int, exitc <-chan syscall.WaitStatus, started bool, err error) {
	type result struct {
		pid   int
		exitc <-chan syscall.WaitStatus
		err   error
	}
	gaveUp := make(chan struct{})
	done := make(chan result, 1)
	go func() {
		pid, exitc, err := s.reaper.start(gaveUp, argv0, argv, attr)
		release()
		done <- result{pid, exitc, err}
	}()
	var timeoutc <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timeoutc = t.C
	}
	select {
	case res := <-done:
		return res.pid, res.exitc, true, res.err
	case <-timeoutc:
	case <-stop:
	}
	close(gaveUp)
	go func() {
		if res := <-done; res.err == nil {
			s.log.Printf("exec pid %d: started after its call gave up, killing its group", res.pid)
			syscall.Kill(-res.pid, syscall.SIGKILL)
		}
	}()
	return 0, nil, false, nil
}

// startError reports a failed fork/exec the way os.StartProcess words it.
func startError(out *ndjson, argv0, cwd string, err error) {
	msg := fmt.Sprintf("fork/exec %s: %v", argv0, err)
	if st, serr := os.Stat(cwd); serr != nil || !st.IsDir() {
		msg = fmt.Sprintf("chdir %s: %v", cwd, err)
	}
	out.write(proto.ExecEvent{Error: msg, ExitCode: intPtr(exitNotStarted)})
}

func (s *server) execBackground(out *ndjson, argv0 string, req proto.ExecRequest, env []string) {
	fail := func(err error) {
		out.write(proto.ExecEvent{Error: err.Error(), ExitCode: intPtr(exitNotStarted)})
	}
	os.MkdirAll("/tmp", 0o1777)
	logf, err := os.CreateTemp("/tmp", "torpor-bg-start-*.log")
	if err != nil {
		fail(err)
		return
	}
	defer logf.Close()
	logf.Chmod(0o644)
	null, err := os.Open(os.DevNull)
	if err != nil {
		os.Remove(logf.Name())
		fail(err)
		return
	}
	defer null.Close()
	attr := &syscall.ProcAttr{
		Dir:   req.Cwd,
		Env:   env,
		Files: []uintptr{null.Fd(), logf.Fd(), logf.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	}
	pid, _, err := s.reaper.start(nil, argv0, req.Cmd, attr)
	if err != nil {
		os.Remove(logf.Name())
		startError(out, argv0, req.Cwd, err)
		return
	}
	if err := os.Rename(logf.Name(), fmt.Sprintf("/tmp/torpor-bg-%d.log", pid)); err != nil {
		s.log.Printf("background pid %d: naming its log: %v", pid, err)
	}
	s.log.Printf("background pid %d: %q", pid, req.Cmd)
	out.write(proto.ExecEvent{Pid: pid})
}

// execForeground runs the command and streams its output; deadline (zero:
// none) bounds the whole call, the wait to start the command included.
func (s *server) execForeground(r *http.Request, out *ndjson, argv0 string, req proto.ExecRequest, env []string, deadline time.Time) {
	var toClose []*os.File
	closeAll := func() {
		for _, f := range toClose {
			f.Close()
		}
		toClose = nil
	}
	fail := func(err error) {
		closeAll()
		out.write(proto.ExecEvent{Error: err.Error(), ExitCode: intPtr(exitNotStarted)})
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		fail(err)
		return
	}
	toClose = append(toClose, outW)
	defer outR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		fail(err)
		return
	}
	toClose = append(toClose, errW)
	defer errR.Close()
	var stdin, stdinW *os.File
	if req.Stdin != "" {
		if stdin, stdinW, err = os.Pipe(); err != nil {
			fail(err)
			return
		}
	} else if stdin, err = os.Open(os.DevNull); err != nil {
		fail(err)
		return
	}
	toClose = append(toClose, stdin)

	// Fd() puts the child's ends in blocking mode, as the child expects; our ends
	// (outR, errR, stdinW) stay non-blocking so deadlines and Close work on them.
	attr := &syscall.ProcAttr{
		Dir:   req.Cwd,
		Env:   env,
		Files: []uintptr{stdin.Fd(), outW.Fd(), errW.Fd()},
		Sys:   &syscall.SysProcAttr{Setpgid: true},
	}
	pid, exitc, started, err := s.startBy(deadline, r.Context().Done(), argv0, req.Cmd, attr, closeAll)
	if !started || err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		switch {
		case err != nil:
			startError(out, argv0, req.Cwd, err)
		case r.Context().Err() != nil:
			s.log.Printf("exec %q: client went away before it started", req.Cmd)
		default:
			out.write(proto.ExecEvent{Stream: "stderr", Data: timeoutMessage(req.TimeoutS, false)})
			out.write(proto.ExecEvent{ExitCode: intPtr(exitTimeout)})
		}
		return
	}
	out.flush() // send the 200 and headers now

	var closeStdin func()
	if stdinW != nil {
		var once sync.Once
		closeStdin = func() { once.Do(func() { stdinW.Close() }) }
		go func() {
			io.WriteString(stdinW, req.Stdin)
			closeStdin()
		}()
	} else {
		closeStdin = func() {}
	}
	defer closeStdin()

	events := make(chan proto.ExecEvent, 16)
	var wg sync.WaitGroup
	wg.Add(2)
	go pump("stdout", outR, events, &wg)
	go pump("stderr", errR, events, &wg)
	readersDone := make(chan struct{})
	go func() { wg.Wait(); close(readersDone) }()

	var timeoutc, killc <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timeoutc = t.C
	}
	ctxDone := r.Context().Done()
	done := readersDone
	var ws syscall.WaitStatus
	exited, timedOut := false, false
	ended := func() {
		// The main process is gone. Stop killing anything: what it left running
		// in its group is the user's. Give the pipes drainWait to empty.
		exited, exitc, timeoutc, killc, ctxDone = true, nil, nil, nil, nil
		deadline := time.Now().Add(drainWait)
		outR.SetReadDeadline(deadline)
		errR.SetReadDeadline(deadline)
		closeStdin()
	}
	for !exited || done != nil {
		select {
		case ev := <-events:
			out.write(ev)
		case ws = <-exitc:
			ended()
		case <-killc:
			// Killed, but its status has not come: answer without it.
			s.log.Printf("exec pid %d: no exit status %v after its timeout's kill", pid, killWait)
			ended()
		case <-timeoutc:
			timeoutc, timedOut = nil, true
			syscall.Kill(-pid, syscall.SIGKILL)
			t := time.NewTimer(killWait)
			defer t.Stop()
			killc = t.C
		case <-ctxDone:
			ctxDone = nil
			s.log.Printf("exec pid %d: client went away, killing its group", pid)
			syscall.Kill(-pid, syscall.SIGKILL)
		case <-done:
			done = nil
		}
	}
	for more := true; more; {
		select {
		case ev := <-events:
			out.write(ev)
		default:
			more = false
		}
	}
	code := exitCode(ws)
	if timedOut {
		code = exitTimeout
		out.write(proto.ExecEvent{Stream: "stderr", Data: timeoutMessage(req.TimeoutS, true)})
	}
	out.write(proto.ExecEvent{ExitCode: intPtr(code)})
}

// exitCode maps a wait status to a shell-style exit code (128+sig when signalled).
func exitCode(ws syscall.WaitStatus) int {
	switch {
	case ws.Exited():
		return ws.ExitStatus()
	case ws.Signaled():
		return 128 + int(ws.Signal())
	default:
		return 255
	}
}

// pump sends what it reads from f as events until EOF, an error or the read deadline.
func pump(stream string, f *os.File, events chan<- proto.ExecEvent, wg *sync.WaitGroup) {
	defer wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			events <- proto.ExecEvent{Stream: stream, Data: append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			return
		}
	}
}
