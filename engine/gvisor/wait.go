package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/torpor/torpor/engine"
)

var _ engine.CompatibilityChecker = (*Engine)(nil)

// CanRestore implements engine.CompatibilityChecker: runsc restores only
// images written by its own version (a checkpoint image is the sentry's
// serialized state, whose format changes between releases without notice), so
// version must equal Version exactly.
func (e *Engine) CanRestore(version string) error {
	if version != e.version {
		return fmt.Errorf("runsc restores only checkpoints of its own version")
	}
	return nil
}

// Wait implements engine.Engine: it follows the instance's sandbox process (the
// pid runsc records, else a process started under this engine's root with the
// instance's bundle) and returns when it has exited. The process is not the
// engine's child (runsc --detach started it), so it is followed by a pidfd.
func (e *Engine) Wait(ctx context.Context, id string) (engine.ExitStatus, error) {
	if !idRE.MatchString(id) {
		return engine.ExitStatus{}, fmt.Errorf("gvisor: invalid instance id %q", id)
	}
	id = e.rid(id)
	pid, exited := 0, 0
	if e.hasRunscState(id) {
		sctx, cancel := context.WithTimeout(ctx, listTimeout)
		st, err := e.state(sctx, id) // whatever its status (a checkpoint may be under way)
		cancel()
		if err == nil && alive(st.Pid) {
			pid = st.Pid
		} else if err == nil && st.Pid > 0 {
			exited = st.Pid
		}
	}
	if pid == 0 {
		if pids := e.processes()[id]; len(pids) > 0 {
			pid = pids[0]
		}
	}
	if pid == 0 && exited > 0 {
		// The sandbox process runsc recorded is gone (or a zombie) and nothing
		// of the instance runs: it has exited, e.g. killed in the moment
		// between its start and this call.
		return e.exitStatus(id, exited), nil
	}
	if pid == 0 {
		return engine.ExitStatus{}, fmt.Errorf("gvisor: wait %s: no sandbox process: %w", id, engine.ErrNotRunning)
	}
	if err := waitExit(ctx, pid); err != nil {
		return engine.ExitStatus{}, fmt.Errorf("gvisor: wait %s: sandbox process %d: %w", id, pid, err)
	}
	return e.exitStatus(id, pid), nil
}

// exitStatus is the ExitStatus of runsc container rid, whose sandbox process
// pid exited, with the kill counters of its cgroup, which stays until the
// container is deleted: the memory controller's oom_kill (cgroup v1
// memory.oom_control, v2 memory.events) and the pids controller's max
// (pids.events). Counted is false when either cannot be read.
func (e *Engine) exitStatus(rid string, pid int) engine.ExitStatus {
	st := engine.ExitStatus{What: fmt.Sprintf("the sandbox's process (host pid %d)", pid)}
	rel := e.cgroupPath(rid)
	oom, okOOM := cgroupCounter("oom_kill", filepath.Join("/sys/fs/cgroup/memory", rel, "memory.oom_control"), filepath.Join("/sys/fs/cgroup", rel, "memory.events"))
	max, okPids := cgroupCounter("max", filepath.Join("/sys/fs/cgroup/pids", rel, "pids.events"), filepath.Join("/sys/fs/cgroup", rel, "pids.events"))
	st.Counted, st.OOMKills, st.PidsMax = okOOM && okPids, oom, max
	return st
}

// cgroupCounter reads the "key N" line of the first of files that exists.
func cgroupCounter(key string, files ...string) (int, bool) {
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, key+" "); ok {
				n, err := strconv.Atoi(strings.TrimSpace(v))
				return n, err == nil
			}
		}
		return 0, false
	}
	return 0, false
}

// waitExit blocks until process pid (not necessarily a child) has exited, or
// ctx ends (ctx's error).
func waitExit(ctx context.Context, pid int) error {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err == unix.ESRCH {
		return nil
	}
	if err != nil {
		return err
	}
	exited := func(fd uintptr) bool {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(p, 0)
		return err == nil && n > 0
	}
	// A non-blocking pidfd joins the runtime's poller (readable once the process
	// exits), so no thread is held while waiting, and a read deadline ends the
	// wait when ctx does.
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = f.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := rc.Read(exited); err == nil {
		return nil
	} else if ctx.Err() != nil {
		return ctx.Err()
	}
	// Not pollable here: poll(2) in steps, so that ctx is still honoured.
	var perr error
	if err := rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for ctx.Err() == nil {
			n, err := unix.Poll(p, 100)
			if err == unix.EINTR || (err == nil && n == 0) {
				continue
			}
			perr = err
			return
		}
		perr = ctx.Err()
	}); err != nil {
		return err
	}
	return perr
}
