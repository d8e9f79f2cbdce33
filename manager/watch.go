package manager

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/sandbox"
)

// An instance can die without the manager asking: the host's OOM killer ends the
// whole sandbox when it outgrows its memory limit (gVisor has no OOM killer of its
// own; the cgroup's kills the sandbox process), or someone kills it. watch notices
// at once, so that the API never reports a dead sandbox as running and calls in
// flight to it end instead of hanging until TCP keepalive gives up (~150 s).

// watch waits for instance to exit (Engine.Wait) and then calls
// instanceExited. It returns at once.
func (m *Manager) watch(id, instance string) {
	go func() {
		ctx := context.Background()
		st, err := m.engOf(instance).Wait(ctx, instance)
		if errors.Is(err, engine.ErrNotRunning) {
			// Never report a sandbox dead on a guess; the next call will fail.
			// A sandbox hibernated or deleted right after its start or resume
			// no longer runs this instance: nothing to report.
			if s, err := m.get(ctx, id); err != nil || s.Instance != instance || s.State == sandbox.StateHibernating {
				m.log.Debug("watch: instance gone before it was followed", "sandbox", id, "instance", instance)
				return
			}
			// The process may have ended between the start and this call (a kill
			// right after create). Ask the engine's list, which sees what runs
			// on the host: an instance it does not list as running is gone.
			if gone, lerr := m.instanceGone(ctx, instance); lerr != nil || !gone {
				m.log.Warn("watch: engine does not run the instance", "sandbox", id, "instance", instance, "err", err, "list_err", lerr)
				return
			}
			m.instanceExited(id, instance, engine.ExitStatus{What: "the sandbox's process (gone before it was followed)"})
			return
		}
		if err != nil {
			m.log.Warn("watch: cannot follow the instance", "sandbox", id, "instance", instance, "err", err)
			return
		}
		m.instanceExited(id, instance, st)
	}()
}

// instanceGone reports whether the engine of instance does not list it as
// running. It returns an error when the list cannot be read (then nothing is
// known).
func (m *Manager) instanceGone(ctx context.Context, instance string) (bool, error) {
	infos, err := m.engOf(instance).List(ctx)
	if err != nil {
		return false, err
	}
	for _, in := range infos {
		if in.ID == instance && in.Running {
			return false, nil
		}
	}
	return true, nil
}

// instanceExited handles the end of instance's process. If the sandbox still runs
// on that instance (the manager did not hibernate, delete or replace it), it is
// reported error and the instance's leftovers are removed; then calls in flight to
// the instance end (after the state is recorded, so a caller who sees its call
// fail and looks at the sandbox sees why).
func (m *Manager) instanceExited(id, instance string, st engine.ExitStatus) {
	defer m.closeConns(instance)
	ctx := context.Background()
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil || s.Instance != instance {
		return
	}
	if s.State == sandbox.StatePaused && m.pauseCovered(ctx, s) {
		// Its snapshot holds everything it had: hibernated on it, and the
		// next request resumes it.
		m.log.Warn("paused sandbox's process exited; hibernating it on its pause's snapshot", "sandbox", id, "instance", instance, "what", st.What)
		if err := m.demoteLocked(ctx, s, "exited"); err == nil {
			return
		}
	}
	if s.State != sandbox.StateRunning && s.State != sandbox.StatePaused {
		return
	}
	m.log.Warn("sandbox process exited unexpectedly", "sandbox", id, "instance", instance, "what", st.What)
	m.dropLive(id)
	m.fail(ctx, s, fmt.Errorf("%s exited unexpectedly and every process in it ended; %s", st.What, exitCause(st, s.MemoryMiB)))
	if err := m.engOf(instance).Stop(ctx, instance); err != nil {
		m.log.Warn("stop exited instance", "sandbox", id, "err", err)
	}
}

// connTracker holds the open connections to each instance. It has its own lock:
// closing a connection (which untracks it) happens while Manager.mu is held, in
// dropLive's CloseIdleConnections.
type connTracker struct {
	mu    sync.Mutex
	conns map[string]map[*trackedConn]struct{} // instance -> open connections
}

// trackConn records a connection to instance so that closeConns can end it.
func (m *Manager) trackConn(instance string, c net.Conn) net.Conn {
	t := &m.conns
	tc := &trackedConn{Conn: c}
	t.mu.Lock()
	if t.conns == nil {
		t.conns = map[string]map[*trackedConn]struct{}{}
	}
	if t.conns[instance] == nil {
		t.conns[instance] = map[*trackedConn]struct{}{}
	}
	t.conns[instance][tc] = struct{}{}
	t.mu.Unlock()
	tc.untrack = func() {
		t.mu.Lock()
		if set := t.conns[instance]; set != nil {
			delete(set, tc)
			if len(set) == 0 {
				delete(t.conns, instance)
			}
		}
		t.mu.Unlock()
	}
	return tc
}

// closeConns closes every tracked connection to instance.
func (m *Manager) closeConns(instance string) {
	t := &m.conns
	t.mu.Lock()
	var all []*trackedConn
	for c := range t.conns[instance] {
		all = append(all, c)
	}
	t.mu.Unlock()
	for _, c := range all {
		c.Close()
	}
}

type trackedConn struct {
	net.Conn
	once    sync.Once
	untrack func()
}

func (c *trackedConn) Close() error {
	c.once.Do(c.untrack)
	return c.Conn.Close()
}

// exitCause says what is known of why an instance of a sandbox with a memory
// limit of memoryMiB ended by itself, from its engine's kill counters: killed
// for its memory only when its cgroup counted an OOM kill.
func exitCause(st engine.ExitStatus, memoryMiB int) string {
	switch {
	case !st.Counted:
		return "the cause is not known (its kill counters could not be read)"
	case st.OOMKills > 0:
		return fmt.Sprintf("the host killed it for using more than its memory limit of %d MiB (%d OOM kills in its cgroup)", memoryMiB, st.OOMKills)
	case st.PidsMax > 0:
		return fmt.Sprintf("its host tasks reached their backstop limit (%d forks refused in its cgroup), which gVisor's kernel does not survive", st.PidsMax)
	default:
		return "it was not killed for its memory (no OOM kill and no refused task in its cgroup): its guest agent " +
			"(its first process) or gVisor's kernel ended, or a signal from the host ended it"
	}
}
