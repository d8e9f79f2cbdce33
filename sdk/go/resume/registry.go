package resume

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"sort"
	"sync"
)

// Orders of the built-in hooks. User hooks registered with OnResume run after
// them when their order is >= 0 (the usual case), in ascending order, and in
// registration order among equal orders.
const (
	OrderReseed      = -400 // reseed registered random sources (always first)
	OrderSecrets     = -300 // in a clone: wipe fork-unsafe secrets
	OrderJournals    = -200 // in a clone: move fork-unsafe pending intents aside
	OrderConnections = -100 // close pooled connections
)

// Hook is a resume hook. It gets the resume event; its error is logged and the
// remaining hooks still run.
type Hook func(ctx context.Context, ev Event) error

type hookEntry struct {
	order int
	seq   int
	name  string
	fn    Hook
}

// Registry holds resume hooks and the objects the built-in hooks act on. Most
// programs use the package-level functions, which act on Default.
type Registry struct {
	mu         sync.Mutex
	seq        int
	hooks      []hookEntry
	rands      []reseedFunc
	transports []*http.Transport
	pools      []namedFunc
	secrets    []namedFunc
	journals   map[*Journal]bool
}

type namedFunc struct {
	name string
	fn   func()
}

// Default is the registry Start uses unless Options.Registry says otherwise.
var Default = NewRegistry()

// NewRegistry returns a registry with the built-in hooks and http.DefaultTransport
// registered.
func NewRegistry() *Registry {
	r := &Registry{journals: map[*Journal]bool{}}
	r.OnResumeNamed(OrderReseed, "reseed", func(ctx context.Context, ev Event) error { return r.reseed() })
	r.OnResumeNamed(OrderSecrets, "fork-unsafe secrets", func(ctx context.Context, ev Event) error {
		if ev.Forked {
			r.wipeSecrets()
		}
		return nil
	})
	r.OnResumeNamed(OrderJournals, "intent journals", func(ctx context.Context, ev Event) error {
		if !ev.Forked {
			return nil
		}
		return r.forkJournals(ev.Generation)
	})
	r.OnResumeNamed(OrderConnections, "connections", func(ctx context.Context, ev Event) error {
		r.CloseConnections()
		return nil
	})
	if t, ok := http.DefaultTransport.(*http.Transport); ok {
		r.RegisterTransport(t)
	}
	return r
}

// OnResume registers fn to run on every resume (and in a clone, on its first
// resume) after the built-in steps, ordered by order.
func OnResume(order int, fn Hook) { Default.OnResume(order, fn) }

// OnResume registers a hook on r; see the package-level OnResume.
func (r *Registry) OnResume(order int, fn Hook) { r.OnResumeNamed(order, "", fn) }

// OnResumeNamed is OnResume with a name that error messages use.
func (r *Registry) OnResumeNamed(order int, name string, fn Hook) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	r.hooks = append(r.hooks, hookEntry{order: order, seq: r.seq, name: name, fn: fn})
	sort.SliceStable(r.hooks, func(i, j int) bool {
		if r.hooks[i].order != r.hooks[j].order {
			return r.hooks[i].order < r.hooks[j].order
		}
		return r.hooks[i].seq < r.hooks[j].seq
	})
}

// Run runs all hooks for ev in order and returns their errors (a panicking hook
// is reported as an error). The runtime calls it; tests and programs that get
// resume events some other way may call it too.
func (r *Registry) Run(ctx context.Context, ev Event) []error {
	r.mu.Lock()
	hooks := append([]hookEntry(nil), r.hooks...)
	r.mu.Unlock()
	var errs []error
	for _, h := range hooks {
		if err := ctx.Err(); err != nil {
			errs = append(errs, fmt.Errorf("hook %s (order %d) not run: %w", h.label(), h.order, err))
			continue
		}
		if err := runHook(ctx, h, ev); err != nil {
			errs = append(errs, fmt.Errorf("hook %s (order %d): %w", h.label(), h.order, err))
		}
	}
	return errs
}

func (h hookEntry) label() string {
	if h.name != "" {
		return h.name
	}
	return fmt.Sprintf("#%d", h.seq)
}

func runHook(ctx context.Context, h hookEntry, ev Event) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return h.fn(ctx, ev)
}

// RegisterRand registers a math/rand/v2 source to be reseeded from crypto/rand
// on every resume, before any other hook runs: *rand.ChaCha8, *rand.PCG, or a
// func([32]byte) that reseeds a source of another kind. The caller must make
// sure the source is not used concurrently with the reseed (sources are not
// safe for concurrent use); NewRand returns a ready, locked one.
func RegisterRand(src any) error { return Default.RegisterRand(src) }

// RegisterRand registers a source on r; see the package-level RegisterRand.
func (r *Registry) RegisterRand(src any) error {
	var fn reseedFunc
	switch s := src.(type) {
	case *mrand.ChaCha8:
		fn = func(seed [32]byte) { s.Seed(seed) }
	case *mrand.PCG:
		fn = func(seed [32]byte) {
			s.Seed(binary.LittleEndian.Uint64(seed[:8]), binary.LittleEndian.Uint64(seed[8:16]))
		}
	case *LockedSource:
		fn = s.reseed
	case func([32]byte):
		fn = s
	default:
		return fmt.Errorf("resume: RegisterRand: unsupported source %T", src)
	}
	r.mu.Lock()
	r.rands = append(r.rands, fn)
	r.mu.Unlock()
	return nil
}

func (r *Registry) reseed() error {
	r.mu.Lock()
	rands := append([]reseedFunc(nil), r.rands...)
	r.mu.Unlock()
	for _, fn := range rands {
		var seed [32]byte
		if _, err := rand.Read(seed[:]); err != nil {
			return err
		}
		fn(seed)
	}
	return nil
}

// LockedSource is a ChaCha8 source safe for concurrent use and reseedable by
// the resume hooks.
type LockedSource struct {
	mu  sync.Mutex
	src *mrand.ChaCha8
}

// Uint64 implements rand.Source.
func (s *LockedSource) Uint64() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.src.Uint64()
}

func (s *LockedSource) reseed(seed [32]byte) {
	s.mu.Lock()
	s.src.Seed(seed)
	s.mu.Unlock()
}

// NewRand returns a *rand.Rand over a ChaCha8 source seeded from crypto/rand,
// safe for concurrent use and registered in the default registry, so it is
// reseeded on every resume: clones never share its stream.
//
// Note that the top-level functions of math/rand/v2 (rand.IntN, ...) use state
// inside the Go runtime that cannot be reseeded: in a clone they may repeat the
// parent's stream. Use NewRand or crypto/rand for anything that must be unique.
func NewRand() *mrand.Rand {
	var seed [32]byte
	if _, err := rand.Read(seed[:]); err != nil {
		panic(err)
	}
	s := &LockedSource{src: mrand.NewChaCha8(seed)}
	_ = Default.RegisterRand(s)
	return mrand.New(s)
}

// RegisterTransport registers an http.Transport whose idle connections are
// closed on every generation change (http.DefaultTransport is registered
// already). Connections that were idle across a hibernation are usually dead;
// they are dropped rather than probed.
func RegisterTransport(t *http.Transport) { Default.RegisterTransport(t) }

// RegisterTransport registers t on r.
func (r *Registry) RegisterTransport(t *http.Transport) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, x := range r.transports {
		if x == t {
			return
		}
	}
	r.transports = append(r.transports, t)
}

// RegisterPool registers a function that drops another kind of pooled
// connections (a database pool, a gRPC channel, a WebSocket) on every
// generation change.
func RegisterPool(name string, closeIdle func()) { Default.RegisterPool(name, closeIdle) }

// RegisterPool registers a pool on r.
func (r *Registry) RegisterPool(name string, closeIdle func()) {
	r.mu.Lock()
	r.pools = append(r.pools, namedFunc{name, closeIdle})
	r.mu.Unlock()
}

// CloseConnections closes the idle connections of every registered transport
// and pool now (the built-in hook calls it on every resume).
func (r *Registry) CloseConnections() {
	r.mu.Lock()
	ts := append([]*http.Transport(nil), r.transports...)
	ps := append([]namedFunc(nil), r.pools...)
	r.mu.Unlock()
	for _, t := range ts {
		t.CloseIdleConnections()
	}
	for _, p := range ps {
		p.fn()
	}
}

// RegisterSecret registers a fork-unsafe secret that is wiped in a clone (a
// resume event with forked=true): a *[]byte is zeroed and set to nil, a *string
// set to "", and a func() is called to do the wiping.
func RegisterSecret(name string, secret any) error { return Default.RegisterSecret(name, secret) }

// RegisterSecret registers a secret on r.
func (r *Registry) RegisterSecret(name string, secret any) error {
	var fn func()
	switch s := secret.(type) {
	case *[]byte:
		fn = func() {
			clear(*s)
			*s = nil
		}
	case *string:
		fn = func() { *s = "" }
	case func():
		fn = s
	default:
		return fmt.Errorf("resume: RegisterSecret %s: unsupported type %T (want *[]byte, *string or func())", name, secret)
	}
	r.mu.Lock()
	r.secrets = append(r.secrets, namedFunc{name, fn})
	r.mu.Unlock()
	return nil
}

func (r *Registry) wipeSecrets() {
	r.mu.Lock()
	ss := append([]namedFunc(nil), r.secrets...)
	r.mu.Unlock()
	for _, s := range ss {
		s.fn()
	}
}

func (r *Registry) addJournal(j *Journal) {
	r.mu.Lock()
	r.journals[j] = true
	r.mu.Unlock()
}

func (r *Registry) removeJournal(j *Journal) {
	r.mu.Lock()
	delete(r.journals, j)
	r.mu.Unlock()
}

func (r *Registry) forkJournals(gen int64) error {
	r.mu.Lock()
	js := make([]*Journal, 0, len(r.journals))
	for j := range r.journals {
		js = append(js, j)
	}
	r.mu.Unlock()
	var errs []error
	for _, j := range js {
		if _, err := j.MoveAsideForFork(gen); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

type reseedFunc = func([32]byte)
