// Package fake is an in-memory engine.Engine for unit tests of the manager and
// the server: no root, no runsc, an instance starts in microseconds. It passes
// the engine conformance suite (enginetest) without the checks of process
// continuity, which only a real engine can keep.
//
// Each instance is the real guest agent (package guest/agent) served in the
// test process on an in-memory listener, with its own directory as the root
// of its files API and of its commands' working directory (agent
// Options.Root), its resume-contract directory at <root>/run/torpor. Commands
// run on the host as the test process, so tests keep to true/echo/cat-level
// commands with relative paths; an absolute path in a command line is the
// host's. Background commands are not killed by Stop.
//
// A checkpoint copies the instance's directory into the checkpoint directory
// (fs/) with a record of the engine and version that wrote it (fake.json); a
// restore copies it into the new instance's directory, so the writable layer
// continues and clones are independent. A restore refuses a checkpoint of
// another engine or version, as runsc does.
//
// Hooks make any call fail (Fail) or block until released or its context ends
// (Block), per method and instance; Kill ends an instance as the host's OOM
// killer would.
package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"sync"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agent"
)

// Method names an engine call for hooks.
type Method string

// The engine's methods.
const (
	Start      Method = "start"
	Restore    Method = "restore"
	Checkpoint Method = "checkpoint" // Checkpoint and CheckpointExit
	Stop       Method = "stop"
	Dial       Method = "dial"
	List       Method = "list"
	Wait       Method = "wait"
	Pause      Method = "pause"
	Unpause    Method = "unpause"
)

// Config configures an engine.
type Config struct {
	// Dir is a directory the engine owns (a test's t.TempDir()); each instance
	// gets a short numbered sub-directory. Keep it short: the agent's events
	// socket lives below it and a Unix socket path has at most 107 bytes.
	Dir string
	// Name and Version identify the engine (defaults "fake" and "fake 1").
	Name, Version string
}

// Engine implements engine.Engine, engine.ExitCheckpointer and engine.Pauser
// in memory.
type Engine struct {
	cfg Config

	mu    sync.Mutex
	insts map[string]*instance
	seq   int
	hooks []*hook
	calls map[Method]int
}

var (
	_ engine.Engine           = (*Engine)(nil)
	_ engine.ExitCheckpointer = (*Engine)(nil)
	_ engine.Pauser           = (*Engine)(nil)
)

type instance struct {
	id      string
	root    string // the instance's files
	agent   *pipeListener
	ports   map[int]*pipeListener // listeners a test opened (Listen)
	stop    context.CancelFunc    // ends the agent
	served  chan struct{}         // closed when the agent's Serve returned
	exited  chan struct{}         // closed when the instance stopped running
	running bool
	// unpaused is closed while the instance is not paused; Pause replaces
	// it with an open channel, which Unpause closes.
	unpaused chan struct{}
	what     string // ExitStatus.What once exited
}

// closedChan is an unpaused instance's unpaused.
func closedChan() chan struct{} { c := make(chan struct{}); close(c); return c }

// New returns an engine keeping its instances under cfg.Dir. Errors: Dir
// missing or not creatable.
func New(cfg Config) (*Engine, error) {
	if cfg.Name == "" {
		cfg.Name = "fake"
	}
	if cfg.Version == "" {
		cfg.Version = "fake 1"
	}
	if cfg.Dir == "" {
		return nil, errors.New("fake: no Dir")
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("fake: %w", err)
	}
	return &Engine{cfg: cfg, insts: map[string]*instance{}, calls: map[Method]int{}}, nil
}

// Name implements engine.Engine.
func (e *Engine) Name() string { return e.cfg.Name }

// Version implements engine.Engine.
func (e *Engine) Version() string { return e.cfg.Version }

// hook is one Fail or Block.
type hook struct {
	method  Method
	id      string // "" = every instance
	err     error  // Fail
	release chan struct{}
	reached chan struct{} // closed when the first call blocked
	reach   sync.Once
	once    sync.Once
}

// Fail makes every later call of method on instance id ("" = any instance)
// return err, until the returned undo is called.
func (e *Engine) Fail(method Method, id string, err error) (undo func()) {
	h := &hook{method: method, id: id, err: err}
	return e.addHook(h)
}

// Blocker is a Block hook.
type Blocker struct {
	h    *hook
	undo func()
}

// Reached is closed once a call has blocked on the hook.
func (b *Blocker) Reached() <-chan struct{} { return b.h.reached }

// Release lets the blocked calls (and later ones) proceed and removes the
// hook. It may be called more than once.
func (b *Blocker) Release() {
	b.h.once.Do(func() { close(b.h.release) })
	b.undo()
}

// Block makes every later call of method on instance id ("" = any instance)
// wait, before it does anything, until Release or until the call's context
// ends (the call then returns the context's error and changes nothing).
func (e *Engine) Block(method Method, id string) *Blocker {
	h := &hook{method: method, id: id, release: make(chan struct{}), reached: make(chan struct{})}
	return &Blocker{h: h, undo: e.addHook(h)}
}

func (e *Engine) addHook(h *hook) func() {
	e.mu.Lock()
	e.hooks = append(e.hooks, h)
	e.mu.Unlock()
	return func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		for i, x := range e.hooks {
			if x == h {
				e.hooks = append(e.hooks[:i], e.hooks[i+1:]...)
				return
			}
		}
	}
}

// Calls returns how many times method was called.
func (e *Engine) Calls(method Method) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls[method]
}

// enter counts a call and runs the hooks that match it.
func (e *Engine) enter(ctx context.Context, method Method, id string) error {
	e.mu.Lock()
	e.calls[method]++
	var hs []*hook
	for _, h := range e.hooks {
		if h.method == method && (h.id == "" || h.id == id) {
			hs = append(hs, h)
		}
	}
	e.mu.Unlock()
	for _, h := range hs {
		if h.err != nil {
			return fmt.Errorf("fake: %s %s: %w", method, id, h.err)
		}
		if h.release != nil {
			h.reach.Do(func() { close(h.reached) })
			select {
			case <-h.release:
			case <-ctx.Done():
				return fmt.Errorf("fake: %s %s: %w", method, id, ctx.Err())
			}
		}
	}
	return nil
}

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,59}$`)

// checkpointFile records which engine wrote a checkpoint directory.
const checkpointFile = "fake.json"

type checkpointRecord struct {
	Engine  string `json:"engine"`
	Version string `json:"version"`
	Source  string `json:"source"`
}

// Start implements engine.Engine.
func (e *Engine) Start(ctx context.Context, spec engine.Spec) error {
	if err := e.enter(ctx, Start, spec.ID); err != nil {
		return err
	}
	return e.launch(spec, "")
}

// Restore implements engine.Engine. Errors: dir not absolute, not a
// checkpoint of this engine, or written by another engine or version.
func (e *Engine) Restore(ctx context.Context, spec engine.Spec, dir string) error {
	if err := e.enter(ctx, Restore, spec.ID); err != nil {
		return err
	}
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("fake: restore %s: image path %q is not absolute", spec.ID, dir)
	}
	b, err := os.ReadFile(filepath.Join(dir, checkpointFile))
	if err != nil {
		return fmt.Errorf("fake: restore %s: not a checkpoint: %w", spec.ID, err)
	}
	var rec checkpointRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return fmt.Errorf("fake: restore %s: %s: %w", spec.ID, checkpointFile, err)
	}
	if rec.Engine != e.cfg.Name || rec.Version != e.cfg.Version {
		return fmt.Errorf("fake: restore %s: checkpoint of %s %s, this is %s %s", spec.ID, rec.Engine, rec.Version, e.cfg.Name, e.cfg.Version)
	}
	return e.launch(spec, filepath.Join(dir, "fs"))
}

// launch starts instance spec.ID, its files copied from from ("" = empty).
func (e *Engine) launch(spec engine.Spec, from string) error {
	if !idRE.MatchString(spec.ID) {
		return fmt.Errorf("fake: invalid instance id %q", spec.ID)
	}
	e.mu.Lock()
	if old := e.insts[spec.ID]; old != nil {
		e.mu.Unlock()
		return fmt.Errorf("fake: instance %s exists", spec.ID)
	}
	e.seq++
	root := filepath.Join(e.cfg.Dir, strconv.Itoa(e.seq))
	inst := &instance{id: spec.ID, root: root, agent: newPipeListener(), ports: map[int]*pipeListener{},
		served: make(chan struct{}), exited: make(chan struct{}), running: true, unpaused: closedChan()}
	e.insts[spec.ID] = inst
	e.mu.Unlock()
	fail := func(err error) error {
		e.mu.Lock()
		delete(e.insts, spec.ID)
		e.mu.Unlock()
		os.RemoveAll(root)
		return fmt.Errorf("fake: launch %s: %w", spec.ID, err)
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fail(err)
	}
	if from != "" {
		if err := copyTree(root, from); err != nil {
			return fail(err)
		}
	}
	env := map[string]string{}
	for k, v := range spec.Env {
		env[k] = v
	}
	ctx, cancel := context.WithCancel(context.Background())
	inst.stop = cancel
	go func() {
		defer close(inst.served)
		_ = agent.Serve(ctx, inst.agent, agent.Options{
			Env: env, Root: root,
			RunDir:   filepath.Join(root, "run", "torpor"),
			HooksDir: filepath.Join(root, "etc", "torpor", "resume.d"),
		})
	}()
	return nil
}

// Checkpoint implements engine.Engine.
func (e *Engine) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	if err := e.checkpoint(ctx, id, dir); err != nil {
		return err
	}
	if !leaveRunning {
		return e.remove(id)
	}
	return nil
}

// CheckpointExit implements engine.ExitCheckpointer: the instance stops
// running once the image is complete and is removed by Stop.
func (e *Engine) CheckpointExit(ctx context.Context, id, dir string) error {
	if err := e.checkpoint(ctx, id, dir); err != nil {
		return err
	}
	e.exit(id, "the fake instance (checkpointed)")
	return nil
}

func (e *Engine) checkpoint(ctx context.Context, id, dir string) error {
	if err := e.enter(ctx, Checkpoint, id); err != nil {
		return err
	}
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("fake: checkpoint %s: image path %q is not absolute", id, dir)
	}
	inst := e.get(id)
	if inst == nil || !inst.running {
		return fmt.Errorf("fake: checkpoint %s: %w", id, engine.ErrNotRunning)
	}
	if err := copyTree(filepath.Join(dir, "fs"), inst.root); err != nil {
		return fmt.Errorf("fake: checkpoint %s: %w", id, err)
	}
	b, _ := json.Marshal(checkpointRecord{Engine: e.cfg.Name, Version: e.cfg.Version, Source: id})
	if err := os.WriteFile(filepath.Join(dir, checkpointFile), b, 0o600); err != nil {
		return fmt.Errorf("fake: checkpoint %s: %w", id, err)
	}
	return nil
}

func (e *Engine) get(id string) *instance {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.insts[id]
}

// Kill ends instance id as the host's OOM killer would: it stops running (its
// agent and listeners close, Wait returns) and stays listed, not running,
// until Stop. Killing an unknown or exited instance does nothing.
func (e *Engine) Kill(id string) { e.exit(id, "the fake instance (killed)") }

// exit stops instance id running and waits for its agent to end.
func (e *Engine) exit(id, what string) {
	e.mu.Lock()
	inst := e.insts[id]
	if inst == nil || !inst.running {
		e.mu.Unlock()
		return
	}
	inst.running = false
	inst.what = what
	ports := inst.ports
	e.mu.Unlock()
	inst.agent.Close()
	for _, l := range ports {
		l.Close()
	}
	inst.stop()
	<-inst.served
	close(inst.exited)
}

// remove ends instance id and forgets it.
func (e *Engine) remove(id string) error {
	e.exit(id, "the fake instance (stopped)")
	e.mu.Lock()
	inst := e.insts[id]
	delete(e.insts, id)
	e.mu.Unlock()
	if inst != nil {
		return os.RemoveAll(inst.root)
	}
	return nil
}

// Stop implements engine.Engine.
func (e *Engine) Stop(ctx context.Context, id string) error {
	if err := e.enter(ctx, Stop, id); err != nil {
		return err
	}
	if !idRE.MatchString(id) {
		return fmt.Errorf("fake: invalid instance id %q", id)
	}
	if err := e.remove(id); err != nil {
		return fmt.Errorf("fake: stop %s: %w", id, err)
	}
	return nil
}

// Dial implements engine.Engine: engine.AgentPort reaches the instance's
// agent, another port a listener opened with Listen.
func (e *Engine) Dial(ctx context.Context, id string, port int) (net.Conn, error) {
	if err := e.enter(ctx, Dial, id); err != nil {
		return nil, err
	}
	e.mu.Lock()
	inst := e.insts[id]
	var l *pipeListener
	if inst != nil && inst.running {
		l = inst.agent
		if port != engine.AgentPort {
			l = inst.ports[port]
		}
	}
	running := inst != nil && inst.running
	var unpaused, exited chan struct{}
	if running {
		unpaused, exited = inst.unpaused, inst.exited
	}
	e.mu.Unlock()
	if !running {
		return nil, fmt.Errorf("fake: dial %s:%d: %w", id, port, engine.ErrNotRunning)
	}
	// A paused instance's connections hang until it is unpaused, as a paused
	// gVisor sandbox's do.
	select {
	case <-unpaused:
	case <-exited:
		return nil, fmt.Errorf("fake: dial %s:%d: %w", id, port, engine.ErrNotRunning)
	case <-ctx.Done():
		return nil, fmt.Errorf("fake: dial %s:%d (paused): %w", id, port, ctx.Err())
	}
	if l == nil {
		return nil, fmt.Errorf("fake: dial %s:%d: connection refused", id, port)
	}
	c, err := l.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("fake: dial %s:%d: %w", id, port, err)
	}
	return c, nil
}

// Listen opens port in running instance id (a user's server in the sandbox):
// Dial(id, port) connects to it until the instance stops. Errors: no such
// running instance, the agent's port, a port already open.
func (e *Engine) Listen(id string, port int) (net.Listener, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	inst := e.insts[id]
	switch {
	case inst == nil || !inst.running:
		return nil, fmt.Errorf("fake: listen %s:%d: %w", id, port, engine.ErrNotRunning)
	case port == engine.AgentPort || inst.ports[port] != nil:
		return nil, fmt.Errorf("fake: listen %s:%d: port in use", id, port)
	}
	l := newPipeListener()
	inst.ports[port] = l
	return l, nil
}

// List implements engine.Engine.
func (e *Engine) List(ctx context.Context) ([]engine.Info, error) {
	if err := e.enter(ctx, List, ""); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]engine.Info, 0, len(e.insts))
	for _, i := range e.insts {
		out = append(out, engine.Info{ID: i.id, Running: i.running, Paused: i.running && isOpen(i.unpaused)})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].ID < out[b].ID })
	return out, nil
}

// Pause implements engine.Pauser: the instance's new connections (Dial) wait
// until Unpause; connections already open and background commands go on (they
// run on the host).
func (e *Engine) Pause(ctx context.Context, id string) error {
	if err := e.enter(ctx, Pause, id); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	inst := e.insts[id]
	if inst == nil || !inst.running {
		return fmt.Errorf("fake: pause %s: %w", id, engine.ErrNotRunning)
	}
	if !isOpen(inst.unpaused) {
		inst.unpaused = make(chan struct{})
	}
	return nil
}

// Unpause implements engine.Pauser.
func (e *Engine) Unpause(ctx context.Context, id string) error {
	if err := e.enter(ctx, Unpause, id); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	inst := e.insts[id]
	if inst == nil {
		return fmt.Errorf("fake: unpause %s: %w", id, engine.ErrNotRunning)
	}
	if isOpen(inst.unpaused) {
		close(inst.unpaused)
	}
	return nil
}

// Paused reports whether instance id is paused.
func (e *Engine) Paused(id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	inst := e.insts[id]
	return inst != nil && inst.running && isOpen(inst.unpaused)
}

func isOpen(c chan struct{}) bool {
	select {
	case <-c:
		return false
	default:
		return true
	}
}

// Wait implements engine.Engine.
func (e *Engine) Wait(ctx context.Context, id string) (engine.ExitStatus, error) {
	if err := e.enter(ctx, Wait, id); err != nil {
		return engine.ExitStatus{}, err
	}
	inst := e.get(id)
	if inst == nil {
		return engine.ExitStatus{}, fmt.Errorf("fake: wait %s: %w", id, engine.ErrNotRunning)
	}
	select {
	case <-inst.exited:
		e.mu.Lock()
		defer e.mu.Unlock()
		return engine.ExitStatus{What: inst.what}, nil
	case <-ctx.Done():
		return engine.ExitStatus{}, ctx.Err()
	}
}

// copyTree copies the directories, regular files and symbolic links of
// directory src into dst (created); other files (the agent's events socket)
// are skipped.
func copyTree(dst, src string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		to := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.MkdirAll(to, info.Mode().Perm()|0o700)
		case info.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(target, to)
		case info.Mode().IsRegular():
			return copyFile(to, p, info.Mode().Perm())
		}
		return nil
	})
}

func copyFile(dst, src string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
