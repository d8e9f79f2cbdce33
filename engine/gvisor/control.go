package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// The direct checkpoint: the call `runsc checkpoint` makes, made by the engine
// itself, without starting runsc.
//
// `runsc checkpoint` loads the container's state file, creates the image files,
// and calls containerManager.Checkpoint on the sandbox's control socket with the
// files attached (runsc/sandbox/sandbox.go Sandbox.Checkpoint at the pinned
// version); the save itself runs inside the sandbox. Starting runsc (a 100 MB Go
// binary) costs 5–7 ms on an idle machine (20 runs of `runsc list`) and ~10 ms
// beside a hibernate (runsc's debug log), out of the ~45 ms that `runsc
// checkpoint` takes for a 64 MiB sandbox: 1 GiB/s for a 76 MiB snapshot leaves 74
// ms for the whole hibernate. The protocol is gVisor's uRPC (pkg/urpc): one JSON
// object {"method", "arg"} written to the Unix stream socket with the files as
// SCM_RIGHTS on the first write, answered by {"success", "err", "result"}. It is
// gVisor's internal interface, not a public one, so it is used only at the
// pinned runsc version's protocol and every CI run exercises it (the engine
// conformance suite's checkpoints); when the socket cannot be found the engine
// runs `runsc checkpoint` instead.

// Image file names in a checkpoint directory (runsc/checkpointfiles at the
// pinned version).
const (
	stateFileName     = "checkpoint.img"
	pagesMetaFileName = "pages_meta.img"
	pagesFileName     = "pages.img"
)

// errNoControlSocket: the direct checkpoint cannot start (no state file or
// socket); nothing was sent to the sandbox, so `runsc checkpoint` may run instead.
var errNoControlSocket = errors.New("no control socket")

// saveOpts is the JSON form of gVisor's control.SaveOpts (pkg/sentry/control/
// state.go at the pinned version) for a local, uncompressed checkpoint with a
// separate pages file; the files travel beside it.
type saveOpts struct {
	Metadata      map[string]string `json:"metadata"`
	HavePagesFile bool              `json:"have_pages_file"`
	Resume        bool              `json:"Resume"`
}

type urpcCall struct {
	Method string `json:"method"`
	Arg    any    `json:"arg"`
}

type urpcResult struct {
	Success bool   `json:"success"`
	Err     string `json:"err"`
}

// controlSocket returns the path of instance id's uRPC control socket, read
// from runsc's state file under the engine's root (its sandbox.controlSocketPath).
// It returns an error wrapping errNoControlSocket when there is no state file,
// no path in it, or no socket there.
func (e *Engine) controlSocket(id string) (string, error) {
	b, err := os.ReadFile(filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:"+id+".state"))
	if err != nil {
		return "", fmt.Errorf("%w: %v", errNoControlSocket, err)
	}
	var st struct {
		Sandbox struct {
			ControlSocketPath string `json:"controlSocketPath"`
		} `json:"sandbox"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return "", fmt.Errorf("%w: state file: %v", errNoControlSocket, err)
	}
	p := st.Sandbox.ControlSocketPath
	if p == "" || len(p) >= 108 { // sun_path is 108 bytes; runsc then opens it by /proc/self/fd
		return "", fmt.Errorf("%w: path %q", errNoControlSocket, p)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode()&os.ModeSocket == 0 {
		return "", fmt.Errorf("%w: %s", errNoControlSocket, p)
	}
	return p, nil
}

// checkpointDirect saves instance id into dir (absolute, existing) as `runsc
// checkpoint --image-path dir [--leave-running] id` would: checkpoint.img,
// pages_meta.img and pages.img, created here (exclusive; an existing file is an
// error) and handed to the sandbox. It returns once the sandbox has written them;
// without leaveRunning the sandbox then exits on its own. Errors: wrapping
// errNoControlSocket when the call could not be made (nothing sent; dir may hold
// empty image files, which it removes); otherwise the sandbox's own error or the
// socket's. ctx cancels the wait, not the save, which the sandbox finishes (as
// with a killed `runsc checkpoint`).
func (e *Engine) checkpointDirect(ctx context.Context, id, dir string, leaveRunning bool) error {
	sock, err := e.controlSocket(id)
	if err != nil {
		return err
	}
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for _, n := range []string{stateFileName, pagesMetaFileName, pagesFileName} {
		f, err := os.OpenFile(filepath.Join(dir, n), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o644)
		if err != nil {
			for _, g := range files {
				os.Remove(g.Name())
			}
			return fmt.Errorf("%w: %v", errNoControlSocket, err)
		}
		files = append(files, f)
	}
	err = controlCall(ctx, sock, "containerManager.Checkpoint", saveOpts{
		Metadata:      map[string]string{"compression": "none"},
		HavePagesFile: true,
		Resume:        leaveRunning,
	}, files)
	if errors.Is(err, errNoControlSocket) {
		for _, f := range files {
			os.Remove(f.Name()) // nothing was sent: `runsc checkpoint` makes them anew
		}
	}
	return err
}

// controlCall makes one uRPC call of method with arg (and files, passed as
// SCM_RIGHTS with the first write) on the control socket sock and waits for
// its answer. Errors: wrapping errNoControlSocket when the socket cannot be
// dialled (nothing sent); the sandbox's own error ("sandbox: …") or the
// socket's. ctx cancels the wait, not the call, which the sandbox finishes.
func controlCall(ctx context.Context, sock, method string, arg any, files []*os.File) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return fmt.Errorf("%w: %v", errNoControlSocket, err)
	}
	uc := conn.(*net.UnixConn)
	defer uc.Close()
	msg, err := json.Marshal(urpcCall{Method: method, Arg: arg})
	if err != nil {
		return err
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = syscall.UnixRights(fds...)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = uc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = uc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	n, _, err := uc.WriteMsgUnix(msg, oob, nil)
	if err == nil && n < len(msg) {
		_, err = uc.Write(msg[n:]) // the files went with the first part
	}
	if err != nil {
		return fmt.Errorf("control socket: %w", err)
	}
	var res urpcResult
	if err := json.NewDecoder(uc).Decode(&res); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("control socket: %w", err)
	}
	if !res.Success {
		return fmt.Errorf("sandbox: %s", res.Err)
	}
	return nil
}
