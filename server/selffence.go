package server

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/apiv1"
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

// selfFence is a node's self-fencing state.
type selfFence struct {
	mu sync.Mutex
	// since is when the node fenced itself (zero: it serves); renewed its
	// last heartbeat then.
	since, renewed time.Time
}

// fenced returns the reason calls about sandboxes are refused, "" when the
// node serves them.
func (f *selfFence) fenced(name string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.since.IsZero() {
		return ""
	}
	return fmt.Sprintf("node %s fenced itself at %s: it has written no heartbeat to the database since %s (for over %s); it serves no sandbox until it reaches the database again, and its sandboxes resume on another node from their last snapshot",
		name, f.since.UTC().Format(time.RFC3339), f.renewed.UTC().Format(time.RFC3339), node.SelfFenceAfter)
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
	since := f.since
	f.mu.Unlock()
	switch {
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
		// The database answers again: give up what this node still owns
		// (the others did not declare it lost in time) before serving.
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

// refuseFenced answers a call about a sandbox on a fenced node (503,
// Retry-After one heartbeat), in E2B's form for E2B's calls, and reports
// whether it did.
func (s *Server) refuseFenced(w http.ResponseWriter, r *http.Request) bool {
	why := s.fence.fenced(s.node)
	if why == "" {
		return false
	}
	w.Header().Set("Retry-After", strconv.Itoa(int(node.HeartbeatInterval/time.Second)))
	err := &sandbox.Error{Kind: sandbox.Unavailable, Err: fmt.Errorf("%s", why)}
	if strings.HasPrefix(r.URL.Path, "/v1/") {
		writeError(w, http.StatusServiceUnavailable, apiv1.CodeUnavailable, err.Error())
	} else {
		s.e2b.Fail(w, r, err)
	}
	return true
}
