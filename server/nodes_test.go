package server_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/server"
)

// TestNodes: a server registers itself as a node (SQLite, one host) under
// --node's name with the default advertised URL and the host's capacity;
// GET /v1/nodes shows it active and self, its load follows its sandboxes
// with the heartbeat, and other records' states: one whose heartbeat is
// older than the lease is lost, a drained one draining.
func TestNodes(t *testing.T) {
	_, url, dir, _ := startFake(t, server.Config{Listen: "127.0.0.1:7171", Auth: server.AuthNone, Node: "n1",
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	ctx := context.Background()
	c := client.New(url)
	ns, err := c.ListNodes(ctx)
	capacity, _ := node.HostCapacity()
	if err != nil || len(ns) != 1 {
		t.Fatalf("nodes: %+v %v", ns, err)
	}
	if n := ns[0]; n.Name != "n1" || !n.Self || n.State != "active" || n.Advertise != "http://127.0.0.1:7171" ||
		n.Capacity != apiv1.NodeResources(capacity) || n.Load.Sandboxes != 0 || time.Since(n.HeartbeatAt) > time.Minute {
		t.Errorf("the server's node: %+v, capacity want %+v", n, capacity)
	}

	if _, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "tiny", MemoryMiB: 256, CPUs: 0.5}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * node.HeartbeatInterval)
	for {
		ns, err = c.ListNodes(ctx)
		if err == nil && len(ns) == 1 && ns[0].Load == (apiv1.NodeResources{MemoryMiB: 256, CPUs: 0.5, Sandboxes: 1}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("load after a create: %+v %v", ns, err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Records of other nodes, written beside the server as another node's
	// server would.
	db, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	old := time.Now().Add(-node.LeaseTime - time.Second)
	if err := db.PutNode(ctx, metadata.Node{Name: "n0", Advertise: "http://10.0.0.1:7070", StartedAt: old, HeartbeatAt: old}); err != nil {
		t.Fatal(err)
	}
	if err := db.SetNodeDraining(ctx, "n1", true); err != nil {
		t.Fatal(err)
	}
	ns, err = c.ListNodes(ctx)
	if err != nil || len(ns) != 2 || ns[0].Name != "n0" || ns[0].State != "lost" || ns[0].Self || ns[1].State != "draining" {
		t.Errorf("nodes with a lost and a draining one: %+v %v", ns, err)
	}

	// node rm (DELETE /v1/nodes/{name}): refused for a draining node, for a
	// lost one that a record still names the owner of a sandbox, and for
	// one that holds a volume; then the lost node's record goes.
	wantConflict := func(name, says string) {
		t.Helper()
		if err := c.DeleteNode(ctx, name); !client.IsConflict(err) || !strings.Contains(err.Error(), says) {
			t.Errorf("DELETE node %s: %v, want 409 saying %q", name, err, says)
		}
	}
	wantConflict("n1", "n1 is draining")
	owned := &metadata.Sandbox{ID: "sbx-ofn0", State: sandbox.StateRunning, Owner: "n0", Image: "tiny", ImageDigest: "sha256:aa",
		GuestDigest: "g1", MemoryMiB: 256, CPUs: 1, Generation: 1, Seq: 1, Instance: "sbx-ofn0-00000001",
		CreatedAt: old, StateChangedAt: old}
	if err := db.CreateSandbox(ctx, owned); err != nil {
		t.Fatal(err)
	}
	wantConflict("n0", "still owns 1 sandboxes (sbx-ofn0)")
	if err := db.DeleteSandbox(ctx, owned.ID); err != nil {
		t.Fatal(err)
	}
	if err := db.CreateVolume(ctx, metadata.Volume{Name: "v-n0", CreatedAt: old, Node: "n0"}); err != nil {
		t.Fatal(err)
	}
	wantConflict("n0", "holds volumes v-n0")
	if err := db.DeleteVolume(ctx, "v-n0"); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteNode(ctx, "n0"); err != nil {
		t.Fatalf("DELETE of the lost node n0: %v", err)
	}
	if err := c.DeleteNode(ctx, "n0"); !client.IsNotFound(err) {
		t.Errorf("DELETE of n0 again: %v, want 404", err)
	}
	if ns, err := c.ListNodes(ctx); err != nil || len(ns) != 1 || ns[0].Name != "n1" {
		t.Errorf("nodes after n0's removal: %+v %v", ns, err)
	}
}

// TestNodeCapacityFollowsOvercommit: the sandboxes a node's capacity counts
// are the default ones admission control admits at --memory-overcommit
// (node.AdmittedMiB), not the ones the memory holds: at 0.02 a host of a
// few GiB admits none, at 2 twice as many as at 1 (a trial's node ls said
// /47 where none fitted).
func TestNodeCapacityFollowsOvercommit(t *testing.T) {
	host, err := node.HostCapacity()
	if err != nil {
		t.Fatal(err)
	}
	for _, ratio := range []float64{0.02, 1, 2} {
		_, url, _, _ := startFake(t, server.Config{Auth: server.AuthNone, Node: "n1", Limits: manager.LimitsConfig{MemoryOvercommit: ratio},
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		ns, err := client.New(url).ListNodes(context.Background())
		if err != nil || len(ns) != 1 {
			t.Fatalf("nodes: %+v %v", ns, err)
		}
		want := int(node.AdmittedMiB(host.MemoryMiB, ratio) / node.SandboxMiB)
		if got := ns[0].Capacity; got.Sandboxes != want || got.MemoryMiB != host.MemoryMiB {
			t.Errorf("overcommit %g: capacity %+v, want %d sandboxes of %d MiB of %d MiB", ratio, got, want, node.SandboxMiB, host.MemoryMiB)
		}
	}
}
