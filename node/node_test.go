package node

import (
	"context"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
)

var ctx = context.Background()

func TestStateOf(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		age      time.Duration
		draining bool
		want     State
	}{
		{0, false, StateActive},
		{LeaseTime, false, StateActive},
		{LeaseTime, true, StateDraining},
		{LeaseTime + time.Millisecond, false, StateLost},
		{LeaseTime + time.Millisecond, true, StateLost},
		{-time.Second, false, StateActive}, // a clock a little ahead
	} {
		n := metadata.Node{HeartbeatAt: now.Add(-c.age), Draining: c.draining}
		if got := StateOf(n, now); got != c.want {
			t.Errorf("heartbeat %v ago, draining %v: %s, want %s", c.age, c.draining, got, c.want)
		}
	}
}

func TestCheckName(t *testing.T) {
	for _, ok := range []string{"a", "node-1", "host.example", "n_2", DefaultName()} {
		if err := CheckName(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-a", ".a", "a b", "a/b", "é", string(make([]byte, 64))} {
		if err := CheckName(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestHostCapacity(t *testing.T) {
	c, err := HostCapacity()
	if err != nil {
		t.Fatal(err)
	}
	if c.MemoryMiB < 64 || c.CPUs < 1 || c.Sandboxes != int(c.MemoryMiB/SandboxMiB) {
		t.Errorf("capacity %+v", c)
	}
}

// TestHeartbeat: Start registers the node with its capacity and load; each
// interval writes the load of the moment and a later heartbeat; a record
// removed meanwhile is made again; after Stop nothing is written and the
// node turns lost once LeaseTime has passed; a start with the same name
// keeps the operator's Draining.
func TestHeartbeat(t *testing.T) {
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var sandboxes atomic.Int64
	cfg := Config{Name: "node-a", Advertise: "http://127.0.0.1:7070",
		Capacity: metadata.NodeResources{MemoryMiB: 4096, CPUs: 4, Sandboxes: 8},
		Load: func(context.Context) (metadata.NodeResources, error) {
			n := sandboxes.Load()
			return metadata.NodeResources{MemoryMiB: 256 * n, CPUs: float64(n), Sandboxes: int(n)}, nil
		},
		Interval: 20 * time.Millisecond}
	t0 := time.Now()
	h, err := Start(ctx, db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	n, err := db.GetNode(ctx, "node-a")
	if err != nil || n.Advertise != cfg.Advertise || n.Capacity != cfg.Capacity || n.Load.Sandboxes != 0 || n.StartedAt.Before(t0) {
		t.Fatalf("registered: %+v %v", n, err)
	}
	first := n.HeartbeatAt
	sandboxes.Store(3)
	waitFor(t, func() bool { n, _ = db.GetNode(ctx, "node-a"); return n.Load.Sandboxes == 3 })
	if !n.HeartbeatAt.After(first) || n.Load.MemoryMiB != 768 || StateOf(n, time.Now()) != StateActive {
		t.Errorf("after heartbeats: %+v", n)
	}
	if err := db.DeleteNode(ctx, "node-a"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { _, err := db.GetNode(ctx, "node-a"); return err == nil })
	if n, _ := db.GetNode(ctx, "node-a"); !n.StartedAt.Equal(first) {
		t.Errorf("registered again with started_at %v, want the start's %v", n.StartedAt, first)
	}
	h.Stop()
	stopped, _ := db.GetNode(ctx, "node-a")
	time.Sleep(5 * cfg.Interval)
	if n, _ := db.GetNode(ctx, "node-a"); !n.HeartbeatAt.Equal(stopped.HeartbeatAt) {
		t.Errorf("a heartbeat after Stop: %v, then %v", stopped.HeartbeatAt, n.HeartbeatAt)
	}
	if s := StateOf(stopped, stopped.HeartbeatAt.Add(LeaseTime+time.Second)); s != StateLost {
		t.Errorf("stopped node after the lease: %s", s)
	}
	if err := db.SetNodeDraining(ctx, "node-a", true); err != nil {
		t.Fatal(err)
	}
	h, err = Start(ctx, db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
	if n, _ := db.GetNode(ctx, "node-a"); StateOf(n, time.Now()) != StateDraining {
		t.Errorf("restarted drained node: %+v is %s", n, StateOf(n, time.Now()))
	}
	if _, err := Start(ctx, db, Config{Name: "bad name", Load: cfg.Load}); err == nil {
		t.Errorf("a bad name started")
	}
	failing := cfg
	failing.Name = "node-b"
	failing.Load = func(context.Context) (metadata.NodeResources, error) {
		return metadata.NodeResources{}, errors.New("no load")
	}
	if _, err := Start(ctx, db, failing); err == nil {
		t.Errorf("a node whose load fails started")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// cutNodes is a metadata.Nodes whose heartbeats fail while cut is set (a
// node that lost the database).
type cutNodes struct {
	metadata.Nodes
	cut atomic.Bool
}

func (c *cutNodes) HeartbeatNode(ctx context.Context, name string, load metadata.NodeResources, at time.Time) error {
	if c.cut.Load() {
		return errors.New("connection refused")
	}
	return c.Nodes.HeartbeatNode(ctx, name, load, at)
}

// TestRenewed: Renewed is the heartbeat time the record holds after each
// heartbeat written, stays while heartbeats fail and moves again when they
// are written; MustFence holds once it is older than SelfFenceAfter, which
// is SelfFenceMargin before the others may declare the node lost.
func TestRenewed(t *testing.T) {
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	nodes := &cutNodes{Nodes: db}
	h, err := Start(ctx, nodes, Config{Name: "node-a", Advertise: "http://127.0.0.1:7070", Interval: 20 * time.Millisecond,
		Load: func(context.Context) (metadata.NodeResources, error) { return metadata.NodeResources{}, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
	first := h.Renewed()
	waitFor(t, func() bool { return h.Renewed().After(first) })
	nodes.cut.Store(true)
	time.Sleep(40 * time.Millisecond) // a heartbeat in flight lands
	held := h.Renewed()
	time.Sleep(100 * time.Millisecond) // five failed heartbeats
	if got := h.Renewed(); !got.Equal(held) {
		t.Errorf("Renewed moved while heartbeats failed: %v, then %v", held, got)
	}
	if n, _ := db.GetNode(ctx, "node-a"); !n.HeartbeatAt.Equal(held) {
		t.Errorf("Renewed %v; the record's heartbeat %v", held, n.HeartbeatAt)
	}
	nodes.cut.Store(false)
	waitFor(t, func() bool { return h.Renewed().After(held) })

	if SelfFenceAfter+SelfFenceMargin != LeaseTime || SelfFenceMargin < HeartbeatInterval || SelfFenceAfter <= 2*HeartbeatInterval {
		t.Errorf("self-fence after %v, margin %v, lease %v, heartbeat %v: want the margin at least a heartbeat and one failed heartbeat tolerated",
			SelfFenceAfter, SelfFenceMargin, LeaseTime, HeartbeatInterval)
	}
	now := time.Now()
	if MustFence(now.Add(-SelfFenceAfter), now) || !MustFence(now.Add(-SelfFenceAfter-time.Millisecond), now) {
		t.Errorf("MustFence at the self-fence time's edge")
	}
	n := metadata.Node{HeartbeatAt: now.Add(-SelfFenceAfter - time.Millisecond)}
	if StateOf(n, now) == StateLost {
		t.Errorf("a node that must fence itself is already lost to the others")
	}
}
