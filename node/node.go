// Package node makes a torpor server a node: it registers the host in the
// metadata store (metadata.Nodes) under a name, with the URL it advertises
// and its capacity, and then heartbeats its load every HeartbeatInterval. A
// node's state follows from its record: lost when its last heartbeat is
// older than LeaseTime, else draining when an operator drained it, else
// active.
//
// Times are the nodes' own clocks (keep them in sync, e.g. with NTP): a
// reader tells a lost node by comparing its heartbeat with its own clock.
package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/metadata"
)

// State is a node's state.
type State string

const (
	StateActive   State = "active"
	StateDraining State = "draining"
	StateLost     State = "lost"
)

const (
	// HeartbeatInterval is how often a node writes its heartbeat.
	HeartbeatInterval = 5 * time.Second
	// LeaseTime is how long after its last heartbeat a node counts as lost
	// (four missed heartbeats).
	LeaseTime = 4 * HeartbeatInterval
	// SelfFenceMargin is how long before the others may declare a node
	// lost that a node which could not renew its lease fences itself: after
	// SelfFenceAfter without a heartbeat written it stops serving its
	// sandboxes and stops their instances. The margin covers the fence
	// check's period (a second), stopping the instances (a kill each) and
	// the hosts' clock skew (others judge the heartbeat by their clocks);
	// it leaves one failed heartbeat (the next one, 5 s later) unfenced.
	SelfFenceMargin = 3 * HeartbeatInterval / 2
	SelfFenceAfter  = LeaseTime - SelfFenceMargin
	// SandboxMiB is the memory of a default sandbox, by which the host's
	// memory is divided for its capacity in sandboxes.
	SandboxMiB = 512
)

// StateOf is n's state at now: lost when its heartbeat is older than
// LeaseTime, else draining or active.
func StateOf(n metadata.Node, now time.Time) State {
	switch {
	case now.Sub(n.HeartbeatAt) > LeaseTime:
		return StateLost
	case n.Draining:
		return StateDraining
	}
	return StateActive
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// CheckName says whether name can name a node: 1 to 63 letters, digits,
// '.', '_' or '-', starting with a letter or digit (a host name fits).
func CheckName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("node name %q: want 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	return nil
}

// DefaultName is the host's name (os.Hostname, up to its first dot), the
// name a node has unless it is given one.
func DefaultName() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "localhost"
	}
	h, _, _ = strings.Cut(h, ".")
	return h
}

// HostCapacity is this host's capacity: its memory (MemTotal of
// /proc/meminfo, MiB), its CPUs (runtime.NumCPU) and how many default
// sandboxes (SandboxMiB) the memory holds. Errors: /proc/meminfo unreadable.
func HostCapacity() (metadata.NodeResources, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return metadata.NodeResources{}, err
	}
	defer f.Close()
	var kib int64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kib, _ = strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		}
	}
	if kib <= 0 {
		return metadata.NodeResources{}, fmt.Errorf("/proc/meminfo: no MemTotal")
	}
	mib := kib / 1024
	return metadata.NodeResources{MemoryMiB: mib, CPUs: float64(runtime.NumCPU()), Sandboxes: int(mib / SandboxMiB)}, nil
}

// AdmittedMiB is the memory a host of memoryMiB MiB admits for sandboxes at
// the overcommit ratio overcommit (a ratio of 0 or less counts as 1):
// floor(memoryMiB × overcommit), in MiB.
func AdmittedMiB(memoryMiB int64, overcommit float64) int64 {
	if overcommit <= 0 {
		overcommit = 1
	}
	return int64(math.Floor(float64(memoryMiB) * overcommit))
}

// HasRoom is admission control's rule, the one a host's manager applies to
// each create, resume and fork and placement applies to each node's record:
// a host of memoryMiB MiB at ratio overcommit whose sandboxes have
// committedMiB MiB of memory limits has room for needMiB more iff
// committedMiB + needMiB ≤ AdmittedMiB(memoryMiB, overcommit). All in MiB.
func HasRoom(committedMiB, needMiB, memoryMiB int64, overcommit float64) bool {
	return committedMiB+needMiB <= AdmittedMiB(memoryMiB, overcommit)
}

// Config configures a node's registration.
type Config struct {
	// Name is the node's name (CheckName); Advertise the base URL of its API.
	Name      string
	Advertise string
	// Capacity is what the node registers (HostCapacity for a server), and
	// MemoryOvercommit the ratio its admission control admits of the
	// capacity's memory (HasRoom; 0 or less: 1).
	Capacity         metadata.NodeResources
	MemoryOvercommit float64
	// Load returns the node's load now; a failure is logged and the last
	// load is written again.
	Load func(ctx context.Context) (metadata.NodeResources, error)
	// Renewed, if set, is called with the heartbeat time of each heartbeat
	// written (the registration's included), after the write, on the
	// heartbeat's goroutine (the server records it for its watchdog).
	Renewed func(at time.Time)
	// Interval is the heartbeat period (default HeartbeatInterval).
	Interval time.Duration
	Logger   *slog.Logger
}

// Heartbeat is a registered node's heartbeat loop.
type Heartbeat struct {
	nodes metadata.Nodes
	cfg   Config
	load  metadata.NodeResources
	start time.Time
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
	// renewed is the heartbeat time (Unix ns) of the last heartbeat written.
	renewed atomic.Int64
}

// Start registers the node (its record made or replaced, Draining kept, the
// load and heartbeat as of now) and heartbeats until Stop. Errors: the name
// is invalid, the load or the record cannot be written. A heartbeat that
// fails later is logged and tried again at the next interval.
func Start(ctx context.Context, nodes metadata.Nodes, cfg Config) (*Heartbeat, error) {
	if err := CheckName(cfg.Name); err != nil {
		return nil, err
	}
	if cfg.Interval <= 0 {
		cfg.Interval = HeartbeatInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MemoryOvercommit <= 0 {
		cfg.MemoryOvercommit = 1
	}
	h := &Heartbeat{nodes: nodes, cfg: cfg, stop: make(chan struct{}), done: make(chan struct{})}
	load, err := cfg.Load(ctx)
	if err != nil {
		return nil, fmt.Errorf("node %s: load: %w", cfg.Name, err)
	}
	h.load, h.start = load, time.Now()
	if err := h.register(ctx, h.start); err != nil {
		return nil, err
	}
	go h.run()
	return h, nil
}

// register writes the node's whole record, heartbeat at now.
func (h *Heartbeat) register(ctx context.Context, now time.Time) error {
	err := h.nodes.PutNode(ctx, metadata.Node{Name: h.cfg.Name, Advertise: h.cfg.Advertise, Capacity: h.cfg.Capacity,
		MemoryOvercommit: h.cfg.MemoryOvercommit, Load: h.load, StartedAt: h.start, HeartbeatAt: now})
	if err != nil {
		return fmt.Errorf("node %s: register: %w", h.cfg.Name, err)
	}
	h.renew(now)
	return nil
}

func (h *Heartbeat) run() {
	defer close(h.done)
	tick := time.NewTicker(h.cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-tick.C:
			h.beat()
		}
	}
}

// beat writes one heartbeat, bounded by the interval; a node whose record
// is gone registers again.
func (h *Heartbeat) beat() {
	ctx, cancel := context.WithTimeout(context.Background(), h.cfg.Interval)
	defer cancel()
	if load, err := h.cfg.Load(ctx); err != nil {
		h.cfg.Logger.Warn("node heartbeat: load", "node", h.cfg.Name, "err", err)
	} else {
		h.load = load
	}
	now := time.Now()
	err := h.nodes.HeartbeatNode(ctx, h.cfg.Name, h.load, now)
	if errors.Is(err, metadata.ErrNotFound) {
		err = h.register(ctx, now) // its record was removed: the node is still here
	}
	if err != nil {
		h.cfg.Logger.Warn("node heartbeat", "node", h.cfg.Name, "err", err)
		return
	}
	h.renew(now)
}

// renew records heartbeat now as written.
func (h *Heartbeat) renew(now time.Time) {
	h.renewed.Store(now.UnixNano())
	if h.cfg.Renewed != nil {
		h.cfg.Renewed(now)
	}
}

// Renewed is the heartbeat time of the last heartbeat the node wrote (its
// registration's at first): what the other nodes judge its lease by. A node
// whose Renewed is older than SelfFenceAfter fences itself (MustFence).
func (h *Heartbeat) Renewed() time.Time { return time.Unix(0, h.renewed.Load()) }

// MustFence says whether a node whose last heartbeat written is renewed
// must fence itself at now: it is older than SelfFenceAfter, and the other
// nodes may declare the node lost SelfFenceMargin later.
func MustFence(renewed, now time.Time) bool { return now.Sub(renewed) > SelfFenceAfter }

// Name is the node's name.
func (h *Heartbeat) Name() string { return h.cfg.Name }

// StartedAt is when the node registered (its record's StartedAt): with the
// name it tells this server process from the node's earlier and later ones.
func (h *Heartbeat) StartedAt() time.Time { return h.start }

// Stop ends the heartbeats and waits for the loop. The record stays: the
// node counts as lost once LeaseTime has passed, and as itself again when it
// starts with the same name.
func (h *Heartbeat) Stop() {
	h.once.Do(func() { close(h.stop) })
	<-h.done
}
