package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/watchdog"
)

// startNode registers the server as node cfg.Node (default node.DefaultName)
// advertising cfg.Advertise (default advertiseURL(cfg.Listen)) with the
// host's capacity, its memory as mgr's admission control counts it and the
// overcommit ratio mgr admits at, and heartbeats the load of the sandboxes
// in db, with the memory mgr has committed (Manager.CommittedMiB): placement
// judges a node's room by admission control's rule (node.HasRoom).
// renewed, if set, is called with each heartbeat written (node.Config.Renewed).
func startNode(ctx context.Context, db metadata.Store, mgr *manager.Manager, cfg Config, renewed func(time.Time)) (*node.Heartbeat, error) {
	name, adv := cfg.Node, nodeAdvertise(cfg)
	capacity, err := node.HostCapacity()
	if err != nil {
		return nil, err
	}
	// The capacity in sandboxes is how many default ones admission control
	// admits (the memory at the overcommit ratio), not how many the memory
	// holds.
	lim := mgr.Limits()
	capacity.MemoryMiB = lim.HostMemoryBytes >> 20
	capacity.Sandboxes = int(node.AdmittedMiB(capacity.MemoryMiB, lim.MemoryOvercommit) / node.SandboxMiB)
	return node.Start(ctx, db, node.Config{Name: name, Advertise: adv, Capacity: capacity, MemoryOvercommit: lim.MemoryOvercommit,
		Logger: cfg.Logger, Renewed: renewed,
		Load: func(ctx context.Context) (metadata.NodeResources, error) {
			load, err := sandboxLoad(ctx, db, name)
			if err != nil {
				return load, err
			}
			load.MemoryMiB, err = mgr.CommittedMiB(ctx)
			return load, err
		}})
}

// nodeAdvertise is the URL the node of cfg advertises: cfg.Advertise, else
// advertiseURL's default.
func nodeAdvertise(cfg Config) string {
	if cfg.Advertise != "" {
		return cfg.Advertise
	}
	return advertiseURL(cfg.Listen, cfg.TLSCert != "")
}

// advertiseURL is the URL a server on listen advertises by default:
// http://<listen> (https:// when it serves TLS), with the host's name for an
// address on all interfaces (":7070", "0.0.0.0:7070", "[::]:7070").
func advertiseURL(listen string, tls bool) string {
	scheme := "http://"
	if tls {
		scheme = "https://"
	}
	if listen == "" {
		listen = "127.0.0.1:7070"
	}
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return scheme + listen
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		if h, err := os.Hostname(); err == nil && h != "" {
			host = h
		}
	}
	return scheme + net.JoinHostPort(host, port)
}

// sandboxLoad is what the sandboxes of node recorded in db hold of the host:
// every sandbox the node owns that has an instance (not hibernated, not in
// error, not being deleted) counts with its memory and CPUs. It reads the
// records alone, without the manager (startNode heartbeats the manager's
// committed memory in place of this memory).
func sandboxLoad(ctx context.Context, db metadata.Sandboxes, node string) (metadata.NodeResources, error) {
	sbs, err := db.ListSandboxes(ctx)
	if err != nil {
		return metadata.NodeResources{}, err
	}
	var load metadata.NodeResources
	for _, sb := range sbs {
		if sb.State == sandbox.StateHibernated || sb.State == sandbox.StateError || sb.Deleting || (sb.Owner != "" && sb.Owner != node) {
			continue
		}
		load.MemoryMiB += int64(sb.MemoryMiB)
		load.CPUs += sb.CPUs
		load.Sandboxes++
	}
	return load, nil
}

func (s *Server) nodeRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/nodes", s.listNodes)
	mux.HandleFunc("POST /v1/nodes/{name}/drain", s.drainNode(true))
	mux.HandleFunc("POST /v1/nodes/{name}/undrain", s.drainNode(false))
	mux.HandleFunc("DELETE /v1/nodes/{name}", s.deleteNode)
}

// deleteNode removes node {name}'s record (torpor node rm): 204. Only a lost
// node's: an active or draining one is 409, as is one that still owns
// sandboxes (the other nodes fence a lost node's sandboxes within a
// heartbeat interval; until then its record names whom they are taken from)
// or holds volumes (in its data directory: the record is what names it).
// 404 for an unknown node.
func (s *Server) deleteNode(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	name := r.PathValue("name")
	n, err := s.db.GetNode(ctx, name)
	if errors.Is(err, metadata.ErrNotFound) {
		err = sandbox.Errorf(sandbox.NotFound, "node %s: not found", name)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if st := node.StateOf(n, time.Now()); st != node.StateLost {
		s.fail(w, r, sandbox.Errorf(sandbox.Conflict, "node %s is %s: only a lost node's record is removed (stop its server; it is lost %s after its last heartbeat)", name, st, node.LeaseTime))
		return
	}
	sbs, err := s.db.ListSandboxes(ctx)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	var owned []string
	for _, sb := range sbs {
		if sb.Owner == name {
			owned = append(owned, sb.ID)
		}
	}
	if len(owned) > 0 {
		s.fail(w, r, sandbox.Errorf(sandbox.Conflict, "node %s still owns %d sandboxes (%s): the other nodes fence them within %s of its loss; try again then",
			name, len(owned), strings.Join(owned, ", "), node.HeartbeatInterval))
		return
	}
	vols, err := s.db.ListVolumes(ctx)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	var held []string
	for _, v := range vols {
		if v.Node == name {
			held = append(held, v.Name)
		}
	}
	if len(held) > 0 {
		s.fail(w, r, sandbox.Errorf(sandbox.Conflict, "node %s holds volumes %s in its data directory: start its server and remove them (torpor volume rm) first",
			name, strings.Join(held, ", ")))
		return
	}
	if err := s.db.DeleteNode(ctx, name); err != nil && !errors.Is(err, metadata.ErrNotFound) {
		s.fail(w, r, err)
		return
	}
	s.log.Info("node removed", "node", name, "last_heartbeat", n.HeartbeatAt)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listNodes(w http.ResponseWriter, r *http.Request) {
	ns, err := s.db.ListNodes(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	now := time.Now()
	out := apiv1.ListNodesResponse{Nodes: []apiv1.Node{}}
	for _, n := range ns {
		out.Nodes = append(out.Nodes, s.wireNode(n, now))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) wireNode(n metadata.Node, now time.Time) apiv1.Node {
	return apiv1.Node{Name: n.Name, Advertise: n.Advertise, State: string(node.StateOf(n, now)),
		Capacity: apiv1.NodeResources(n.Capacity), Load: apiv1.NodeResources(n.Load), MemoryOvercommit: n.MemoryOvercommit,
		StartedAt: n.StartedAt, HeartbeatAt: n.HeartbeatAt, Self: n.Name == s.node}
}

// startWatchedNode registers a cluster node (cfg.Database PostgreSQL) before
// its server reconciles, watched (package watchdog; docs/multi-host.md#the-watchdog):
//
//   - with its own gVisor engine (cfg.Engines nil) the server first starts
//     its watchdog (cfg.Executable's serve-watchdog), which stops the
//     data directory's instances if the server dies and no new server
//     heartbeats by its last heartbeat + node.SelfFenceAfter; each heartbeat
//     written is sent to it and recorded in DATA_DIR/heartbeat;
//   - the registration (the node's first heartbeat) is written and recorded
//     under the handover lock (watchdog.LockHandover): an earlier server's
//     watchdog either sees it and leaves the instances to this server, or
//     has stopped them before this server lists them;
//   - a registration that completes after the node's previous heartbeat +
//     node.SelfFenceAfter (watchdog.LateRegistration) stops the sandboxes'
//     instances left on the host before Reconcile: the earlier watchdog's
//     time has come, and the other nodes may declare the node lost.
//
// Errors: the watchdog's start, the handover lock not taken within a minute,
// the database's, the registration's.
func startWatchedNode(ctx context.Context, db metadata.Store, mgr *manager.Manager, cfg Config, dir string) (*node.Heartbeat, *watchdog.Handle, error) {
	var wd *watchdog.Handle
	var renewed func(time.Time)
	if cfg.Engines == nil {
		exe := cfg.Executable
		if exe == "" {
			var err error
			if exe, err = os.Executable(); err != nil {
				return nil, nil, fmt.Errorf("watchdog: %w", err)
			}
		}
		runsc, err := exec.LookPath(cfg.RunscPath)
		if err == nil {
			runsc, err = filepath.Abs(runsc)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("watchdog: runsc %q: %w", cfg.RunscPath, err)
		}
		wd, err = watchdog.Start(watchdog.StartConfig{Config: watchdog.Config{DataDir: dir, Runsc: runsc, Node: cfg.Node}, Executable: exe}, cfg.Logger)
		if err != nil {
			return nil, nil, err
		}
		cfg.Logger.Info("cluster: watchdog started: if this server dies, the instances here are stopped before the node's lease runs out unless a new server heartbeats",
			"node", cfg.Node, "watchdog_pid", wd.Pid(), "log", filepath.Join(dir, watchdog.LogFile), "after", node.SelfFenceAfter)
		renewed = wd.Heartbeat
	}
	release := func() {
		if wd != nil {
			wd.Release(false)
		}
	}
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	unlock, err := watchdog.LockHandover(lctx, dir)
	cancel()
	if err != nil {
		release()
		return nil, nil, err
	}
	var prev time.Time
	if n, err := db.GetNode(ctx, cfg.Node); err == nil {
		prev = n.HeartbeatAt
	} else if !errors.Is(err, metadata.ErrNotFound) {
		unlock()
		release()
		return nil, nil, err
	}
	hb, err := startNode(ctx, db, mgr, cfg, renewed)
	registered := time.Now()
	unlock()
	if err != nil {
		release()
		return nil, nil, err
	}
	if watchdog.LateRegistration(prev, registered) {
		sctx, scancel := context.WithTimeout(ctx, time.Minute)
		stopped := mgr.StopInstances(sctx)
		scancel()
		if len(stopped) > 0 {
			cfg.Logger.Warn("cluster: registered later than the self-fence time after the node's last heartbeat: the instances left on this host were stopped before reconciling (the other nodes may declare the node lost; its sandboxes resume from their last snapshots)",
				"node", cfg.Node, "last_heartbeat", prev, "registered", registered, "after", node.SelfFenceAfter, "sandboxes", strings.Join(stopped, ","))
		}
	}
	return hb, wd, nil
}
