package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
)

// Several nodes on one PostgreSQL database (docs/multi-host.md): a call to
// any node for a sandbox another node owns is forwarded to the owner's
// advertised URL; a call that wakes a sandbox no node owns (hibernated) is
// forwarded to the node placement picks; creates through a draining node go
// to another one. The forwarded request is the caller's, unchanged (its API
// key or E2B access token included: the owner checks it, as every node reads
// the same keys), plus HeaderForwarded; a forwarded request is served where
// it arrives and never forwarded again (no loops). With SQLite (one node)
// nothing is forwarded.

// HeaderForwarded marks a request that a node forwarded to another; its
// value is the forwarding node's name.
const HeaderForwarded = "Torpor-Forwarded-By"

// forwardBodyMax bounds the bodies the cluster front keeps so that a call
// whose sandbox another node claimed meanwhile can be sent there (1 MiB,
// the JSON bodies' bound; file uploads and port-proxy bodies are not kept).
const forwardBodyMax = maxJSONBody

// clusterFront is the forwarding front (see above).
type clusterFront struct {
	s      *Server
	domain string // E2B's routing domain
	mu     sync.Mutex
	// proxies are the reverse proxies to other nodes, by base URL.
	proxies map[string]*httputil.ReverseProxy
}

// call is what the cluster front reads of a request.
type call struct {
	id string
	// wakes: the call resumes a hibernated sandbox (or, resume, recovers one
	// in state error); record: it reads the record alone; create: it makes
	// a sandbox.
	wakes, record, create, resume bool
	// keep: its body may be kept to be sent again.
	keep bool
}

// classifyCall finds the sandbox a request is about, if any.
func classifyCall(r *http.Request, domain string) call {
	if route, ok, err := e2b.RouteOf(r.Header, r.Host, domain); err == nil && ok {
		return call{id: route.SandboxID, wakes: true}
	}
	p := r.URL.Path
	var rest string
	var ok bool
	if rest, ok = strings.CutPrefix(p, "/v1/sandboxes/"); !ok {
		if rest, ok = strings.CutPrefix(p, "/v2/sandboxes/"); !ok {
			rest, ok = strings.CutPrefix(p, "/sandboxes/")
		}
	}
	if !ok {
		if r.Method == http.MethodPost && (p == "/v1/sandboxes" || p == "/sandboxes") {
			return call{create: true, keep: true}
		}
		return call{}
	}
	id, sub, _ := strings.Cut(rest, "/")
	sub, _, _ = strings.Cut(sub, "/")
	c := call{id: id, keep: sub != "files" && sub != "ports"}
	switch sub {
	case "":
		c.record = r.Method == http.MethodGet
	case "exec", "files", "ports", "connect":
		c.wakes = true
	case "resume":
		c.wakes, c.resume = true, true
	}
	return c
}

func (f *clusterFront) ServeHTTP(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if r.Header.Get(HeaderForwarded) != "" {
		next.ServeHTTP(w, r)
		return
	}
	c := classifyCall(r, f.domain)
	if c.id == "" && !c.create {
		next.ServeHTTP(w, r)
		return
	}
	target, placed, err := f.target(r.Context(), c)
	if err != nil {
		f.s.log.Warn("cluster: where to serve", "path", r.URL.Path, "err", err)
	}
	if c.keep && r.ContentLength >= 0 && r.ContentLength <= forwardBodyMax {
		keepBody(r)
	}
	if target == nil {
		next.ServeHTTP(w, r)
		return
	}
	if placed {
		// A placed call (no node owns the sandbox yet) that the picked node
		// does not take (stopped since its last heartbeat) is served here.
		r = r.WithContext(context.WithValue(r.Context(), fallbackKey{}, next))
	}
	f.forward(w, r, target)
}

// fallbackKey keys the handler that serves a placed call here when its node
// cannot be reached.
type fallbackKey struct{}

// keepBody reads r's body so that it can be sent again (r.GetBody).
func keepBody(r *http.Request) {
	b, err := io.ReadAll(io.LimitReader(r.Body, forwardBodyMax+1))
	r.Body.Close()
	if err != nil || len(b) > forwardBodyMax {
		r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(b), errReader{err}))
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(b))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) {
	if e.err == nil {
		return 0, io.ErrUnexpectedEOF
	}
	return 0, e.err
}

// target is the node that serves call c, nil for this one; placed says
// that placement picked it (no node owns the sandbox).
func (f *clusterFront) target(ctx context.Context, c call) (target *url.URL, placed bool, err error) {
	s := f.s
	if c.create {
		self, err := s.db.GetNode(ctx, s.node)
		if err != nil || !self.Draining {
			return nil, false, err
		}
		u, err := f.placeURL(ctx, manager.DefaultMemoryMiB, "")
		return u, true, err
	}
	rec, err := s.db.GetSandbox(ctx, c.id)
	if err != nil || rec.Owner == s.node {
		return nil, false, nil // unknown ids are answered here
	}
	if rec.Owner != "" {
		if c.record {
			return nil, false, nil
		}
		n, err := s.db.GetNode(ctx, rec.Owner)
		if err != nil || node.StateOf(n, time.Now()) == node.StateLost {
			return nil, false, err // answered here: the lost node's sandbox is fenced
		}
		u, err := url.Parse(n.Advertise)
		return u, false, err
	}
	if !c.wakes || !(rec.State == sandbox.StateHibernated || (c.resume && rec.State == sandbox.StateError)) {
		return nil, false, nil
	}
	u, err := f.placeURL(ctx, rec.MemoryMiB, rec.SnapshotNode)
	return u, true, err
}

// placeURL is Place's node's URL, nil for this node.
func (f *clusterFront) placeURL(ctx context.Context, mib int, prefer string) (*url.URL, error) {
	n, err := Place(ctx, f.s.db, mib, prefer, f.s.node, time.Now())
	if err != nil || n == nil || n.Name == f.s.node {
		return nil, err
	}
	return url.Parse(n.Advertise)
}

// Place picks the node that starts or resumes a sandbox of mib MiB, asked
// of node self: among the active nodes (heartbeating, not draining) with mib
// MiB free (capacity less load, as of their last heartbeat), prefer if it is
// one (the node that holds the snapshot's local copy), else self, else the
// one with the most free memory (by name on a tie). nil when no node has
// room (the caller serves the call itself and its admission control
// answers). Nodes asked at once may pick differently: the sandbox's lease
// (metadata.ClaimSandbox) lets one resume it. Errors are the database's.
func Place(ctx context.Context, nodes metadata.Nodes, mib int, prefer, self string, now time.Time) (*metadata.Node, error) {
	all, err := nodes.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	var fit []metadata.Node
	for _, n := range all {
		if node.StateOf(n, now) == node.StateActive && n.Capacity.MemoryMiB-n.Load.MemoryMiB >= int64(mib) {
			fit = append(fit, n)
		}
	}
	for _, want := range []string{prefer, self} {
		for _, n := range fit {
			if want != "" && n.Name == want {
				return &n, nil
			}
		}
	}
	if len(fit) == 0 {
		return nil, nil
	}
	sort.SliceStable(fit, func(i, j int) bool {
		fi, fj := fit[i].Capacity.MemoryMiB-fit[i].Load.MemoryMiB, fit[j].Capacity.MemoryMiB-fit[j].Load.MemoryMiB
		if fi != fj {
			return fi > fj
		}
		return fit[i].Name < fit[j].Name
	})
	return &fit[0], nil
}

// forward sends r to the node at base and copies its answer back, streamed.
func (f *clusterFront) forward(w http.ResponseWriter, r *http.Request, base *url.URL) {
	f.proxy(base).ServeHTTP(w, r)
}

func (f *clusterFront) proxy(base *url.URL) *httputil.ReverseProxy {
	f.mu.Lock()
	defer f.mu.Unlock()
	key := base.String()
	if p := f.proxies[key]; p != nil {
		return p
	}
	self := f.s.node
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(base)
			pr.Out.Host = pr.In.Host // E2B routes by host name
			pr.SetXForwarded()
			pr.Out.Header.Set(HeaderForwarded, self)
		},
		FlushInterval: -1, // exec streams and the port proxy's answers as they come
		ErrorLog:      f.s.ErrorLog(),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var op *net.OpError
			if next, ok := r.Context().Value(fallbackKey{}).(http.Handler); ok && errors.As(err, &op) && op.Op == "dial" {
				f.s.log.Warn("cluster: the placed node does not answer; serving here", "node", key, "path", r.URL.Path, "err", err)
				if r.GetBody != nil {
					r.Body, _ = r.GetBody()
				}
				next.ServeHTTP(w, r)
				return
			}
			f.s.log.Warn("cluster: forward", "node", key, "path", r.URL.Path, "err", err)
			writeError(w, http.StatusBadGateway, apiv1.CodeBadGateway,
				fmt.Sprintf("%s %s: forwarding to node %s: %v", r.Method, r.URL.Path, key, err))
		},
	}
	if f.proxies == nil {
		f.proxies = map[string]*httputil.ReverseProxy{}
	}
	f.proxies[key] = p
	return p
}

// forwardToOwner sends a call that the manager refused because another
// node owns the sandbox (it claimed it meanwhile) to that node, when the
// call came from a client (not forwarded) and its body was kept. It reports
// whether it did.
func (s *Server) forwardToOwner(w http.ResponseWriter, r *http.Request, err error) bool {
	owner := manager.OwnerOf(err)
	if owner == "" || s.cluster == nil || r.Header.Get(HeaderForwarded) != "" || r.GetBody == nil {
		return false
	}
	n, gerr := s.db.GetNode(r.Context(), owner)
	if gerr != nil || node.StateOf(n, time.Now()) == node.StateLost {
		return false
	}
	base, perr := url.Parse(n.Advertise)
	body, berr := r.GetBody()
	if perr != nil || berr != nil {
		return false
	}
	r.Body = body
	s.cluster.forward(w, r, base)
	return true
}

// clusterLoop runs every node.HeartbeatInterval until stop is closed, on
// servers on a shared database:
//
//   - the sandboxes of a lost node (no heartbeat for node.LeaseTime) that
//     have an instance are fenced (manager.Fence): state error with the
//     reason, no owner, a new lease token; any node resumes them from their
//     last committed snapshot;
//   - instances of sandboxes this node no longer owns (fenced while it was
//     cut off) are stopped (manager.StopForeign);
//   - while this node is draining, its sandboxes are hibernated, and resume
//     on another node on their next request.
func (s *Server) clusterLoop(stop <-chan struct{}) {
	tick := time.NewTicker(node.HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		s.clusterTick(ctx)
		cancel()
	}
}

func (s *Server) clusterTick(ctx context.Context) {
	nodes, err := s.db.ListNodes(ctx)
	if err != nil {
		s.log.Warn("cluster: list nodes", "err", err)
		return
	}
	now := time.Now()
	lost := map[string]metadata.Node{}
	draining := false
	for _, n := range nodes {
		switch {
		case n.Name == s.node:
			draining = n.Draining
		case node.StateOf(n, now) == node.StateLost:
			lost[n.Name] = n
		}
	}
	all, err := s.db.ListSandboxes(ctx)
	if err != nil {
		s.log.Warn("cluster: list sandboxes", "err", err)
		return
	}
	for _, sb := range all {
		if n, ok := lost[sb.Owner]; ok && !sb.Deleting {
			why := fmt.Sprintf("node %s lost: no heartbeat since %s (for over %s)", n.Name,
				n.HeartbeatAt.UTC().Format(time.RFC3339), node.LeaseTime)
			if _, err := s.Manager.Fence(ctx, sb.ID, n.Name, why); err != nil {
				s.log.Warn("cluster: fence", "sandbox", sb.ID, "node", n.Name, "err", err)
			}
		}
		if draining && sb.Owner == s.node && !sb.Deleting &&
			(sb.State == sandbox.StateRunning || sb.State == sandbox.StatePaused) {
			if _, err := s.Manager.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
				s.log.Warn("cluster: drain: hibernate", "sandbox", sb.ID, "err", err)
			} else {
				s.log.Info("cluster: drain: hibernated", "sandbox", sb.ID)
			}
		}
	}
	s.Manager.StopForeign(ctx)
}

// drainNode marks node {name} draining (drain true) or not: placement skips
// a draining node, and the node hibernates its sandboxes (clusterTick).
func (s *Server) drainNode(drain bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := decode(r, &struct{}{}, true); err != nil {
			s.fail(w, r, err)
			return
		}
		name := r.PathValue("name")
		if err := s.db.SetNodeDraining(r.Context(), name, drain); err != nil {
			if errors.Is(err, metadata.ErrNotFound) {
				err = sandbox.Errorf(sandbox.NotFound, "node %s: not found", name)
			}
			s.fail(w, r, err)
			return
		}
		n, err := s.db.GetNode(r.Context(), name)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, s.wireNode(n, time.Now()))
	}
}
