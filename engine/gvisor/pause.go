package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/torpor/torpor/engine"
)

// Pause and unpause: the calls `runsc pause` and `runsc resume` make, made by
// the engine itself on the sandbox's control socket (control.go), without
// starting runsc: `runsc resume` took 12–49 ms here beside other work, most of
// it the start of a 100 MB Go binary, against ~1 ms for the call.
//
// runsc pause calls containerManager.Pause (Kernel.Pause: every task stopped)
// and then records the container paused in its state file; runsc resume checks
// that record, calls containerManager.Resume (Kernel.Unpause and gVisor's
// post-resume work) and records it running. The engine does the same, but
// records a pause before its call (setPaused says why), holding runsc's lock file of the container (flock, as runsc's
// StateFile does) while it rewrites the record, so runsc's own commands (list,
// state, delete) see the right status. The record is what keeps the kernel's
// stop count balanced: gVisor panics on a resume without a pause, so Unpause
// calls the sandbox only for a container recorded paused. When the control
// socket cannot be found the engine runs runsc pause / runsc resume instead.

// Container statuses as runsc's state file records them (runsc/container
// Status at the pinned version, serialized as its name).
const (
	statusRunning = "running"
	statusPaused  = "paused"
)

// Pause implements engine.Pauser.
func (e *Engine) Pause(ctx context.Context, id string) error {
	return e.setPaused(ctx, e.rid(id), true)
}

// Unpause implements engine.Pauser.
func (e *Engine) Unpause(ctx context.Context, id string) error {
	return e.setPaused(ctx, e.rid(id), false)
}

func (e *Engine) setPaused(ctx context.Context, id string, pause bool) error {
	what, method, from, to, cli := "unpause", "containerManager.Resume", statusPaused, statusRunning, "resume"
	if pause {
		what, method, from, to, cli = "pause", "containerManager.Pause", statusRunning, statusPaused, "pause"
	}
	unlock, err := e.lockState(ctx, id)
	if err != nil {
		return fmt.Errorf("gvisor: %s %s: %w", what, id, err)
	}
	st, err := e.statusOf(id)
	if err != nil {
		unlock()
		return fmt.Errorf("gvisor: %s %s: %w", what, id, err)
	}
	switch {
	case st == to:
		unlock()
		return nil
	case st != from:
		unlock()
		return fmt.Errorf("gvisor: %s %s: container is %s: %w", what, id, st, engine.ErrNotRunning)
	}
	// The record must never say running while the kernel is paused: a
	// pause then counted as the first would stop the kernel twice, and the
	// one unpause that follows would leave it stopped for good (the crash
	// harness killed a server between a pause's call and its record: after
	// the restart the sandbox never answered again). So a pause is recorded
	// before its call (a crash in between leaves a running kernel recorded
	// paused, whose unpause makes gVisor end the sandbox: the manager then
	// resumes it from the pause's snapshot), an unpause after it.
	if pause {
		if err := e.writeStatus(id, to); err != nil {
			unlock()
			return fmt.Errorf("gvisor: %s %s: recording it %s: %w", what, id, to, err)
		}
	}
	sock, err := e.controlSocket(id)
	if err == nil {
		err = controlCall(ctx, sock, method, struct{}{}, nil)
	}
	if err == nil {
		if !pause {
			err = e.writeStatus(id, to)
		}
		unlock()
		if err != nil {
			return fmt.Errorf("gvisor: %s %s: recording it %s: %w", what, id, to, err)
		}
		return nil
	}
	if pause {
		_ = e.writeStatus(id, from) // the call did not pause it (runsc pause below checks the record)
	}
	unlock()
	if !errors.Is(err, errNoControlSocket) {
		return e.controlFailed(ctx, what, id, err)
	}
	// A socket that refuses the call is most often a sandbox process that
	// is gone or going (killed from outside, or by the OOM killer; a zombie
	// counts as gone): runsc would only fail the same way, 12–49 ms later.
	if pid := e.recordedPid(id); pid > 0 {
		wctx, cancel := context.WithTimeout(ctx, goneWait)
		gone := waitExit(wctx, pid) == nil
		cancel()
		if gone {
			return fmt.Errorf("gvisor: %s %s: sandbox process %d is gone (%v): %w", what, id, pid, err, engine.ErrNotRunning)
		}
	}
	e.runscPauses.Add(1)
	if _, err := e.run(ctx, cli, id); err != nil {
		return e.controlFailed(ctx, what, id, err)
	}
	return nil
}

// goneWait bounds how long a pause or unpause that cannot reach the control
// socket waits for the sandbox process to be seen gone before it runs runsc.
const goneWait = 50 * time.Millisecond

// sandboxExitWait bounds how long a failed pause or unpause waits for the
// sandbox process to be seen exiting: a process that is being killed resets
// its control socket a moment before it is gone.
const sandboxExitWait = time.Second

// controlFailed is the error of a pause or unpause (what) of container id
// whose control call failed with err: it wraps engine.ErrNotRunning when the
// sandbox process runsc recorded has exited, or exits within
// sandboxExitWait (the host's OOM killer or a kill took it: the caller can
// then fall back to the pause's snapshot), and is err otherwise.
func (e *Engine) controlFailed(ctx context.Context, what, id string, err error) error {
	sctx, cancel := context.WithTimeout(ctx, listTimeout)
	st, serr := e.state(sctx, id)
	cancel()
	if serr == nil && st.Pid > 0 {
		wctx, cancel := context.WithTimeout(ctx, sandboxExitWait)
		gone := waitExit(wctx, st.Pid) == nil
		cancel()
		if gone {
			return fmt.Errorf("gvisor: %s %s: sandbox process %d exited (%v): %w", what, id, st.Pid, err, engine.ErrNotRunning)
		}
	}
	return fmt.Errorf("gvisor: %s %s: %w", what, id, err)
}

func (e *Engine) statePath(id string) string {
	return filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:"+id+".state")
}

// lockState takes runsc's lock of container id (flock(2) of its lock file, as
// runsc does around every read and write of the state file), waiting while
// runsc holds it, until ctx ends. The lock file is never created here (a stray
// one would outlive the container). Errors wrap engine.ErrNotRunning when
// there is no lock file.
func (e *Engine) lockState(ctx context.Context, id string) (func(), error) {
	if !idRE.MatchString(id) {
		return nil, fmt.Errorf("invalid instance id %q", id)
	}
	f, err := os.OpenFile(filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:"+id+".lock"), os.O_RDWR, 0)
	if os.IsNotExist(err) {
		return nil, fmt.Errorf("no runsc lock file: %w", engine.ErrNotRunning)
	}
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// statusOf reads instance id's status from runsc's state file. Errors wrap
// engine.ErrNotRunning when runsc has no state for id.
func (e *Engine) statusOf(id string) (string, error) {
	b, err := os.ReadFile(e.statePath(id))
	if os.IsNotExist(err) {
		return "", fmt.Errorf("no runsc state: %w", engine.ErrNotRunning)
	}
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return "", fmt.Errorf("runsc state file: %w", err)
	}
	return st.Status, nil
}

// recordedPid is the host pid of instance id's sandbox process as runsc's
// state file records it, or 0 when the file cannot be read.
func (e *Engine) recordedPid(id string) int {
	b, err := os.ReadFile(e.statePath(id))
	if err != nil {
		return 0
	}
	var st struct {
		Sandbox struct {
			Pid int `json:"pid"`
		} `json:"sandbox"`
	}
	if json.Unmarshal(b, &st) != nil {
		return 0
	}
	return st.Sandbox.Pid
}

// writeStatus rewrites the status in instance id's state file, every other
// field as it is; the caller holds the container's lock (lockState). The new
// file replaces the old by rename, so no reader sees half of it.
func (e *Engine) writeStatus(id, status string) error {
	p := e.statePath(id)
	b, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return fmt.Errorf("runsc state file: %w", err)
	}
	fields["status"], _ = json.Marshal(status)
	out, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(p), ".status-"+id+".tmp")
	if err := os.WriteFile(tmp, out, 0o640); err != nil {
		return err
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}
