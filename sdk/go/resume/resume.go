package resume

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// DefaultDir is where the guest agent keeps the resume contract's files and
// socket inside a sandbox.
const DefaultDir = "/run/torpor"

// Names inside the directory (the protocol; see the package doc).
const (
	GenerationFile  = "generation"
	ResumeFile      = "resume.json"
	ClockOffsetFile = "clock_offset_ns"
	EventsSocket    = "events"
)

// dir is the directory the package-level helpers read (tests point it elsewhere).
var (
	dirMu sync.RWMutex
	dir   = DefaultDir
)

func contractDir() string {
	dirMu.RLock()
	defer dirMu.RUnlock()
	return dir
}

// SetDir points the package-level helpers (Generation, Now, ...) at another
// directory than /run/torpor. It is meant for tests.
func SetDir(d string) {
	dirMu.Lock()
	dir = d
	dirMu.Unlock()
}

// Event is one message of the agent's event stream.
type Event struct {
	// Event is "hello", "resume", "start" (a fresh start: no hooks run) or
	// "subscribed".
	Event string `json:"event"`
	// Kind tells a resume event's cause: "restored" (from a snapshot: a
	// resume or a fork) or "unpaused" (continued from the paused tier: the
	// same generation, the clocks jumped); "" from an agent that predates it.
	// Hooks run, and registered connections are dropped, for both.
	Kind       string `json:"kind,omitempty"`
	Generation int64  `json:"generation"`
	// Forked is true in a clone: the first resume of a sandbox made by a fork.
	Forked bool `json:"forked,omitempty"`
	// HostTime is the host's wall clock when the event was sent.
	HostTime   time.Time `json:"-"`
	SnapshotID string    `json:"snapshot_id,omitempty"`
	// Seq numbers resume events; a subscriber acknowledges each with {"ack":Seq}.
	Seq int64 `json:"seq,omitempty"`
}

type wireEvent struct {
	Event      string `json:"event"`
	Kind       string `json:"kind"`
	Generation int64  `json:"generation"`
	Forked     bool   `json:"forked"`
	HostTime   string `json:"host_time"`
	SnapshotID string `json:"snapshot_id"`
	Seq        int64  `json:"seq"`
}

// ParseEvent decodes one line of the event stream.
func ParseEvent(line []byte) (Event, error) {
	var w wireEvent
	if err := json.Unmarshal(line, &w); err != nil {
		return Event{}, fmt.Errorf("resume: bad event %q: %w", strings.TrimSpace(string(line)), err)
	}
	ev := Event{Event: w.Event, Kind: w.Kind, Generation: w.Generation, Forked: w.Forked, SnapshotID: w.SnapshotID, Seq: w.Seq}
	if w.HostTime != "" {
		t, err := time.Parse(time.RFC3339Nano, w.HostTime)
		if err != nil {
			return Event{}, fmt.Errorf("resume: bad host_time %q: %w", w.HostTime, err)
		}
		ev.HostTime = t
	}
	return ev, nil
}

// Generation returns the sandbox's current generation, which changes on every
// resume and fork. Outside a torpor sandbox (no /run/torpor/generation) it
// returns 0 and no error.
func Generation() (int64, error) {
	return readGeneration(contractDir())
}

func readGeneration(d string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(d, GenerationFile))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	g, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("resume: bad generation file: %w", err)
	}
	return g, nil
}

// LastResume returns the last resume event the agent recorded
// (/run/torpor/resume.json); ok is false when there was none.
func LastResume() (ev Event, ok bool, err error) {
	b, err := os.ReadFile(filepath.Join(contractDir(), ResumeFile))
	if errors.Is(err, fs.ErrNotExist) {
		return Event{}, false, nil
	}
	if err != nil {
		return Event{}, false, err
	}
	ev, err = ParseEvent(b)
	return ev, err == nil, err
}

// Options configure Start.
type Options struct {
	// Name identifies this process in the resume report (free text).
	Name string
	// Dir is the contract directory; "" means /run/torpor.
	Dir string
	// HookTimeout bounds all hooks of one event together; 0 means 10 s.
	HookTimeout time.Duration
	// NoSubscribe only watches: the server does not wait for this process.
	NoSubscribe bool
	// Registry holds the hooks to run; nil means the package's default registry
	// (OnResume, RegisterRand, ... register there).
	Registry *Registry
	// Logger receives hook failures and connection problems; nil = slog.Default().
	Logger *slog.Logger
}

// Runtime is a connection to the guest agent's event stream that runs the
// registry's hooks on every resume and acknowledges each event afterwards.
type Runtime struct {
	opts Options
	reg  *Registry
	log  *slog.Logger

	mu         sync.Mutex
	connected  bool
	subscribed bool
	generation int64
	last       Event
	handled    chan struct{} // closed and replaced after each handled resume event
	watchers   []chan Event
	cancel     context.CancelFunc
	done       chan struct{}
}

// Start connects to the agent's event socket, subscribes (the server then waits
// for this process's hooks before forwarding requests after a resume) and runs
// the hooks of opts.Registry on every resume event until ctx ends or Close is
// called. Outside a torpor sandbox (no event socket) it returns an idle Runtime
// and no error: hooks never fire and Generation stays 0. When the connection
// breaks it is re-established.
func Start(ctx context.Context, opts Options) (*Runtime, error) {
	if opts.Dir == "" {
		opts.Dir = DefaultDir
	}
	if opts.HookTimeout == 0 {
		opts.HookTimeout = 10 * time.Second
	}
	if opts.Registry == nil {
		opts.Registry = Default
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Name == "" {
		opts.Name = filepath.Base(os.Args[0])
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &Runtime{opts: opts, reg: opts.Registry, log: opts.Logger, handled: make(chan struct{}), cancel: cancel, done: make(chan struct{})}
	r.generation, _ = readGeneration(opts.Dir)
	sock := filepath.Join(opts.Dir, EventsSocket)
	if _, err := os.Stat(sock); err != nil {
		// Not in a torpor sandbox (or an agent without the contract): stay idle.
		cancel()
		close(r.done)
		return r, nil
	}
	conn, err := r.connect(ctx, sock)
	if err != nil {
		cancel()
		close(r.done)
		return r, fmt.Errorf("resume: connect %s: %w", sock, err)
	}
	go r.loop(ctx, sock, conn)
	return r, nil
}

// Close stops the runtime and waits for its goroutine.
func (r *Runtime) Close() error {
	r.cancel()
	<-r.done
	return nil
}

// Connected reports whether the runtime is connected to the agent now.
func (r *Runtime) Connected() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.connected
}

// Subscribed reports whether the agent confirmed the subscription: from then
// on the server waits for this process's hooks after every resume.
func (r *Runtime) Subscribed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.subscribed
}

// Generation returns the last generation the runtime saw (hello or resume).
func (r *Runtime) Generation() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.generation
}

// LastEvent returns the last resume event whose hooks ran.
func (r *Runtime) LastEvent() Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// Watch returns a channel that receives every resume event after its hooks ran
// (just before it is acknowledged). The channel has a small buffer; a slow reader misses
// events rather than delaying resumes. It is closed when ctx ends.
func (r *Runtime) Watch(ctx context.Context) <-chan Event {
	ch := make(chan Event, 8)
	r.mu.Lock()
	r.watchers = append(r.watchers, ch)
	r.mu.Unlock()
	go func() {
		select {
		case <-ctx.Done():
		case <-r.done:
		}
		r.mu.Lock()
		for i, w := range r.watchers {
			if w == ch {
				r.watchers = append(r.watchers[:i], r.watchers[i+1:]...)
				break
			}
		}
		r.mu.Unlock()
		close(ch)
	}()
	return ch
}

// WaitGeneration waits until a resume event with a generation greater than
// after has been handled, and returns it.
func (r *Runtime) WaitGeneration(ctx context.Context, after int64) (Event, error) {
	for {
		r.mu.Lock()
		last, ch := r.last, r.handled
		r.mu.Unlock()
		if last.Event == "resume" && last.Generation > after {
			return last, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return Event{}, ctx.Err()
		case <-r.done:
			return Event{}, errors.New("resume: runtime closed")
		}
	}
}

func (r *Runtime) connect(ctx context.Context, sock string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, err
	}
	if !r.opts.NoSubscribe {
		msg, _ := json.Marshal(map[string]any{"subscribe": true, "name": r.opts.Name})
		if _, err := c.Write(append(msg, '\n')); err != nil {
			c.Close()
			return nil, err
		}
	}
	r.mu.Lock()
	r.connected = true
	r.mu.Unlock()
	return c, nil
}

func (r *Runtime) loop(ctx context.Context, sock string, conn net.Conn) {
	defer close(r.done)
	backoff := 100 * time.Millisecond
	for {
		stop := context.AfterFunc(ctx, func() { conn.Close() })
		err := r.serve(ctx, conn)
		stop()
		conn.Close()
		r.mu.Lock()
		r.connected, r.subscribed = false, false
		r.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("torpor resume: event stream ended; reconnecting", "err", err)
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			if backoff < 5*time.Second {
				backoff *= 2
			}
			c, err := r.connect(ctx, sock)
			if err == nil {
				conn, backoff = c, 100*time.Millisecond
				break
			}
		}
	}
}

func (r *Runtime) serve(ctx context.Context, conn net.Conn) error {
	br := bufio.NewReader(conn)
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			return err
		}
		if len(strings.TrimSpace(string(line))) == 0 {
			continue
		}
		ev, err := ParseEvent(line)
		if err != nil {
			r.log.Warn("torpor resume: ignoring bad event", "err", err)
			continue
		}
		switch ev.Event {
		case "hello":
			r.mu.Lock()
			r.generation = ev.Generation
			r.mu.Unlock()
		case "subscribed":
			r.mu.Lock()
			r.subscribed = true
			r.mu.Unlock()
		case "start":
			// A fresh start (or a restart after a filesystem-mode hibernation):
			// nothing in this process predates it, so no hooks; just acknowledge.
			r.mu.Lock()
			r.generation = ev.Generation
			r.mu.Unlock()
			if !r.opts.NoSubscribe && ev.Seq > 0 {
				msg, _ := json.Marshal(map[string]int64{"ack": ev.Seq})
				if _, err := conn.Write(append(msg, '\n')); err != nil {
					return err
				}
			}
		case "resume":
			r.mu.Lock()
			r.generation = ev.Generation
			r.mu.Unlock()
			hctx, cancel := context.WithTimeout(ctx, r.opts.HookTimeout)
			for _, herr := range r.reg.Run(hctx, ev) {
				r.log.Warn("torpor resume: hook failed", "generation", ev.Generation, "err", herr)
			}
			cancel()
			r.mu.Lock()
			r.last = ev
			close(r.handled)
			r.handled = make(chan struct{})
			for _, w := range r.watchers {
				select {
				case w <- ev:
				default:
				}
			}
			r.mu.Unlock()
			if !r.opts.NoSubscribe {
				msg, _ := json.Marshal(map[string]int64{"ack": ev.Seq})
				if _, err := conn.Write(append(msg, '\n')); err != nil {
					return err
				}
			}
		}
	}
}
