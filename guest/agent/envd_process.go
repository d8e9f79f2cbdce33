package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	"github.com/torpor/torpor/api/e2b/envd/gen/process"
)

// Output chunk sizes read from a process's pipes and from its terminal.
const (
	envdPipeChunk = 32 << 10
	envdPtyChunk  = 16 << 10
)

// maxFollowerBacklog bounds the output queued for one Start or Connect stream
// whose client reads slower than the process writes. Past it the stream ends
// (resource_exhausted) and the process goes on: a slow client never blocks it.
const maxFollowerBacklog = 16 << 20

// envdProc is a process started through envd's Start. It stays in the table
// until it exits, whether or not a stream follows it; its output goes to the
// streams following it at the time (E2B's envd keeps none for later).
type envdProc struct {
	pid int
	tag *string
	cfg *process.ProcessConfig
	tty *os.File // the terminal's master side; nil without a pty

	stdinMu sync.Mutex
	stdin   *os.File // the stdin pipe's write end; nil when there is none or it was closed

	mu        sync.Mutex
	followers map[*follower]struct{}
	end       *process.ProcessEvent_EndEvent // set once it exited
}

// follower is one stream's queue of a process's events.
type follower struct {
	mu       sync.Mutex
	q        []*process.ProcessEvent
	bytes    int
	closed   bool // the end event is queued, or the backlog overflowed
	overflow bool
	wake     chan struct{} // signalled (buffered 1) on every change
}

func (f *follower) push(ev *process.ProcessEvent, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return
	}
	if f.bytes+n > maxFollowerBacklog {
		f.closed, f.overflow, f.q = true, true, nil
	} else {
		f.q = append(f.q, ev)
		f.bytes += n
	}
	f.signal()
}

func (f *follower) finish(ev *process.ProcessEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.closed {
		f.q = append(f.q, ev)
		f.closed = true
	}
	f.signal()
}

func (f *follower) signal() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

func (f *follower) take() (evs []*process.ProcessEvent, closed, overflow bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	evs, f.q, f.bytes = f.q, nil, 0
	return evs, f.closed, f.overflow
}

// follow adds a follower; for a process that already exited it holds the end
// event alone.
func (p *envdProc) follow() *follower {
	f := &follower{wake: make(chan struct{}, 1)}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		f.finish(endEvent(p.end))
		return f
	}
	p.followers[f] = struct{}{}
	return f
}

func (p *envdProc) unfollow(f *follower) {
	p.mu.Lock()
	delete(p.followers, f)
	p.mu.Unlock()
}

func (p *envdProc) publish(data *process.ProcessEvent_DataEvent, n int) {
	ev := &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: data}}
	p.mu.Lock()
	defer p.mu.Unlock()
	for f := range p.followers {
		f.push(ev, n)
	}
}

func (p *envdProc) finish(end *process.ProcessEvent_EndEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.end = end
	for f := range p.followers {
		f.finish(endEvent(end))
	}
	p.followers = nil
}

func endEvent(end *process.ProcessEvent_EndEvent) *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}}
}

// signal sends sig to the process's group (it leads one: its own session with a
// pty, its own group without), or to the process alone if the group is gone.
func (p *envdProc) signal(sig syscall.Signal) error {
	if err := syscall.Kill(-p.pid, sig); err == nil {
		return nil
	}
	return syscall.Kill(p.pid, sig)
}

func (p *envdProc) info() *process.ProcessInfo {
	return &process.ProcessInfo{Config: p.cfg, Pid: uint32(p.pid), Tag: p.tag}
}

// endOf describes a wait status as E2B's envd does (Go's os.ProcessState):
// exited with its code, or killed by a signal (exit_code -1, status "signal:
// killed"); error is the status unless the process exited 0.
func endOf(ws syscall.WaitStatus) *process.ProcessEvent_EndEvent {
	end := &process.ProcessEvent_EndEvent{ExitCode: -1}
	switch {
	case ws.Exited():
		end.Exited, end.ExitCode = true, int32(ws.ExitStatus())
		end.Status = fmt.Sprintf("exit status %d", ws.ExitStatus())
	case ws.Signaled():
		end.Status = "signal: " + ws.Signal().String()
		if ws.CoreDump() {
			end.Status += " (core dumped)"
		}
	default:
		end.Status = fmt.Sprintf("wait status %#x", uint32(ws))
	}
	if !(end.Exited && end.ExitCode == 0) {
		msg := end.Status
		end.Error = &msg
	}
	return end
}

// startProc starts req's process as u and registers it; the returned follower
// was attached before the process could write anything. deadline, when not
// zero, is when the process is killed (E2B's envd kills a command when the
// Start call's timeout passes).
func (e *envd) startProc(u *envdUser, req *process.StartRequest, deadline time.Time) (*envdProc, *follower, error) {
	cfg := req.GetProcess()
	if cfg.GetCmd() == "" {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is empty"))
	}
	cwd := u.home
	if cfg.Cwd != nil {
		var err error
		if cwd, err = u.resolve(cfg.GetCwd()); err != nil {
			return nil, nil, err
		}
	}
	hcwd := e.host(cwd)
	if st, err := os.Stat(hcwd); err != nil || !st.IsDir() {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd %q does not exist or is not a directory", cwd))
	}
	env, path := e.srv.userEnv(u, cfg.GetEnvs())
	argv0, err := lookPath(cfg.GetCmd(), path)
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	sys := &syscall.SysProcAttr{}
	if os.Geteuid() == 0 {
		sys.Credential = &syscall.Credential{Uid: u.uid, Gid: u.gid, Groups: u.groups}
	} else if u.uid != uint32(os.Geteuid()) {
		return nil, nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("the agent runs as uid %d and cannot run commands as user %q (uid %d)", os.Geteuid(), u.name, u.uid))
	}

	p := &envdProc{cfg: cfg, tag: req.Tag, followers: map[*follower]struct{}{}}
	var childEnds []*os.File
	closeChild := func() {
		for _, f := range childEnds {
			f.Close()
		}
	}
	var outputs []*os.File // our read ends
	cleanup := func() {
		closeChild()
		for _, f := range outputs {
			f.Close()
		}
		if p.stdin != nil {
			p.stdin.Close()
		}
	}
	fail := func(err error) (*envdProc, *follower, error) {
		cleanup()
		return nil, nil, connect.NewError(connect.CodeInternal, err)
	}
	var files []uintptr
	if t := req.GetPty(); t != nil {
		master, slave, err := pty.Open()
		if err != nil {
			return fail(fmt.Errorf("open a pty: %w", err))
		}
		p.tty = master
		outputs = append(outputs, master)
		childEnds = append(childEnds, slave)
		if sz := t.GetSize(); sz != nil && sz.GetCols() > 0 && sz.GetRows() > 0 {
			if err := pty.Setsize(master, &pty.Winsize{Cols: uint16(sz.GetCols()), Rows: uint16(sz.GetRows())}); err != nil {
				return fail(fmt.Errorf("set the pty's size: %w", err))
			}
		}
		fd := slave.Fd()
		files = []uintptr{fd, fd, fd}
		sys.Setsid, sys.Setctty, sys.Ctty = true, true, 0
	} else {
		var stdin *os.File
		if req.Stdin == nil || req.GetStdin() {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			stdin, p.stdin = r, w
		} else if stdin, err = os.Open(os.DevNull); err != nil {
			return fail(err)
		}
		childEnds = append(childEnds, stdin)
		files = []uintptr{stdin.Fd()}
		for range 2 {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			outputs = append(outputs, r)
			childEnds = append(childEnds, w)
			files = append(files, w.Fd())
		}
		sys.Setpgid = true
	}
	attr := &syscall.ProcAttr{Dir: hcwd, Env: env, Files: files, Sys: sys}
	argv := append([]string{cfg.GetCmd()}, cfg.GetArgs()...)
	pid, exitc, err := e.srv.reaper.start(nil, argv0, argv, attr)
	if err != nil {
		cleanup()
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("fork/exec %s: %w", argv0, err))
	}
	closeChild()
	p.pid = pid
	f := p.follow()
	e.mu.Lock()
	e.procs[pid] = p
	e.mu.Unlock()
	e.srv.log.Printf("envd: pid %d started as %s: %q", pid, u.name, argv)

	var readers sync.WaitGroup
	if p.tty != nil {
		readers.Add(1)
		go p.read(p.tty, envdPtyChunk, func(b []byte) *process.ProcessEvent_DataEvent {
			return &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Pty{Pty: b}}
		}, &readers)
	} else {
		readers.Add(2)
		go p.read(outputs[0], envdPipeChunk, func(b []byte) *process.ProcessEvent_DataEvent {
			return &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: b}}
		}, &readers)
		go p.read(outputs[1], envdPipeChunk, func(b []byte) *process.ProcessEvent_DataEvent {
			return &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: b}}
		}, &readers)
	}
	var kill *time.Timer
	if !deadline.IsZero() {
		kill = time.AfterFunc(time.Until(deadline), func() {
			e.srv.log.Printf("envd: pid %d: the Start call's timeout passed, killing it", pid)
			p.signal(syscall.SIGKILL)
		})
	}
	go func() {
		ws := <-exitc
		if kill != nil {
			kill.Stop()
		}
		// What the process left running may hold its output open: read what is
		// there for drainWait, no longer (as /exec does).
		for _, o := range outputs {
			o.SetReadDeadline(time.Now().Add(drainWait))
		}
		readers.Wait()
		for _, o := range outputs {
			o.Close()
		}
		p.stdinMu.Lock()
		if p.stdin != nil {
			p.stdin.Close()
			p.stdin = nil
		}
		p.stdinMu.Unlock()
		end := endOf(ws)
		e.mu.Lock()
		delete(e.procs, pid)
		e.mu.Unlock()
		p.finish(end)
		e.srv.log.Printf("envd: pid %d ended: %s", pid, end.Status)
	}()
	return p, f, nil
}

// read publishes what it reads from o until EOF, an error or the read deadline.
func (p *envdProc) read(o *os.File, chunk int, wrap func([]byte) *process.ProcessEvent_DataEvent, wg *sync.WaitGroup) {
	defer wg.Done()
	for {
		buf := make([]byte, chunk)
		n, err := o.Read(buf)
		if n > 0 {
			p.publish(wrap(buf[:n]), n)
		}
		if err != nil {
			return
		}
	}
}

// lookup finds a running process by pid or tag.
func (e *envd) lookup(sel *process.ProcessSelector) (*envdProc, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch s := sel.GetSelector().(type) {
	case *process.ProcessSelector_Pid:
		if p := e.procs[int(s.Pid)]; p != nil {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", s.Pid))
	case *process.ProcessSelector_Tag:
		for _, p := range e.procs {
			if p.tag != nil && *p.tag == s.Tag {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", s.Tag))
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process: name a pid or a tag"))
	}
}

// stream sends p's events to send until the process ended (its end event is
// the last one), the client went away or the sandbox was hibernated; while
// nothing happens it sends a keepalive every ka.
func (e *envd) stream(ctx context.Context, p *envdProc, f *follower, ka time.Duration, send func(*process.ProcessEvent) error) error {
	defer p.unfollow(f)
	t := time.NewTimer(ka)
	defer t.Stop()
	for {
		evs, closed, overflow := f.take()
		for _, ev := range evs {
			if err := send(ev); err != nil {
				return err
			}
		}
		if len(evs) > 0 {
			t.Reset(ka)
		}
		if overflow {
			return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("process %d: the client read its output too slowly (more than %d bytes waiting); the process goes on: connect again", p.pid, maxFollowerBacklog))
		}
		if closed {
			return nil
		}
		select {
		case <-f.wake:
		case <-t.C:
			if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
			t.Reset(ka)
		case <-ctx.Done():
			return streamEnd(ctx)
		}
	}
}

func startEvent(pid int) *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: uint32(pid)}}}
}

// envdProcess serves process.Process.
type envdProcess struct{ e *envd }

func (h envdProcess) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	u, err := userOf(req.Header())
	if err != nil {
		return err
	}
	deadline, _ := ctx.Deadline()
	ctx, done := h.e.openStream(ctx)
	defer done()
	p, f, err := h.e.startProc(u, req.Msg, deadline)
	if err != nil {
		return err
	}
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		p.unfollow(f)
		return err
	}
	return h.e.stream(ctx, p, f, keepaliveOf(req.Header()), send)
}

func (h envdProcess) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	p, err := h.e.lookup(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	ctx, done := h.e.openStream(ctx)
	defer done()
	f := p.follow()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.ConnectResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		p.unfollow(f)
		return err
	}
	return h.e.stream(ctx, p, f, keepaliveOf(req.Header()), send)
}

func (h envdProcess) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	h.e.mu.Lock()
	out := make([]*process.ProcessInfo, 0, len(h.e.procs))
	for _, p := range h.e.procs {
		out = append(out, p.info())
	}
	h.e.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return connect.NewResponse(&process.ListResponse{Processes: out}), nil
}

// input writes one chunk to p's stdin or terminal.
func (p *envdProc) input(in *process.ProcessInput) error {
	switch v := in.GetInput().(type) {
	case *process.ProcessInput_Pty:
		if p.tty == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no pty: send its input as stdin", p.pid))
		}
		if _, err := p.tty.Write(v.Pty); err != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d: write to its pty: %w", p.pid, err))
		}
		return nil
	case *process.ProcessInput_Stdin:
		if p.tty != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has a pty: send its input as pty", p.pid))
		}
		p.stdinMu.Lock()
		defer p.stdinMu.Unlock()
		if p.stdin == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d: stdin was not kept open (start it with stdin: true) or is closed", p.pid))
		}
		if _, err := p.stdin.Write(v.Stdin); err != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d: write to its stdin: %w", p.pid, err))
		}
		return nil
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input: give stdin or pty bytes"))
	}
}

func (h envdProcess) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	p, err := h.e.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.input(req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (h envdProcess) StreamInput(ctx context.Context, stream *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	var p *envdProc
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *process.StreamInputRequest_Start:
			var err error
			if p, err = h.e.lookup(ev.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *process.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message must be a start event naming the process"))
			}
			if err := p.input(ev.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return connect.NewResponse(&process.StreamInputResponse{}), nil
}

func (h envdProcess) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	p, err := h.e.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.tty != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has a pty: send Ctrl-D (0x04) as pty input instead", p.pid))
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin != nil {
		err = p.stdin.Close()
		p.stdin = nil
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

func (h envdProcess) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case process.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case process.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %v: send SIGNAL_SIGTERM or SIGNAL_SIGKILL", req.Msg.GetSignal()))
	}
	p, err := h.e.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.signal(sig); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", p.pid))
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (h envdProcess) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	p, err := h.e.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	sz := req.Msg.GetPty().GetSize()
	if sz == nil {
		return connect.NewResponse(&process.UpdateResponse{}), nil
	}
	if p.tty == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no pty to resize", p.pid))
	}
	if err := pty.Setsize(p.tty, &pty.Winsize{Cols: uint16(sz.GetCols()), Rows: uint16(sz.GetRows())}); err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("process %d: resize its pty: %w", p.pid, err))
	}
	return connect.NewResponse(&process.UpdateResponse{}), nil
}
