package envd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
)

// fakeEnvd is a tiny envd for the tests: Process.Start, List and SendSignal run real
// commands on the test's host, Filesystem.Stat stats real files. It records every
// request message and its headers so the tests can check what the callers sent.
type fakeEnvd struct {
	processconnect.UnimplementedProcessHandler
	filesystemconnect.UnimplementedFilesystemHandler

	home string // the working directory of commands started without cwd

	mu    sync.Mutex
	procs map[uint32]*runningProcess
	calls []call
}

type runningProcess struct {
	info *process.ProcessInfo
	cmd  *exec.Cmd
}

// call is one recorded request.
type call struct {
	procedure string
	msg       proto.Message
	header    http.Header
}

func newFakeEnvd(t *testing.T) *fakeEnvd {
	f := &fakeEnvd{home: t.TempDir(), procs: map[uint32]*runningProcess{}}
	t.Cleanup(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, p := range f.procs {
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		}
	})
	return f
}

func (f *fakeEnvd) record(procedure string, msg proto.Message, h http.Header) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call{procedure: procedure, msg: proto.Clone(msg), header: h.Clone()})
}

// callsOf answers the recorded calls of one procedure ("/process.Process/Start").
func (f *fakeEnvd) callsOf(procedure string) []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []call
	for _, c := range f.calls {
		if c.procedure == procedure {
			out = append(out, c)
		}
	}
	return out
}

// handler serves both services on one mux, as envd does.
func (f *fakeEnvd) handler() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(f))
	mux.Handle(filesystemconnect.NewFilesystemHandler(f))
	return mux
}

// serve starts an HTTP/1.1 and an HTTP/2 (TLS) server of h.
func serve(t *testing.T, h http.Handler) (plain, h2 *httptest.Server) {
	plain = httptest.NewServer(h)
	t.Cleanup(plain.Close)
	h2 = httptest.NewUnstartedServer(h)
	h2.EnableHTTP2 = true
	h2.StartTLS()
	t.Cleanup(h2.Close)
	return plain, h2
}

func (f *fakeEnvd) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	f.record(processconnect.ProcessStartProcedure, req.Msg, req.Header())
	cfg := req.Msg.GetProcess()
	if cfg.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is empty"))
	}
	cmd := exec.CommandContext(ctx, cfg.GetCmd(), cfg.GetArgs()...)
	cmd.Dir = f.home
	if cfg.Cwd != nil {
		cmd.Dir = cfg.GetCwd()
	}
	// Its own process group, so that a signal reaches the children a shell left
	// holding the output pipes.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// HOME is the fake's own directory, as envd gives a command its user's
	// home: a login shell (the SDK runs bash -l) then reads no start-up files
	// of the host's root, whose pyenv set-up takes a lock that a killed shell
	// leaves behind.
	cmd.Env = append(os.Environ(), "HOME="+f.home)
	for k, v := range cfg.GetEnvs() {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	pid := uint32(cmd.Process.Pid)
	f.mu.Lock()
	f.procs[pid] = &runningProcess{info: &process.ProcessInfo{Config: cfg, Pid: pid, Tag: req.Msg.Tag}, cmd: cmd}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.procs, pid)
		f.mu.Unlock()
	}()

	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}); err != nil {
		return err
	}
	// Both pipes feed one channel so that a single goroutine sends on the stream.
	data := make(chan *process.ProcessEvent_DataEvent)
	var readers sync.WaitGroup
	pump := func(r io.Reader, wrap func([]byte) *process.ProcessEvent_DataEvent) {
		defer readers.Done()
		buf := make([]byte, 32<<10)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				data <- wrap(append([]byte(nil), buf[:n]...))
			}
			if err != nil {
				return
			}
		}
	}
	readers.Add(2)
	go pump(stdout, func(b []byte) *process.ProcessEvent_DataEvent {
		return &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: b}}
	})
	go pump(stderr, func(b []byte) *process.ProcessEvent_DataEvent {
		return &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: b}}
	})
	go func() { readers.Wait(); close(data) }()
	for d := range data {
		if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: d}}); err != nil {
			return err
		}
	}
	end := &process.ProcessEvent_EndEvent{}
	if err := cmd.Wait(); err != nil && !errors.As(err, new(*exec.ExitError)) {
		msg := err.Error()
		end.Error = &msg
	}
	end.ExitCode = int32(cmd.ProcessState.ExitCode())
	end.Exited = cmd.ProcessState.Exited()
	end.Status = cmd.ProcessState.String()
	return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}})
}

func (f *fakeEnvd) List(_ context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	f.record(processconnect.ProcessListProcedure, req.Msg, req.Header())
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &process.ListResponse{}
	for _, p := range f.procs {
		out.Processes = append(out.Processes, p.info)
	}
	return connect.NewResponse(out), nil
}

func (f *fakeEnvd) SendSignal(_ context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	f.record(processconnect.ProcessSendSignalProcedure, req.Msg, req.Header())
	pid := req.Msg.GetProcess().GetPid()
	f.mu.Lock()
	p, ok := f.procs[pid]
	f.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d not found", pid))
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case process.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case process.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %v", req.Msg.GetSignal()))
	}
	if err := syscall.Kill(-p.cmd.Process.Pid, sig); err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (f *fakeEnvd) Stat(_ context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	f.record(filesystemconnect.FilesystemStatProcedure, req.Msg, req.Header())
	entry, err := entryOf(req.Msg.GetPath())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, connect.NewError(connect.CodeNotFound, err)
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: entry}), nil
}

// entryOf describes path as envd does (the final symlink not followed).
func entryOf(path string) (*filesystem.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	e := &filesystem.EntryInfo{
		Name: fi.Name(), Path: path, Size: fi.Size(), Mode: uint32(fi.Mode().Perm()),
		Permissions: fi.Mode().String(), ModifiedTime: timestamppb.New(fi.ModTime()),
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		e.Type = filesystem.FileType_FILE_TYPE_SYMLINK
		target, err := os.Readlink(path)
		if err != nil {
			return nil, err
		}
		e.SymlinkTarget = &target
	case fi.IsDir():
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
	default:
		e.Type = filesystem.FileType_FILE_TYPE_FILE
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner, e.Group = strconv.Itoa(int(st.Uid)), strconv.Itoa(int(st.Gid))
		if u, err := user.LookupId(e.Owner); err == nil {
			e.Owner = u.Username
		}
		if g, err := user.LookupGroupId(e.Group); err == nil {
			e.Group = g.Name
		}
	}
	return e, nil
}

// writeFile makes a file of n bytes in dir for the Stat tests.
func writeFile(t *testing.T, dir, name string, n int) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, make([]byte, n), 0o640); err != nil {
		t.Fatal(err)
	}
	return path
}
