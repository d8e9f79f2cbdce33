package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sort"
	"strconv"
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
// the same keys), plus HeaderForwarded. A call served on a node (the
// forwarded ones included) whose sandbox the manager finds another node
// owns — that node claimed it after this one read the record: wakes of one
// hibernated sandbox through several nodes at once — is sent on to that
// node (referral), up to maxForwardHops forwards in all (no loops). With
// SQLite (one node) nothing is forwarded.

// HeaderForwarded marks a request that a node forwarded to another; its
// value is the names of the nodes that forwarded it, in order, joined by
// ", ".
const HeaderForwarded = "Torpor-Forwarded-By"

// HeaderFenced is set on a node's 503 for a call it refused without acting
// on it because it does not serve sandboxes now (refuseFenced: self-fenced,
// its node lock not held). A node that forwarded a placed call there serves
// the call itself instead: a node that has just reached the database again
// heartbeats as active for up to a few seconds before its fence ends, and
// placement prefers the node holding a snapshot's local copy.
const HeaderFenced = "Torpor-Fenced"

// maxForwardHops bounds how often one call is forwarded: the first node to
// the owner or the placed node, that one on to the node that won the
// sandbox's claim meanwhile, and once more should that one have lost it
// too. A call forwarded so often is served where it arrives.
const maxForwardHops = 3

// forwardHops is how often r was forwarded (HeaderForwarded's names).
func forwardHops(r *http.Request) int {
	v := r.Header.Get(HeaderForwarded)
	if v == "" {
		return 0
	}
	return strings.Count(v, ",") + 1
}

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
	// placed is the memory this node placed on others lately, by node
	// (placedOn).
	placedMu sync.Mutex
	placed   map[string][]placement
	// nodes is the list of nodes nodeAt read at nodesAt.
	nodesMu sync.Mutex
	nodes   []metadata.Node
	nodesAt time.Time
}

// call is what the cluster front reads of a request.
type call struct {
	id string
	// wakes: the call resumes a hibernated sandbox (or, resume, recovers one
	// in state error); record: it reads the record alone; create: it makes
	// a sandbox.
	wakes, record, create, resume bool
	// fork: it forks the sandbox.
	fork bool
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
	case "fork":
		c.fork = true
	}
	return c
}

func (f *clusterFront) ServeHTTP(w http.ResponseWriter, r *http.Request, next http.Handler) {
	c := classifyCall(r, f.domain)
	if (c.id != "" || c.create) && f.s.refuseFenced(w, r) {
		return // self-fenced (selffence.go): forwarded calls too
	}
	if c.id == "" && !c.create {
		next.ServeHTTP(w, r)
		return
	}
	if c.keep && r.ContentLength >= 0 && r.ContentLength <= forwardBodyMax {
		keepBody(r)
	}
	if r.Header.Get(HeaderForwarded) != "" {
		f.serveHere(w, r, c, next) // never placed again: only referred
		return
	}
	target, placed, err := f.target(r.Context(), c, r)
	if c.create && r.Header.Get(apiv1.IdempotencyKeyHeader) != "" && manager.RetryAfterSeconds(err) > 0 {
		// No node has room for another sandbox, but a retry of a create
		// that made one is answered from its key's record (this node's
		// admission refuses a new one the same way).
		f.serveHere(w, r, c, next)
		return
	}
	if manager.RetryAfterSeconds(err) > 0 || sandbox.KindOf(err) == sandbox.Conflict {
		// No node has room: refused as admission control refuses (503); or
		// no node can serve it (409: volumes on two nodes).
		if strings.HasPrefix(r.URL.Path, "/v1/") {
			f.s.fail(w, r, err)
		} else {
			f.s.e2b.Fail(w, r, err)
		}
		return
	}
	if err != nil {
		f.s.log.Warn("cluster: where to serve", "path", r.URL.Path, "err", err)
	}
	if target == nil {
		f.serveHere(w, r, c, next)
		return
	}
	if placed {
		// A placed call (no node owns the sandbox yet) that the picked node
		// does not take (stopped since its last heartbeat) is served here.
		here := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.serveHere(w, r, c, next) })
		r = r.WithContext(context.WithValue(r.Context(), fallbackKey{}, http.Handler(here)))
	}
	f.forward(w, r, target)
}

// fallbackKey keys the handler that serves a placed call here when its node
// cannot be reached.
type fallbackKey struct{}

// referral is what serveHere keeps of a call it serves, so that the call
// can be sent to the node that owns its sandbox (Server.refer): the
// caller's headers as they came (the E2B front removes its routing headers
// and tokens before it serves a call), the body if it is not kept
// (r.GetBody), and the owner's URL once a handler referred the call.
type referral struct {
	header http.Header
	body   *heldBody
	to     *url.URL
}

type referralKey struct{}

// heldBody is a request body that a handler may hand on unread: it notes
// whether anything was read from it, and its Close does nothing (a reverse
// proxy closes the body of a request it could not send; the server closes
// the request's own body at the end).
type heldBody struct {
	rc   io.ReadCloser
	read bool
}

func (b *heldBody) Read(p []byte) (int, error) {
	b.read = true
	return b.rc.Read(p)
}

func (b *heldBody) Close() error { return nil }

// serveHere serves call c (request r) on this node with next. A call about
// a sandbox that a handler referred (Server.refer: another node owns it
// now) is forwarded to the owner instead, once next returns, with the
// caller's headers and body; a call forwarded maxForwardHops times is not
// referred again.
func (f *clusterFront) serveHere(w http.ResponseWriter, r *http.Request, c call, next http.Handler) {
	if c.id == "" || forwardHops(r) >= maxForwardHops {
		next.ServeHTTP(w, r)
		return
	}
	ref := &referral{header: r.Header.Clone()}
	in := r.WithContext(context.WithValue(r.Context(), referralKey{}, ref))
	if r.GetBody == nil && r.Body != nil && r.Body != http.NoBody {
		ref.body = &heldBody{rc: r.Body}
		in.Body = ref.body
	}
	next.ServeHTTP(w, in)
	if ref.to == nil {
		return
	}
	// A referral whose owner does not answer is not served here again (a
	// placed call's fallback): 502, and the caller retries.
	out := r.Clone(context.WithValue(r.Context(), fallbackKey{}, nil))
	out.Header = ref.header
	switch {
	case r.GetBody != nil:
		out.Body, _ = r.GetBody()
	case ref.body != nil:
		out.Body = ref.body.rc
	}
	f.s.log.Info("cluster: another node claimed the sandbox meanwhile: forwarding there", "sandbox", c.id, "node", ref.to.Host, "path", r.URL.Path)
	f.forward(w, out, ref.to)
}

// refer reports whether the cluster front will forward request r, which a
// handler failed with err, to the node that owns its sandbox — err is a
// *manager.NotOwnerError (that node claimed the sandbox after this one read
// its record), r is served by serveHere, its body is kept or was not read,
// and the owner is not lost — in which case the handler writes nothing.
// Every handler's failure path asks it first (fail, failPortProxy, the E2B
// service's).
func (s *Server) refer(r *http.Request, err error) bool {
	owner := manager.OwnerOf(err)
	ref, _ := r.Context().Value(referralKey{}).(*referral)
	if owner == "" || owner == s.node || ref == nil || ref.to != nil || (ref.body != nil && ref.body.read) {
		return false
	}
	n, gerr := s.db.GetNode(r.Context(), owner)
	if gerr != nil || node.StateOf(n, time.Now()) == node.StateLost {
		return false
	}
	base, perr := url.Parse(n.Advertise)
	if perr != nil {
		return false
	}
	ref.to = base
	return true
}

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

// target is the node that serves call c (request r), nil for this one;
// placed says that placement picked it (no node owns the sandbox). A
// sandbox that mounts a volume recorded on a node is placed on that node
// only (create, resume, and a fork of a sandbox no node owns), never served
// elsewhere as a fallback. Errors: Place's refusal when no node (or not the
// volume's node) has room; volumeNode's conflict when the sandbox mounts
// volumes of two nodes (a create, a resume, a fork); the database's.
func (f *clusterFront) target(ctx context.Context, c call, r *http.Request) (target *url.URL, placed bool, err error) {
	s := f.s
	if c.create {
		mib, vols := createRequest(r)
		p := Placement{Op: "create", MiB: mib}
		if p.Volume, p.VolumeNode, err = volumeNode(ctx, s.db, p.Op, "", vols); err != nil {
			return nil, false, err
		}
		// Place keeps it here when this node is active and has room, else
		// picks the active node with the most room (a create asked of a full
		// or draining node goes on to one with room).
		u, err := f.placeURL(ctx, p)
		return u, p.VolumeNode == "", err
	}
	rec, err := s.db.GetSandbox(ctx, c.id)
	if err != nil {
		return nil, false, nil // unknown ids are answered here
	}
	p := Placement{Op: "resume", SandboxID: rec.ID, MiB: rec.MemoryMiB, Prefer: rec.SnapshotNode}
	if c.fork {
		p.Op = "fork"
	}
	// placed: the call resumes a sandbox no node owns, on the node Place
	// picks.
	placed = rec.Owner == "" && c.wakes && (rec.State == sandbox.StateHibernated || (c.resume && rec.State == sandbox.StateError))
	if c.fork || placed {
		if p.Volume, p.VolumeNode, err = volumeNode(ctx, s.db, p.Op, rec.ID, rec.Volumes); err != nil {
			return nil, false, err
		}
	}
	if rec.Owner == s.node {
		return nil, false, nil
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
	if c.fork && p.VolumeNode != "" {
		// The clones' copies of the volumes are made from its directory.
		p.Prefer = ""
		u, err := f.placeURL(ctx, p)
		return u, false, err
	}
	if !placed {
		return nil, false, nil
	}
	u, err := f.placeURL(ctx, p)
	return u, p.VolumeNode == "", err
}

// volumeNode is the first of the volumes mounts names whose record names a
// node, and that node ("", "" if none does; a volume without a record is
// the serving node's to refuse), for call op ("create", "resume", "fork")
// of sandbox id ("" for a create). A volume's directory is on its node
// alone, so a sandbox that mounts volumes of two nodes can run on neither.
// Errors: a *sandbox.Error of kind Conflict (HTTP 409) naming two volumes
// on different nodes and their nodes, when mounts has such; the database's.
func volumeNode(ctx context.Context, vols metadata.Volumes, op, id string, mounts []sandbox.VolumeMount) (name, nodeName string, err error) {
	for _, vm := range mounts {
		v, err := vols.GetVolume(ctx, vm.Name)
		if errors.Is(err, metadata.ErrNotFound) {
			continue
		}
		if err != nil {
			return "", "", err
		}
		switch {
		case v.Node == "" || v.Node == nodeName:
		case nodeName == "":
			name, nodeName = v.Name, v.Node
		default:
			hint := "mount volumes of one node only (a volume is made on the node its create reaches: make them through the same node)"
			what := "the sandbox would mount"
			if id != "" {
				hint = "no node can run it; delete it and create a sandbox that mounts volumes of one node"
				what = "it mounts"
			}
			return "", "", (&sandbox.Error{Kind: sandbox.Conflict, Op: op, SandboxID: id,
				Err: fmt.Errorf("%s volumes on two nodes: volume %s is on node %s and volume %s on node %s; a volume's directory is on its node alone, so a sandbox that mounts both runs on neither",
					what, name, nodeName, v.Name, v.Node)}).WithHint(hint)
		}
	}
	return name, nodeName, nil
}

// createRequest is the memory and the volumes of the sandbox create request
// r makes: REST v1's memory_mib and volumes from its kept body, else
// manager.DefaultMemoryMiB and none (E2B's creates, whose memory is their
// template's, and bodies not kept or not read: the node that serves the
// call checks them).
func createRequest(r *http.Request) (mib int, vols []sandbox.VolumeMount) {
	var req struct {
		MemoryMiB int `json:"memory_mib"`
		Volumes   []struct {
			Name string `json:"name"`
		} `json:"volumes"`
	}
	mib = manager.DefaultMemoryMiB
	if strings.HasPrefix(r.URL.Path, "/v1/") && r.GetBody != nil {
		if body, err := r.GetBody(); err == nil {
			if json.NewDecoder(body).Decode(&req) == nil {
				if req.MemoryMiB > 0 {
					mib = req.MemoryMiB
				}
				for _, v := range req.Volumes {
					vols = append(vols, sandbox.VolumeMount{Name: v.Name})
				}
			}
		}
	}
	return mib, vols
}

// placeURL is the URL of the node Place picks for p, nil for this node;
// this node's room is judged by its manager's committed memory now, the
// others' by their records.
func (f *clusterFront) placeURL(ctx context.Context, p Placement) (*url.URL, error) {
	s := f.s
	p.Self, p.SelfCommitted, p.RetryAfter, p.Pending = s.node, s.Manager.CommittedMiB, s.Manager.Limits().RetryAfter, f.pendingOn
	n, err := Place(ctx, s.db, p, time.Now())
	if err != nil || n.Name == s.node {
		return nil, err
	}
	f.placedOn(n.Name, p.MiB)
	return url.Parse(n.Advertise)
}

// placement is memory this node placed on another one (placedOn).
type placement struct {
	mib int64
	at  time.Time
}

// placedMargin is how long before a node's heartbeat a placement on it may
// have been made and still be missing from that heartbeat's load: the
// forward's way to the node and its admission.
const placedMargin = time.Second

// placedOn notes that mib MiB were just placed on node name (a forwarded
// create or resume): until that node heartbeats the load with it, this
// node's placements count it (pendingOn), so that calls placed in a row do
// not all go to the node that looked emptiest at its last heartbeat (a
// trial's sequential creates were all sent to one node, which refused them,
// while another stood empty).
func (f *clusterFront) placedOn(name string, mib int) {
	f.placedMu.Lock()
	defer f.placedMu.Unlock()
	if f.placed == nil {
		f.placed = map[string][]placement{}
	}
	now := time.Now()
	keep := f.placed[name][:0]
	for _, pl := range f.placed[name] {
		if now.Sub(pl.at) < 2*node.HeartbeatInterval {
			keep = append(keep, pl)
		}
	}
	f.placed[name] = append(keep, placement{mib: int64(mib), at: now})
}

// pendingOn is Placement.Pending: the memory this node placed on node name
// that name's heartbeat at beat may not count (placed less than
// placedMargin before it, or after), within the last two heartbeat
// intervals.
func (f *clusterFront) pendingOn(name string, beat time.Time) int64 {
	f.placedMu.Lock()
	defer f.placedMu.Unlock()
	var mib int64
	for _, pl := range f.placed[name] {
		if time.Since(pl.at) < 2*node.HeartbeatInterval && pl.at.Add(placedMargin).After(beat) {
			mib += pl.mib
		}
	}
	return mib
}

// Placement is what Place places: a sandbox of MiB MiB for Op ("create",
// "resume") on sandbox SandboxID ("" for a create), asked of node Self.
type Placement struct {
	Op, SandboxID string
	MiB           int
	// Prefer is the node that holds the snapshot's local copy ("": none).
	Prefer, Self string
	// Volume and VolumeNode, when VolumeNode is set: the sandbox mounts the
	// named volume Volume, whose directory is on node VolumeNode alone; the
	// sandbox is placed there or nowhere.
	Volume, VolumeNode string
	// SelfCommitted, if set, is Self's committed memory now (MiB), judged
	// in place of its record's load (as of its last heartbeat).
	SelfCommitted func(context.Context) (int64, error)
	// RetryAfter is what a refusal tells the caller to wait.
	RetryAfter time.Duration
	// Pending, if set, is the memory (MiB) Self has placed on node name
	// since that node's heartbeat at beat, which its record's load does not
	// count yet; Place adds it to that load.
	Pending func(name string, beat time.Time) int64
}

// Place picks the node that starts or resumes the sandbox p says: among the
// active nodes (heartbeating, not draining) that have room by admission
// control's rule (node.HasRoom: the load's memory, what the node has
// committed, plus p.MiB within its memory × its registered overcommit
// ratio), p.Prefer if it is one (the node that holds the snapshot's local
// copy), else p.Self, else the one with the most room (by name on a tie).
// A sandbox that mounts a volume (p.VolumeNode set) goes to the volume's
// node only: if it is lost, draining, unknown or has no room, the refusal
// (503, Retry-After) names the volume and its node.
// Nodes asked at once may pick differently: the sandbox's lease
// (metadata.ClaimSandbox) lets one resume it, and the picked node's own
// admission control decides. Errors: a *sandbox.Error of kind Unavailable
// wrapping a *manager.AdmissionError (Placement set; HTTP 503 with
// Retry-After) when no node has room; the database's.
func Place(ctx context.Context, nodes metadata.Nodes, p Placement, now time.Time) (*metadata.Node, error) {
	all, err := nodes.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	room := func(n metadata.Node) int64 {
		return node.AdmittedMiB(n.Capacity.MemoryMiB, n.MemoryOvercommit) - n.Load.MemoryMiB
	}
	if p.VolumeNode != "" {
		state := "unknown"
		for i := range all {
			if all[i].Name == p.VolumeNode {
				all, state = all[i:i+1], string(node.StateOf(all[i], now))
				break
			}
		}
		if state == "unknown" {
			all = nil
		}
		if state != string(node.StateActive) {
			return nil, volumeRefusal(p, state)
		}
	}
	var fit []metadata.Node
	var best *metadata.Node
	active := 0
	for _, n := range all {
		if node.StateOf(n, now) != node.StateActive {
			continue
		}
		if n.Name == p.Self && p.SelfCommitted != nil {
			if n.Load.MemoryMiB, err = p.SelfCommitted(ctx); err != nil {
				return nil, err
			}
		} else if p.Pending != nil {
			n.Load.MemoryMiB += p.Pending(n.Name, n.HeartbeatAt)
		}
		active++
		if best == nil || room(n) > room(*best) {
			best = &n
		}
		if node.HasRoom(n.Load.MemoryMiB, int64(p.MiB), n.Capacity.MemoryMiB, n.MemoryOvercommit) {
			fit = append(fit, n)
		}
	}
	if len(fit) == 0 && p.VolumeNode != "" {
		return nil, volumeRefusal(p, "full")
	}
	if len(fit) == 0 {
		ae := &manager.AdmissionError{Placement: true, Nodes: active, NeedMiB: int64(p.MiB), Retry: p.RetryAfter}
		if best != nil {
			ae.UsedMiB, ae.CapMiB, ae.Overcommit = best.Load.MemoryMiB, node.AdmittedMiB(best.Capacity.MemoryMiB, best.MemoryOvercommit), best.MemoryOvercommit
		}
		return nil, (&sandbox.Error{Kind: sandbox.Unavailable, Op: p.Op, SandboxID: p.SandboxID, Err: ae}).
			WithHint("retry later, or hibernate or delete sandboxes to free memory; the operator can add nodes or raise their memory overcommit ratio")
	}
	for _, want := range []string{p.Prefer, p.Self} {
		for _, n := range fit {
			if want != "" && n.Name == want {
				return &n, nil
			}
		}
	}
	sort.SliceStable(fit, func(i, j int) bool {
		if ri, rj := room(fit[i]), room(fit[j]); ri != rj {
			return ri > rj
		}
		return fit[i].Name < fit[j].Name
	})
	return &fit[0], nil
}

// volumeRefusal is Place's refusal of p, whose volume's node is in state
// state.
func volumeRefusal(p Placement, state string) error {
	ae := &manager.AdmissionError{Placement: true, Nodes: 1, NeedMiB: int64(p.MiB), Retry: p.RetryAfter,
		Volume: p.Volume, VolumeNode: p.VolumeNode, VolumeNodeState: state}
	return (&sandbox.Error{Kind: sandbox.Unavailable, Op: p.Op, SandboxID: p.SandboxID, Err: ae}).
		WithHint("retry once node " + p.VolumeNode + " is back, undrained (torpor node undrain) or has room; the volume's data is on that node only")
}

// forward sends r to the node at base and copies its answer back, streamed.
func (f *clusterFront) forward(w http.ResponseWriter, r *http.Request, base *url.URL) {
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	go f.watchNode(ctx, cancel, base.String())
	f.proxy(base).ServeHTTP(w, r.WithContext(ctx))
}

// nodeWatchPeriod is how often a call forwarded to a node checks, while it
// waits, that the node still heartbeats.
const nodeWatchPeriod = time.Second

// silentNodeError ends a forwarded call whose node sent no heartbeat for
// longer than node.SelfFenceAfter: by then a node cut off from the database
// has fenced itself, so one that has not answered is hung or gone.
type silentNodeError struct {
	node string
	age  time.Duration
}

func (e *silentNodeError) Error() string {
	return fmt.Sprintf("node %s sent no heartbeat for %s (hung, cut off or gone)", e.node, e.age.Round(100*time.Millisecond))
}

// watchNode ends ctx (cancel, with a *silentNodeError) once the node
// advertising adv has sent no heartbeat for node.SelfFenceAfter, checking
// every nodeWatchPeriod until ctx ends. A node that cannot be read (the
// database does not answer) is not judged.
func (f *clusterFront) watchNode(ctx context.Context, cancel context.CancelCauseFunc, adv string) {
	tick := time.NewTicker(nodeWatchPeriod)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		n, ok := f.nodeAt(ctx, adv)
		if !ok {
			continue
		}
		if age := time.Since(n.HeartbeatAt); age > node.SelfFenceAfter {
			cancel(&silentNodeError{node: n.Name, age: age})
			return
		}
	}
}

// placedFencedError is a placed call's refusal by a fenced node
// (HeaderFenced), which the forwarding node then serves.
type placedFencedError struct{ node, why string }

func (e *placedFencedError) Error() string {
	return fmt.Sprintf("node at %s does not serve sandboxes now (%s)", e.node, e.why)
}

// nodeAt is the record of the node advertising adv, from a list of the
// nodes read at most once per nodeWatchPeriod for all the calls in flight;
// ok false when no node advertises adv or the list cannot be read.
func (f *clusterFront) nodeAt(ctx context.Context, adv string) (metadata.Node, bool) {
	f.nodesMu.Lock()
	defer f.nodesMu.Unlock()
	if time.Since(f.nodesAt) >= nodeWatchPeriod {
		lctx, cancel := context.WithTimeout(ctx, nodeWatchPeriod)
		ns, err := f.s.db.ListNodes(lctx)
		cancel()
		if err != nil {
			return metadata.Node{}, false
		}
		f.nodes, f.nodesAt = ns, time.Now()
	}
	for _, n := range f.nodes {
		if strings.TrimRight(n.Advertise, "/") == strings.TrimRight(adv, "/") {
			return n, true
		}
	}
	return metadata.Node{}, false
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
			by := self
			if prev := pr.In.Header.Get(HeaderForwarded); prev != "" {
				by = prev + ", " + self
			}
			pr.Out.Header.Set(HeaderForwarded, by)
		},
		FlushInterval: -1, // exec streams and the port proxy's answers as they come
		ErrorLog:      f.s.ErrorLog(),
		ModifyResponse: func(res *http.Response) error {
			// A placed call the node refused unread because it is fenced:
			// served here (ErrorHandler) if its body can be sent again.
			r := res.Request
			if _, ok := r.Context().Value(fallbackKey{}).(http.Handler); ok && res.StatusCode == http.StatusServiceUnavailable &&
				res.Header.Get(HeaderFenced) != "" && (r.GetBody != nil || r.Body == nil || r.Body == http.NoBody) {
				return &placedFencedError{node: key, why: res.Header.Get(HeaderFenced)}
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var op *net.OpError
			var fenced *placedFencedError
			if next, ok := r.Context().Value(fallbackKey{}).(http.Handler); ok && (errors.As(err, &op) && op.Op == "dial" || errors.As(err, &fenced)) {
				f.s.log.Warn("cluster: the placed node does not take the call; serving here", "node", key, "path", r.URL.Path, "err", err)
				if r.GetBody != nil {
					r.Body, _ = r.GetBody()
				}
				next.ServeHTTP(w, r)
				return
			}
			f.s.log.Warn("cluster: forward", "node", key, "path", r.URL.Path, "err", err)
			w.Header().Set("Retry-After", strconv.Itoa(int(node.HeartbeatInterval/time.Second)))
			var silent *silentNodeError
			if errors.As(context.Cause(r.Context()), &silent) {
				// Hung or gone: within the lease time it counts as lost and
				// its sandboxes resume elsewhere.
				writeError(w, http.StatusBadGateway, apiv1.CodeBadGateway,
					fmt.Sprintf("%s %s: forwarded to %s, which did not answer: %v; retry: it counts as lost %s after its last heartbeat and its sandboxes resume on another node",
						r.Method, r.URL.Path, key, silent, node.LeaseTime))
				return
			}
			if n, ok := f.nodeAt(context.WithoutCancel(r.Context()), key); ok && errors.As(err, &op) && op.Op == "dial" {
				// Gone just now, or never reachable at that URL (it then
				// heartbeats on and is never declared lost).
				writeError(w, http.StatusBadGateway, apiv1.CodeBadGateway,
					fmt.Sprintf("%s %s: node %s does not answer at its advertised URL %s from node %s: %v; its last heartbeat was %s ago: if it went down, it counts as lost %s after that and its sandboxes resume on another node (retry); if it keeps heartbeating, its --advertise URL is wrong or cannot be reached from the other nodes",
						r.Method, r.URL.Path, n.Name, key, self, err, time.Since(n.HeartbeatAt).Round(time.Second), node.LeaseTime))
				return
			}
			// The owner is down or cut off: within the lease time it counts
			// as lost and its sandboxes resume elsewhere, so a retry is the
			// remedy.
			writeError(w, http.StatusBadGateway, apiv1.CodeBadGateway,
				fmt.Sprintf("%s %s: forwarding to node %s: %v; retry: a node that stays unreachable counts as lost after %s and its sandboxes resume on another node",
					r.Method, r.URL.Path, key, err, node.LeaseTime))
		},
	}
	if f.proxies == nil {
		f.proxies = map[string]*httputil.ReverseProxy{}
	}
	f.proxies[key] = p
	return p
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
	every(node.HeartbeatInterval, stop, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		s.clusterTick(ctx)
		cancel()
	})
}

// every calls f every period until stop is closed.
func every(period time.Duration, stop <-chan struct{}, f func()) {
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		f()
	}
}

func (s *Server) clusterTick(ctx context.Context) {
	if s.fence.lockTaken() {
		return // not this node any more (nodeLockTaken)
	}
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
