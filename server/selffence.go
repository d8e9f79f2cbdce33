package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
)

// Self-fencing (docs/multi-host.md#self-fencing): a node on a shared
// database that has not written a heartbeat for node.SelfFenceAfter — cut
// off from the database — stops serving its sandboxes (503 for every call
// about a sandbox, creates included) and stops their instances, before the
// other nodes may declare it lost (node.LeaseTime) and resume them
// elsewhere from their snapshots: no sandbox runs on two nodes at once. Once
// its heartbeat is written again it records the sandboxes it still owns as
// lost (state error, no owner; they resume from their last snapshot, as a
// lost node's) and serves again.

// selfFenceCheck is how often a node compares its last heartbeat with
// node.SelfFenceAfter.
const selfFenceCheck = time.Second

// The node lock (postgres.DB.LockServer) is a session lock: it goes with
// its session when the database is lost. The node checks it every
// selfFenceCheck (nodeLockLoop) and takes it again on a new session when
// the session is gone; it refuses sandbox calls while it does not hold it,
// and ends a fence only once it holds it again. If another server took the
// lock meanwhile (started as this node), this one is no longer the node:
// it stops its heartbeat and its instances, refuses every sandbox call and
// exits (Run returns the error) without writing anything more as the node.

// nodeLockTimeout bounds one check or retake of the node lock.
const nodeLockTimeout = 5 * time.Second

// serverLocker keeps a node's lock in a shared database (postgres.DB).
type serverLocker interface {
	// KeepServerLock: see postgres.DB.KeepServerLock.
	KeepServerLock(ctx context.Context) (retaken bool, err error)
}

// selfFence is a node's self-fencing state.
type selfFence struct {
	mu sync.Mutex
	// since is when the node fenced itself (zero: it serves); renewed its
	// last heartbeat then.
	since, renewed time.Time
	// unlocked is when the node found it no longer holds its node lock
	// (zero: it holds it), lockErr why it could not take it again.
	unlocked time.Time
	lockErr  error
	// taken is set once another server holds the node's lock: this one
	// serves no sandbox again and exits.
	taken error
}

// fenced returns the reason calls about sandboxes are refused, "" when the
// node serves them.
func (f *selfFence) fenced(name string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.taken != nil:
		return fmt.Sprintf("node %s is not served by this server any more: another torpor server took the node's lock in the database while this one had lost it (%v); this one stopped its instances and exits",
			name, f.taken)
	case f.since.IsZero() && !f.unlocked.IsZero():
		return fmt.Sprintf("node %s does not hold its node lock in the database since %s (%v): it serves no sandbox until it holds it again, so that no second server acts as this node",
			name, f.unlocked.UTC().Format(time.RFC3339), f.lockErr)
	case f.since.IsZero():
		return ""
	}
	return fmt.Sprintf("node %s fenced itself at %s: it has written no heartbeat to the database since %s (for over %s); it serves no sandbox until it reaches the database again, and its sandboxes resume on another node from their last snapshot",
		name, f.since.UTC().Format(time.RFC3339), f.renewed.UTC().Format(time.RFC3339), node.SelfFenceAfter)
}

// lockTaken says whether another server took the node's lock from this one.
func (f *selfFence) lockTaken() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.taken != nil
}

// selfFenceLoop checks the heartbeat every selfFenceCheck until stop is
// closed (servers on a shared database).
func (s *Server) selfFenceLoop(stop <-chan struct{}) {
	every(selfFenceCheck, stop, func() { s.selfFenceTick(time.Now()) })
}

// selfFenceTick fences the node when its lease is about to run out, and
// ends the fence once its heartbeat is written again and its own sandboxes
// are released.
func (s *Server) selfFenceTick(now time.Time) {
	f := &s.fence
	renewed := s.heartbeat.Renewed()
	f.mu.Lock()
	since, taken := f.since, f.taken
	f.mu.Unlock()
	switch {
	case taken != nil:
		// Not this node any more (nodeLockTaken).
	case since.IsZero() && node.MustFence(renewed, now):
		f.mu.Lock()
		f.since, f.renewed = now, renewed
		f.mu.Unlock()
		s.log.Error("cluster: fencing this node: no heartbeat written for longer than the self-fence time; refusing sandbox calls and stopping every instance",
			"node", s.node, "last_heartbeat", renewed, "after", node.SelfFenceAfter, "lease", node.LeaseTime)
		ctx, cancel := context.WithTimeout(context.Background(), node.SelfFenceMargin)
		stopped := s.Manager.StopInstances(ctx)
		cancel()
		s.log.Warn("cluster: fenced: instances stopped", "node", s.node, "sandboxes", len(stopped), "ids", strings.Join(stopped, ","))
	case !since.IsZero() && renewed.After(since):
		// The database answers again: take the node lock again (its
		// session ended with the connection), then give up what this node
		// still owns (the others did not declare it lost in time) before
		// serving.
		lctx, lcancel := context.WithTimeout(context.Background(), nodeLockTimeout)
		err := s.keepNodeLock(lctx, now)
		lcancel()
		if err != nil {
			return // still fenced; nodeLockTaken if another server has the lock
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		why := fmt.Sprintf("node %s fenced itself: no heartbeat written from %s to %s (over %s), its instances were stopped",
			s.node, f.renewed.UTC().Format(time.RFC3339), since.UTC().Format(time.RFC3339), node.SelfFenceAfter)
		if err := s.Manager.ReleaseOwned(ctx, why); err != nil {
			s.log.Warn("cluster: fenced: release the sandboxes this node owned", "node", s.node, "err", err)
			return
		}
		s.Manager.StopForeign(ctx)
		f.mu.Lock()
		f.since = time.Time{}
		f.mu.Unlock()
		s.log.Warn("cluster: fence ended: the database answers again, this node serves", "node", s.node)
	}
}

// nodeLockLoop checks the node lock every selfFenceCheck until stop is
// closed (servers on a shared database; nothing with SQLite).
func (s *Server) nodeLockLoop(stop <-chan struct{}) {
	if s.locker == nil {
		return
	}
	every(selfFenceCheck, stop, func() {
		ctx, cancel := context.WithTimeout(context.Background(), nodeLockTimeout)
		s.keepNodeLock(ctx, time.Now())
		cancel()
	})
}

// keepNodeLock makes sure the node holds its lock (serverLocker), taking
// it again if its session is gone, and records the outcome at now: nil, the
// lock held; another server's lock (postgres.ErrLocked), after which this
// server is no longer the node (nodeLockTaken); the database's error, the
// lock not held (sandbox calls refused until it is).
func (s *Server) keepNodeLock(ctx context.Context, now time.Time) error {
	if s.locker == nil {
		return nil
	}
	retaken, err := s.locker.KeepServerLock(ctx)
	f := &s.fence
	f.mu.Lock()
	if f.taken != nil {
		f.mu.Unlock()
		return f.taken
	}
	was := f.unlocked
	switch {
	case errors.Is(err, postgres.ErrLocked):
		f.taken = err
		f.mu.Unlock()
		s.nodeLockTaken(err)
		return err
	case err != nil:
		if was.IsZero() {
			f.unlocked = now
		}
		f.lockErr = err
		f.mu.Unlock()
		if was.IsZero() {
			s.log.Warn("cluster: this node does not hold its node lock in the database (its session is gone): refusing sandbox calls until it is taken again",
				"node", s.node, "err", err)
		}
		return err
	}
	f.unlocked, f.lockErr = time.Time{}, nil
	f.mu.Unlock()
	switch {
	case !was.IsZero():
		s.log.Warn("cluster: node lock taken again: its session had ended", "node", s.node, "not_held_since", was)
	case retaken:
		s.log.Warn("cluster: node lock taken again: its session had ended", "node", s.node)
	}
	return nil
}

// nodeLockTaken makes a server whose node lock another server took stop
// being the node: its heartbeat ends (the other server writes the node's
// record), so do its lifecycle policies and warm pools, its instances are
// stopped (without the database: the sandboxes
// are the other server's now), every sandbox call is refused (fenced) and
// Run returns err, wrapped, so that the process exits non-zero.
func (s *Server) nodeLockTaken(err error) {
	s.log.Error("cluster: another torpor server holds this node's lock in the database: two servers must not be one node; this one stops its heartbeat and its instances, serves no sandbox and exits",
		"node", s.node, "err", err)
	s.heartbeat.Stop()
	if s.stopLC != nil {
		s.stopLC() // no idle, timeout or warm-pool action as the node either
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	stopped := s.Manager.StopInstances(ctx)
	cancel()
	s.log.Warn("cluster: node lock lost to another server: instances stopped", "node", s.node, "sandboxes", len(stopped), "ids", strings.Join(stopped, ","))
	select {
	case s.fatal <- fmt.Errorf("node %s: %w; this server had lost the lock (its database session ended) and another took it: it stopped its instances and exits; run one server per --node name", s.node, err):
	default:
	}
}

// refuseFenced answers a call about a sandbox on a fenced node (503,
// Retry-After one heartbeat, HeaderFenced), in E2B's form for E2B's calls, and reports
// whether it did.
func (s *Server) refuseFenced(w http.ResponseWriter, r *http.Request) bool {
	why := s.fence.fenced(s.node)
	if why == "" {
		return false
	}
	w.Header().Set("Retry-After", strconv.Itoa(int(node.HeartbeatInterval/time.Second)))
	w.Header().Set(HeaderFenced, "fenced")
	err := &sandbox.Error{Kind: sandbox.Unavailable, Err: fmt.Errorf("%s", why)}
	if strings.HasPrefix(r.URL.Path, "/v1/") {
		writeError(w, http.StatusServiceUnavailable, apiv1.CodeUnavailable, err.Error())
	} else {
		s.e2b.Fail(w, r, err)
	}
	return true
}

// healthz answers GET /healthz: 200 {"ok": true} while the node serves,
// 503 {"ok": false, "reason": …} with Retry-After (one heartbeat) while it
// refuses every sandbox call (self-fenced, its node lock not held, or taken
// by another server: refuseFenced's reasons), so that a load balancer sends
// its traffic to the other nodes meanwhile. Either way NodeHeader names the
// server process that answered.
func (s *Server) healthz(w http.ResponseWriter, r *http.Request) {
	if id := s.idemHolder(); id != "" {
		w.Header().Set(NodeHeader, id)
	}
	if why := s.fence.fenced(s.node); why != "" {
		w.Header().Set("Retry-After", strconv.Itoa(int(node.HeartbeatInterval/time.Second)))
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"ok": false, "reason": why})
		return
	}
	writeJSON(w, http.StatusOK, map[string]bool{"ok": true})
}
