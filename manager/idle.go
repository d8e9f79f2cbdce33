package manager

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// The idle trigger.
//
// A running sandbox with idle_timeout_s = T > 0 is idle, and is hibernated (mode
// none: deleted), when for the last T seconds all of these held (and with
// pause_after_s = P below T, or T = 0, it is first paused after P such seconds,
// pause.go; a paused sandbox uses no CPU, so for it only 1 and 2 count, and at
// T it is hibernated on its pause's snapshot):
//
//  1. no API call used it: exec, files (read or write), a proxied request, resume,
//     create, fork (as clone) or PATCH. Status reads (GET, list) do not count;
//  2. no proxied connection to it was open (counted from DialPort until the
//     connection is closed) and no exec stream was open (from Exec until its
//     stream is closed: a foreground command keeps its sandbox awake however long
//     it runs);
//  3. every CPU sample was below the threshold: the loop reads the instance's CPU
//     time (engine.CPUMeter; the gVisor cgroup) every CheckInterval (1 s) and a
//     sample whose average use over that interval is at or above
//     IdleCPUThreshold (default 5 % of one core) counts as activity. A background
//     job that computes keeps its sandbox awake; one that sleeps does not.
//
// The loop checks every CheckInterval; the decision is taken again under the
// sandbox's lock right before acting, so a request that arrived meanwhile (it
// touches the sandbox under the same lock) cancels it. The hibernate goes through
// hibernateLocked, the code path of POST /hibernate, so it captures exactly what a
// manual hibernate does. Clocks restart whenever the sandbox gets a new instance
// (create, resume, fork) and when the server starts.
//
// Run timeouts: a sandbox with timeout_s = L > 0 whose running time since the
// start of its timeout period reaches L is hibernated (on_timeout "hibernate";
// in mode none it is deleted) or deleted (on_timeout "delete"). Only time in state
// running counts (usage.go), so nothing counts down while it is hibernated. The
// period starts at create, at a PATCH that sets timeout_s, and again after each
// timeout-triggered hibernate, so a sandbox resumed after its timeout may run L
// more seconds.

type lifecycle struct {
	mu  sync.Mutex
	act map[string]*activity
}

type activity struct {
	instance string
	last     time.Time // last activity
	conns    int       // open proxied connections
	execs    int       // open exec streams
	cpuAt    time.Time // time of the last CPU sample (zero: none yet)
	cpuPrev  time.Duration
	cpuRate  float64   // last sample, in cores
	retryAt  time.Time // after a failed idle or timeout action, not before this
}

// entry returns id's activity record, creating it; the caller holds lc.mu.
func (l *lifecycle) entry(id string) *activity {
	if l.act == nil {
		l.act = map[string]*activity{}
	}
	a := l.act[id]
	if a == nil {
		a = &activity{last: time.Now()}
		l.act[id] = a
	}
	return a
}

// touch records an API call on sandbox id.
func (m *Manager) touch(id string) {
	m.lc.mu.Lock()
	m.lc.entry(id).last = time.Now()
	m.lc.mu.Unlock()
}

func (m *Manager) addOpen(id string, conns, execs int) {
	m.lc.mu.Lock()
	a := m.lc.entry(id)
	a.conns = max(0, a.conns+conns)
	a.execs = max(0, a.execs+execs)
	a.last = time.Now()
	m.lc.mu.Unlock()
}

// HibernateDrain is how long a hibernate waits for the sandbox's proxied
// connections, exec streams and file uploads in flight to end before its
// checkpoint cuts them (an exec stream ends with exit code 255 and the agent
// kills its command on resume, its client being gone; an upload writes
// nothing). Requests that arrive meanwhile wait for the sandbox's lock and
// resume it afterwards.
const HibernateDrain = 10 * time.Second

// envdPrepareTimeout bounds the hibernate's request to the agent to end its
// envd streams; an agent that does not answer in time is drained as before.
const envdPrepareTimeout = 2 * time.Second

// endEnvdStreams asks sandbox id's agent to end its open envd streams (E2B's
// SDKs keep a background command's output, a PTY or a watch open, and those
// never end on their own) before a hibernate's drain, so that they do not
// hold it for all of HibernateDrain. Each such stream's connection then
// closes as its answer ends; the processes go on, and the SDK re-attaches
// after the resume. Failures are logged: the drain then cuts the streams at
// its end, as it does for an agent too old to be asked.
func (m *Manager) endEnvdStreams(ctx context.Context, id string) {
	c := m.liveClient(id)
	if c == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, envdPrepareTimeout)
	defer cancel()
	if n, err := c.PrepareHibernate(pctx); err != nil {
		m.log.Warn("hibernate: the agent did not end its envd streams; draining them", "sandbox", id, "err", err)
	} else if n > 0 {
		m.log.Debug("hibernate: the agent ended its envd streams", "sandbox", id, "streams", n)
	}
}

// drain waits, up to d, until sandbox id has no proxied connection and no exec
// stream open, and returns how many are still open. The caller holds id's lock,
// so none starts meanwhile.
func (m *Manager) drain(id string, d time.Duration) (conns, execs int) {
	deadline := time.Now().Add(d)
	for {
		m.lc.mu.Lock()
		if a := m.lc.act[id]; a != nil {
			conns, execs = a.conns, a.execs
		}
		m.lc.mu.Unlock()
		if conns+execs == 0 || !time.Now().Before(deadline) {
			return conns, execs
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// countConn counts a proxied connection as open until it is closed.
func (m *Manager) countConn(id string, c net.Conn) net.Conn {
	m.addOpen(id, 1, 0)
	return &countedConn{Conn: c, done: func() { m.addOpen(id, -1, 0) }}
}

type countedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}

// ExecStream is an exec's event stream; while it is open its sandbox is not
// idle. Close it when done.
type ExecStream struct {
	st   *agentclient.ExecStream
	once sync.Once
	done func()
}

// Next returns the next event: output chunks (Stream, Data), then a last event
// with ExitCode (foreground), Pid (background start) or Error (not started).
// After the last event it returns io.EOF; if the stream breaks before it,
// io.ErrUnexpectedEOF or the read error.
func (s *ExecStream) Next() (sandbox.ExecEvent, error) { return guestNext(s.st) }

// Close releases the stream.
func (s *ExecStream) Close() error {
	err := s.st.Close()
	s.once.Do(s.done)
	return err
}

func (m *Manager) trackExec(id string, _ *agentclient.Client) func(*agentclient.ExecStream, error) (*ExecStream, error) {
	return func(st *agentclient.ExecStream, err error) (*ExecStream, error) {
		if err != nil {
			return nil, err
		}
		m.addOpen(id, 0, 1)
		return &ExecStream{st: st, done: func() { m.addOpen(id, 0, -1) }}, nil
	}
}

// RunLifecycle runs the idle and timeout loop until ctx ends. The server starts it
// after Reconcile and cancels it (and waits for it) before closing the database.
func (m *Manager) RunLifecycle(ctx context.Context) {
	t := time.NewTicker(m.lcfg().CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.lifecycleTick(ctx)
		}
	}
}

func (m *Manager) lifecycleTick(ctx context.Context) {
	if m.collectAgain.Load() && time.Since(time.Unix(0, m.collectAt.Load())) >= collectRetryTicks*m.lcfg().CheckInterval {
		m.collectSnapshots(ctx)
	}
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		if ctx.Err() == nil {
			m.log.Warn("lifecycle: list sandboxes", "err", err)
		}
		return
	}
	cfg := m.lcfg()
	now := time.Now()
	running := map[string]bool{}
	type action struct {
		id, why string
		timeout bool
		expire  bool
		pause   bool
		demote  string // cause of a paused sandbox's demotion
	}
	var todo []action
	var paused []*metadata.Sandbox
	for _, s := range all {
		if m.foreign(s) {
			continue // its owner enforces its policies
		}
		if !s.Deleting && s.State == sandbox.StatePaused {
			// A paused sandbox uses no CPU: only calls and open connections
			// count; at its idle timeout it is hibernated (demoted).
			paused = append(paused, s)
			running[s.ID] = true
			m.lc.mu.Lock()
			a := m.lc.entry(s.ID)
			if a.instance != s.Instance {
				a.instance, a.last, a.cpuAt, a.cpuRate = s.Instance, now, time.Time{}, 0
			}
			if a.conns > 0 || a.execs > 0 {
				a.last = now
			}
			idleFor, retry := now.Sub(a.last), now.After(a.retryAt)
			m.lc.mu.Unlock()
			if retry && s.IdleTimeoutS > 0 && idleFor >= time.Duration(s.IdleTimeoutS)*time.Second {
				todo = append(todo, action{id: s.ID, why: "idle (paused)", demote: "idle"})
			}
			continue
		}
		if !s.Deleting && s.State == sandbox.StateHibernated && expired(s, now) {
			// Retention: a hibernated sandbox past its expires_at is deleted
			// (after a failed attempt, again 30 s later).
			m.lc.mu.Lock()
			a := m.lc.act[s.ID]
			wait := a != nil && now.Before(a.retryAt)
			m.lc.mu.Unlock()
			running[s.ID] = true // keeps the retry time
			if !wait {
				todo = append(todo, action{id: s.ID, why: "retention", expire: true})
			}
			continue
		}
		if s.Deleting || s.State != sandbox.StateRunning || s.Instance == "" {
			continue
		}
		running[s.ID] = true
		var cpu time.Duration
		cpuOK := false
		if meter, ok := m.eng(s).Engine.(engine.CPUMeter); ok && s.IdleTimeoutS > 0 {
			if v, err := meter.CPUTime(s.Instance); err == nil {
				cpu, cpuOK = v, true
			}
		}
		m.lc.mu.Lock()
		a := m.lc.entry(s.ID)
		if a.instance != s.Instance {
			// A new incarnation (create, resume, fork, server start): clocks restart.
			a.instance, a.last, a.cpuAt, a.cpuRate = s.Instance, now, time.Time{}, 0
		}
		if cpuOK {
			if !a.cpuAt.IsZero() && now.After(a.cpuAt) {
				a.cpuRate = float64(cpu-a.cpuPrev) / float64(now.Sub(a.cpuAt))
				if a.cpuRate >= cfg.IdleCPUThreshold {
					a.last = now
				}
			}
			a.cpuAt, a.cpuPrev = now, cpu
		}
		if a.conns > 0 || a.execs > 0 {
			a.last = now
		}
		idleFor := now.Sub(a.last)
		retry := now.After(a.retryAt)
		m.lc.mu.Unlock()
		if !retry {
			continue
		}
		if s.TimeoutS > 0 {
			run, _ := m.usageAt(ctx, s, now)
			if run-s.TimeoutBaseMS >= int64(s.TimeoutS)*1000 {
				todo = append(todo, action{id: s.ID, why: "timeout", timeout: true})
				continue
			}
		}
		if s.IdleTimeoutS > 0 && idleFor >= time.Duration(s.IdleTimeoutS)*time.Second {
			todo = append(todo, action{id: s.ID, why: "idle"})
		} else if w := pauseWindow(s.Policy); w > 0 && idleFor >= w && m.canPause(s) {
			todo = append(todo, action{id: s.ID, why: "idle pause", pause: true})
		}
	}
	// The standby budget: paused sandboxes beyond it are hibernated, those
	// paused longest first.
	// Warm pools' ready clones share the budget and go first (pool.go).
	if cfg.StandbyMemoryMiB > 0 {
		room := cfg.StandbyMemoryMiB
		for _, s := range paused {
			room -= s.MemoryMiB
		}
		m.trimPools(ctx, room)
	}
	for _, id := range overBudget(paused, cfg.StandbyMemoryMiB) {
		todo = append(todo, action{id: id, why: "standby budget", demote: "standby_budget"})
	}
	m.lc.mu.Lock()
	for id, a := range m.lc.act {
		if !running[id] && a.conns == 0 && a.execs == 0 {
			delete(m.lc.act, id)
		}
	}
	m.lc.mu.Unlock()
	for _, a := range todo {
		if ctx.Err() != nil {
			return
		}
		act := func() error { return m.lifecycleAct(ctx, a.id, a.timeout) }
		switch {
		case a.expire:
			act = func() error { return m.expire(ctx, a.id) }
		case a.pause:
			act = func() error { return m.pauseIdle(ctx, a.id) }
		case a.demote != "":
			act = func() error { return m.demote(ctx, a.id, a.demote, a.demote == "idle") }
		}
		if err := act(); err != nil {
			m.log.Warn("lifecycle: "+a.why+" action failed", "sandbox", a.id, "err", err)
			m.lc.mu.Lock()
			m.lc.entry(a.id).retryAt = time.Now().Add(30 * time.Second)
			m.lc.mu.Unlock()
		}
	}
}

// lifecycleAct re-checks, under the sandbox's lock, that the timeout ran out or
// the sandbox is still idle, and then hibernates or deletes it.
func (m *Manager) lifecycleAct(ctx context.Context, id string, timeout bool) error {
	return m.inState(ctx, id, sandbox.StateRunning, func(ctx context.Context, s *metadata.Sandbox) error {
		return m.idleOrTimeoutLocked(ctx, s, timeout)
	})
}

func (m *Manager) idleOrTimeoutLocked(ctx context.Context, s *metadata.Sandbox, timeout bool) error {
	id := s.ID
	now := time.Now()
	if timeout {
		run, _ := m.usageAt(ctx, s, now)
		if s.TimeoutS <= 0 || run-s.TimeoutBaseMS < int64(s.TimeoutS)*1000 {
			return nil
		}
		if s.OnTimeout == sandbox.OnTimeoutDelete || s.HibernationMode == sandbox.ModeNone {
			m.log.Info("timeout: deleting", "sandbox", id, "timeout_s", s.TimeoutS)
			return m.deleteLocked(ctx, s)
		}
		m.accrue(ctx, s, now)
		s.TimeoutBaseMS = s.RunningMS // a new period starts with the next resume
		m.log.Info("timeout: hibernating", "sandbox", id, "timeout_s", s.TimeoutS, "mode", s.HibernationMode)
		return m.hibernateLocked(ctx, s, m.cfg.AsyncUpload)
	}
	if s.IdleTimeoutS <= 0 || !m.stillIdle(id, s.Instance, time.Duration(s.IdleTimeoutS)*time.Second) {
		return nil
	}
	if s.HibernationMode == sandbox.ModeNone {
		m.log.Info("idle: deleting (hibernation mode none)", "sandbox", id, "idle_timeout_s", s.IdleTimeoutS)
		return m.deleteLocked(ctx, s)
	}
	m.log.Info("idle: hibernating", "sandbox", id, "idle_timeout_s", s.IdleTimeoutS, "mode", s.HibernationMode)
	return m.hibernateLocked(ctx, s, m.cfg.AsyncUpload)
}

func (m *Manager) stillIdle(id, instance string, window time.Duration) bool {
	m.lc.mu.Lock()
	defer m.lc.mu.Unlock()
	a := m.lc.act[id]
	return a != nil && a.instance == instance && a.conns == 0 && a.execs == 0 && time.Since(a.last) >= window
}

// hibernateLocked hibernates a running sandbox as its hibernation mode says: the
// one code path of a manual, an idle-triggered and a timeout-triggered hibernate.
// The caller holds s's lock. Mode none keeps nothing, so it cannot be hibernated
// (sandbox.ErrConflict): the idle trigger deletes such a sandbox instead. async selects
// an asynchronous upload (see HibernateOptions).
func (m *Manager) hibernateLocked(ctx context.Context, s *metadata.Sandbox, async bool) error {
	switch s.HibernationMode {
	case sandbox.ModeNone:
		return sandboxConflict(s.ID, "sandbox %s has hibernation mode none, which keeps nothing", s.ID).
			WithHint("change its hibernation mode to hibernate it")
	case sandbox.ModeFilesystem:
		return m.hibernateFilesystemLocked(ctx, s, async)
	}
	_, err := m.snapshotLocked(ctx, s, false, async)
	return err
}

// LifecycleCounters reports, for tests and debugging, the open proxied
// connections and exec streams counted for sandbox id and the last CPU sample.
func (m *Manager) LifecycleCounters(id string) (conns, execs int, cpuCores float64) {
	m.lc.mu.Lock()
	defer m.lc.mu.Unlock()
	if a := m.lc.act[id]; a != nil {
		return a.conns, a.execs, a.cpuRate
	}
	return 0, 0, 0
}
