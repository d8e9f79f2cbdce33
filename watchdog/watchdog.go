// Package watchdog stops a cluster node's sandbox instances when its server
// process dies, before the other nodes may declare the node lost and resume
// its sandboxes elsewhere (docs/multi-host.md#the-watchdog).
//
// runsc sandboxes are host processes that outlive the torpor server on
// purpose: a restarted server reattaches them. On a shared database that is
// a split brain once the node's lease (node.LeaseTime) runs out: the others
// mark its sandboxes lost and resume them from their snapshots, while the
// old instances, with no server left to fence them, keep running. So a
// server on a shared database starts a watchdog (Start): a child process
// (`torpor serve-watchdog`, Run) in its own session that holds the read end
// of a pipe whose write end only the server holds. The server sends it each
// heartbeat it wrote to the database (Handle.Heartbeat). At EOF — the server
// is gone, however it died — the watchdog waits until the last heartbeat +
// node.SelfFenceAfter (the self-fence's time) and then stops every instance
// of the data directory's engine (its runsc root, this node's scope only),
// unless a new server on the data directory recorded a heartbeat meanwhile
// (the heartbeat file): that server has its own watchdog.
//
// Files in the data directory:
//
//	heartbeat       "<unix ns> <server pid>\n": the last heartbeat a server of
//	                this data directory wrote to the database (replaced whole)
//	watchdog.lock   flock(2)ed by a watchdog while it decides and stops, and by
//	                a server around its registration (LockHandover), so that a
//	                new server's first heartbeat and a watchdog's stop never
//	                interleave; never the data directory's own lock
//	watchdog.log    what the watchdogs did (appended, slog text)
package watchdog

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/node"
)

// Command is the hidden subcommand of the torpor binary that runs Run.
const Command = "serve-watchdog"

// File names in the data directory (see the package comment).
const (
	HeartbeatFile = "heartbeat"
	LockFile      = "watchdog.lock"
	LogFile       = "watchdog.log"
)

const (
	// lockWait bounds how long a watchdog whose deadline came waits for
	// watchdog.lock held by a server registering: a third of the
	// self-fence margin. A server that still holds it afterwards completes
	// its registration too late and stops the instances itself
	// (LateRegistration).
	lockWait = node.SelfFenceMargin / 3
	// stopTimeout bounds stopping every instance.
	stopTimeout = time.Minute
	// readyTimeout bounds a watchdog's start (Start); generous for a
	// loaded host.
	readyTimeout = 30 * time.Second
	// poll is how often a waiting watchdog reads the heartbeat file.
	poll = 250 * time.Millisecond
)

// Config is what the watchdog process is given (`torpor serve-watchdog`'s
// flags).
type Config struct {
	// DataDir is the server's data directory (absolute); the engine's state
	// is DataDir/gvisor.
	DataDir string
	// Runsc is the runsc binary the server runs.
	Runsc string
	// Node is the node's name (for the log).
	Node string
}

// StartConfig starts a watchdog for the calling server.
type StartConfig struct {
	Config
	// Executable is the torpor binary whose Command runs the watchdog.
	Executable string
}

// Handle is the server's end of its watchdog.
type Handle struct {
	dir  string
	pid  int // the watchdog's
	mu   sync.Mutex
	life *os.File // the pipe's write end; nil once released
	log  *slog.Logger
	// failed is set once a write to the pipe failed (logged once).
	failed bool
}

// Start starts the watchdog of the calling server (StartConfig) and waits
// until it watches: it runs `Executable serve-watchdog --data-dir … --runsc …
// --node …` in its own session, with no stdin, stdout or stderr (it logs to
// DataDir/watchdog.log), the pipe's read end as fd 3 and a ready pipe as fd
// 4. Errors: the binary cannot be started, or the watchdog exits or does not
// say it is ready within 30 s (its log says why).
func Start(cfg StartConfig, log *slog.Logger) (*Handle, error) {
	lifeR, lifeW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("watchdog: %w", err)
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		lifeR.Close()
		lifeW.Close()
		return nil, fmt.Errorf("watchdog: %w", err)
	}
	cmd := exec.Command(cfg.Executable, Command, "--data-dir", cfg.DataDir, "--runsc", cfg.Runsc, "--node", cfg.Node)
	cmd.ExtraFiles = []*os.File{lifeR, readyW}
	// Its own session: no signal to the server's process group (a
	// terminal's ^C, a supervisor's kill of the group) reaches it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	lifeR.Close()
	readyW.Close()
	if err != nil {
		lifeW.Close()
		readyR.Close()
		return nil, fmt.Errorf("watchdog: start %s %s: %w", cfg.Executable, Command, err)
	}
	h := &Handle{dir: cfg.DataDir, pid: cmd.Process.Pid, log: log}
	// Reaped when it exits while this server runs (it outlives the server
	// otherwise, reparented).
	go func() {
		err := cmd.Wait()
		h.mu.Lock()
		released := h.life == nil
		h.mu.Unlock()
		if !released {
			log.Error("watchdog: this server's watchdog exited: if this server dies now its instances keep running past its lease", "watchdog_pid", h.pid, "err", err,
				"log", filepath.Join(cfg.DataDir, LogFile))
		}
	}()
	readyR.SetReadDeadline(time.Now().Add(readyTimeout))
	line, err := bufio.NewReader(readyR).ReadString('\n')
	readyR.Close()
	if err != nil || strings.TrimSpace(line) != "ready" {
		lifeW.Close()
		cmd.Process.Kill()
		return nil, fmt.Errorf("watchdog: %s %s (pid %d) did not start (%v; see %s)", cfg.Executable, Command, cmd.Process.Pid, err,
			filepath.Join(cfg.DataDir, LogFile))
	}
	h.mu.Lock()
	h.life = lifeW
	h.mu.Unlock()
	return h, nil
}

// Pid is the watchdog's process id.
func (h *Handle) Pid() int { return h.pid }

// Heartbeat records a heartbeat the server wrote to the database at at:
// sent to the watchdog first, then written to DataDir/heartbeat (replaced
// whole) for the watchdogs of earlier servers. A failure is logged (once
// for the pipe): the watchdog then stops the instances earlier, never later.
func (h *Handle) Heartbeat(at time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.life != nil && !h.failed {
		h.life.SetWriteDeadline(time.Now().Add(time.Second))
		if _, err := fmt.Fprintf(h.life, "hb %d\n", at.UnixNano()); err != nil {
			h.failed = true
			h.log.Error("watchdog: the heartbeat could not be sent to this server's watchdog: if this server dies its instances are stopped only by the self-fence time of an earlier heartbeat, or not at all",
				"watchdog_pid", h.pid, "err", err)
		}
	}
	if err := writeHeartbeat(h.dir, at, os.Getpid()); err != nil {
		h.log.Warn("watchdog: record the heartbeat", "file", filepath.Join(h.dir, HeartbeatFile), "err", err)
	}
}

// Release ends the watchdog's watch: clean says the server stopped and no
// instance is left on the data directory, so the watchdog exits at once;
// otherwise it acts as for a dead server (the instances are stopped at the
// last heartbeat + node.SelfFenceAfter unless a new server heartbeats).
func (h *Handle) Release(clean bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.life == nil {
		return
	}
	if clean {
		h.life.SetWriteDeadline(time.Now().Add(time.Second))
		fmt.Fprintf(h.life, "clean\n")
	}
	h.life.Close()
	h.life = nil
}

// writeHeartbeat replaces dir/heartbeat with "<at unix ns> <pid>\n".
func writeHeartbeat(dir string, at time.Time, pid int) error {
	p := filepath.Join(dir, HeartbeatFile)
	tmp := p + ".new"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", at.UnixNano(), pid), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// LastHeartbeat reads dir/heartbeat: the last heartbeat a server of the
// data directory wrote to the database and that server's pid. Errors: the
// file is missing (os.ErrNotExist) or malformed.
func LastHeartbeat(dir string) (time.Time, int, error) {
	b, err := os.ReadFile(filepath.Join(dir, HeartbeatFile))
	if err != nil {
		return time.Time{}, 0, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return time.Time{}, 0, fmt.Errorf("%s: malformed: %q", HeartbeatFile, b)
	}
	ns, err1 := strconv.ParseInt(f[0], 10, 64)
	pid, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return time.Time{}, 0, fmt.Errorf("%s: malformed: %q", HeartbeatFile, b)
	}
	return time.Unix(0, ns), pid, nil
}

// LockHandover takes dir/watchdog.lock (flock, exclusive), waiting while a
// watchdog holds it (it is stopping the instances), until ctx ends. A server
// holds it around its registration and first heartbeat record, so that an
// earlier server's watchdog either sees that heartbeat or has stopped the
// instances before the server reattaches them. Errors: ctx's, the file's.
func LockHandover(ctx context.Context, dir string) (unlock func(), err error) {
	return lockFile(ctx, filepath.Join(dir, LockFile))
}

func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("watchdog: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("watchdog: lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("watchdog: lock %s: %w", path, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// LateRegistration says whether a server that registered its node at
// registered, whose previous heartbeat (its record's before, any server's)
// was prev, came too late to keep the instances on the host: after prev +
// node.SelfFenceAfter, when the earlier server's watchdog stops them (or has
// stopped them) and the other nodes may declare the node lost soon. Such a
// server stops them itself before it reconciles. A zero prev (no record) is
// never late.
func LateRegistration(prev, registered time.Time) bool {
	return !prev.IsZero() && node.MustFence(prev, registered)
}

// Run is the watchdog process (Command): fd 3 is the server's pipe, fd 4
// the ready pipe (Start). It ignores SIGTERM, SIGINT, SIGHUP and SIGPIPE (it
// must outlive the server's stop; SIGKILL ends it), says it is ready, reads
// the server's heartbeats until EOF, and then does what the package comment
// says. It logs to DataDir/watchdog.log. Errors: the configuration, or the
// stop's (also logged).
func Run(cfg Config) error {
	if cfg.DataDir == "" || !filepath.IsAbs(cfg.DataDir) || cfg.Runsc == "" {
		return fmt.Errorf("%s: want an absolute --data-dir and --runsc", Command)
	}
	signal.Ignore(syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGPIPE)
	logf, err := os.OpenFile(filepath.Join(cfg.DataDir, LogFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s: %w", Command, err)
	}
	defer logf.Close()
	server := os.Getppid()
	log := slog.New(slog.NewTextHandler(logf, nil)).With("watchdog_pid", os.Getpid(), "server_pid", server, "node", cfg.Node)
	life, ready := os.NewFile(3, "server"), os.NewFile(4, "ready")
	for _, f := range []*os.File{life, ready} {
		if st, err := f.Stat(); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
			return fmt.Errorf("%s: started without its pipes (torpor serve starts it)", Command)
		}
	}
	if _, err := ready.WriteString("ready\n"); err != nil {
		return fmt.Errorf("%s: %w", Command, err)
	}
	ready.Close()
	log.Info("watchdog: watching the server", "data_dir", cfg.DataDir)
	w := &watch{cfg: cfg, log: log, server: server}
	done := make(chan bool, 1)
	go func() { done <- w.read(life) }()
	clean := w.whileServer(done, poll)
	return w.afterServer(clean, time.Now())
}

// HungAfter is how long a server that runs (its pipe open) may send no
// heartbeat before its watchdog stops its instances: node.SelfFenceAfter and
// 2.5 s more, so that a server that is alive but cut off from the database
// fences itself first (checked every second: it stops the instances and,
// the database back, gives its sandboxes up as the others would), and the
// watchdog acts only for one that cannot (SIGSTOP, a deadlock) — still 5 s
// before the others may declare the node lost (node.LeaseTime).
const HungAfter = node.SelfFenceAfter + 2500*time.Millisecond

// whileServer waits for read's answer on done (the server gone) and
// meanwhile, every period, checks that the server still sends heartbeats:
// one that runs but has sent none for HungAfter has its instances stopped,
// once per heartbeat. It returns read's answer.
func (w *watch) whileServer(done <-chan bool, period time.Duration) bool {
	t := time.NewTicker(period)
	defer t.Stop()
	var stoppedAfter time.Time // the last heartbeat before the instances were stopped
	for {
		select {
		case clean := <-done:
			return clean
		case <-t.C:
			last := w.lastBeat()
			if last.IsZero() || time.Since(last) < HungAfter || last.Equal(stoppedAfter) {
				continue
			}
			w.log.Warn("watchdog: the server runs but has sent no heartbeat past its self-fence time (hung or stopped): stopping its instances",
				"last_heartbeat", last, "hung_after", HungAfter, "self_fence_after", node.SelfFenceAfter, "lease", node.LeaseTime)
			if _, err := os.Stat(filepath.Join(w.cfg.DataDir, "gvisor")); err == nil {
				w.stopAll(fmt.Sprintf("the server runs but sent no heartbeat for %s", time.Since(last).Round(time.Second)))
			}
			stoppedAfter = last
		}
	}
}

// lastBeat is the last heartbeat the server sent (zero: none yet).
func (w *watch) lastBeat() time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last
}

// watch is a running watchdog's state.
type watch struct {
	cfg    Config
	log    *slog.Logger
	server int // its server's pid
	mu     sync.Mutex
	// last is the last heartbeat its server sent (zero: none); under mu
	// while read runs.
	last time.Time
}

// read reads the server's messages until EOF and reports whether the server
// said it stopped clean.
func (w *watch) read(life io.Reader) (clean bool) {
	sc := bufio.NewScanner(life)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 2 && f[0] == "hb":
			if ns, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				w.mu.Lock()
				w.last = time.Unix(0, ns)
				w.mu.Unlock()
			}
		case len(f) == 1 && f[0] == "clean":
			clean = true
		}
	}
	return clean
}

// handedOver says whether the heartbeat file holds a heartbeat of another
// server newer than this server's last: that server has its own watchdog.
func (w *watch) handedOver() (bool, time.Time, int) {
	at, pid, err := LastHeartbeat(w.cfg.DataDir)
	return err == nil && pid != w.server && at.After(w.last), at, pid
}

// afterServer is what the watchdog does once its server is gone (at gone).
func (w *watch) afterServer(clean bool, gone time.Time) error {
	switch {
	case clean:
		w.log.Info("watchdog: the server stopped with no instance left; exiting")
		return nil
	case w.last.IsZero():
		w.log.Info("watchdog: the server is gone before it wrote a heartbeat: none of the instances here is in its lease; exiting")
		return nil
	}
	deadline := w.last.Add(node.SelfFenceAfter)
	w.log.Warn("watchdog: the server is gone; its instances are stopped at the self-fence time unless a new server heartbeats before",
		"gone_at", gone, "last_heartbeat", w.last, "stop_at", deadline, "self_fence_after", node.SelfFenceAfter, "lease", node.LeaseTime)
	for time.Now().Before(deadline) {
		if ok, at, pid := w.handedOver(); ok {
			w.log.Info("watchdog: a new server heartbeats for this data directory: it watches the instances now; exiting", "new_server_pid", pid, "heartbeat", at)
			return nil
		}
		time.Sleep(min(poll, time.Until(deadline)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), lockWait)
	unlock, lerr := lockFile(ctx, filepath.Join(w.cfg.DataDir, LockFile))
	cancel()
	if lerr != nil {
		// A server registering holds it: it finishes too late and stops
		// them itself; stopping them here as well does no harm.
		w.log.Warn("watchdog: the handover lock was not taken (a new server registering late holds it?): stopping the instances without it", "wait", lockWait, "err", lerr)
	} else {
		defer unlock()
	}
	if ok, at, pid := w.handedOver(); ok {
		w.log.Info("watchdog: a new server heartbeats for this data directory: it watches the instances now; exiting", "new_server_pid", pid, "heartbeat", at)
		return nil
	}
	if _, err := os.Stat(filepath.Join(w.cfg.DataDir, "gvisor")); err != nil {
		// Nothing of the engine to stop by (and nothing to make again).
		w.log.Error("watchdog: the data directory's engine state is gone: no instance can be stopped by it", "err", err)
		return err
	}
	return w.stopAll("the server is gone")
}

// stopAll stops every instance of the data directory's gVisor engine (its
// runsc root: this node's instances only), each as the engine stops one
// (runsc delete, then the processes under its bundle, its network
// namespaces), at most 8 at once. why, the log's reason, says what
// happened to the server (gone, or running without heartbeats).
func (w *watch) stopAll(why string) error {
	ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	gv, err := gvisor.New(gvisor.Config{Runsc: w.cfg.Runsc, StateDir: filepath.Join(w.cfg.DataDir, "gvisor")})
	if err != nil {
		w.log.Error("watchdog: cannot stop the instances", "err", err)
		return err
	}
	infos, err := gv.List(ctx)
	if err != nil {
		w.log.Error("watchdog: cannot list the instances", "err", err)
		return err
	}
	t0 := time.Now()
	var mu sync.Mutex
	var stopped, failed []string
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, i := range infos {
		wg.Add(1)
		sem <- struct{}{}
		go func(i engine.Info) {
			defer func() { <-sem; wg.Done() }()
			err := gv.Stop(ctx, i.ID)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed = append(failed, i.ID)
				w.log.Error("watchdog: stop", "instance", i.ID, "pid", i.Pid, "err", err)
				return
			}
			stopped = append(stopped, i.ID)
		}(i)
	}
	wg.Wait()
	w.log.Warn("watchdog: "+why+": stopped its instances before the other nodes may declare the node lost",
		"stopped", len(stopped), "instances", strings.Join(stopped, ","), "failed", len(failed), "took", time.Since(t0).Round(time.Millisecond))
	if len(failed) > 0 {
		return fmt.Errorf("%s: %d instances not stopped: %s", Command, len(failed), strings.Join(failed, ","))
	}
	return nil
}
