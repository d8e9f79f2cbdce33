package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// maxBody bounds a control-plane request body (1 MiB).
const maxBody = 1 << 20

// Register adds E2B's control-plane routes to mux. Every route checks the
// caller's X-API-KEY first. None of E2B's paths (/sandboxes…, /v2/sandboxes…,
// /snapshots, /templates/…) is under torpor's /v1/, so both APIs share one
// mux; a path under /sandboxes/ or /v2/ that no route serves is answered 404
// in E2B's form, and the calls of features torpor does not serve yet 501
// naming the feature (see unsupported).
func (s *Service) Register(mux *http.ServeMux) {
	routes := map[string]http.HandlerFunc{
		"POST /v2/sandboxes":              s.create,
		"POST /sandboxes":                 s.create,
		"GET /v2/sandboxes":               s.list,
		"GET /sandboxes":                  s.listRunning,
		"GET /sandboxes/{id}":             s.info,
		"DELETE /sandboxes/{id}":          s.kill,
		"POST /sandboxes/{id}/timeout":    s.setTimeout,
		"POST /sandboxes/{id}/pause":      s.pause,
		"POST /v2/sandboxes/{id}/connect": s.connect,
		"POST /sandboxes/{id}/connect":    s.connect,
		"POST /sandboxes/{id}/resume":     s.connect,
		"POST /sandboxes/{id}/snapshots":  s.createSnapshot,
		"GET /snapshots":                  s.listSnapshots,
		"DELETE /templates/{id}":          s.deleteSnapshot,
		"POST /sandboxes/{id}/fork":       s.fork,
		"GET /sandboxes/{id}/metrics":     s.metrics,
	}
	for pattern, h := range routes {
		mux.Handle(pattern, s.authorized(h))
	}
	unknown := s.authorized(func(w http.ResponseWriter, r *http.Request) {
		replyError(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
	for _, prefix := range []string{"/sandboxes/", "/v2/"} {
		mux.Handle(prefix, unknown)
	}
	for _, u := range unsupported {
		msg := u.feature + " are not supported by this server yet: " + u.instead + " (docs/e2b.md)"
		for _, pattern := range u.patterns {
			mux.Handle(pattern, s.authorized(func(w http.ResponseWriter, r *http.Request) {
				replyError(w, http.StatusNotImplemented, fmt.Sprintf("%s %s: %s", r.Method, r.URL.Path, msg))
			}))
		}
	}
}

// unsupported are E2B's calls of features torpor does not serve yet, by the
// mux patterns that catch them (every method), with what to do instead.
// DELETE /templates/{id} (deleteSnapshot) is served.
var unsupported = []struct {
	feature  string
	patterns []string
	instead  string
}{
	{"template builds", []string{"/v3/", "/v2/templates", "/v2/templates/", "/templates", "/templates/"},
		"build an image with `torpor image build` or take a snapshot (createSnapshot), and name it as the templateID"},
	{"network rules", []string{"/sandboxes/{id}/network"}, "sandboxes have no internet access"},
	{"volumes", []string{"/volumes", "/volumes/"}, "torpor's own API mounts host directories (volumes in a create of /v1/sandboxes)"},
}

// authorized checks X-API-KEY with the server's key verifier before h (when
// the server requires keys): a missing or unknown key is 401, which the SDKs
// raise as AuthenticationError; too many refused attempts from one address
// 429 with Retry-After (SDK 2.51 retries after it); a key store that cannot
// answer 503.
func (s *Service) authorized(h http.HandlerFunc) http.Handler {
	if s.cfg.Keys == nil {
		return h
	}
	return s.cfg.Keys.Require(h, apikey.FromXAPIKey, func(w http.ResponseWriter, r *http.Request, err error) {
		status, retry, msg := apikey.Deny(err)
		if status == http.StatusServiceUnavailable {
			s.log.Error("e2b: API key check failed", "method", r.Method, "path", r.URL.Path, "err", err)
		}
		if retry > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(retry.Seconds()))))
		}
		replyError(w, status, msg+" ("+HeaderAPIKey+", E2B_API_KEY)")
	})
}

// decodeBody reads a JSON object body into v (a pointer to a wire struct).
// An empty body leaves v as it is when allowEmpty. Every field the wire type
// names must have its JSON type (else invalid argument naming the field, as
// E2B's request validation answers); top-level fields it does not name are
// ignored, as E2B's server does (a newer SDK may send more), and logged.
func (s *Service) decodeBody(r *http.Request, v any, allowEmpty bool) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return invalid("reading body: %v", err)
	}
	if len(b) > maxBody {
		return invalid("body over %d bytes", maxBody)
	}
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		if allowEmpty {
			return nil
		}
		return invalid("empty body; a JSON object is required")
	}
	if b[0] != '{' {
		return invalid("the body must be a JSON object")
	}
	if err := json.Unmarshal(b, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return invalid("body field %s: a JSON %s where %s is wanted", te.Field, te.Value, jsonKind(te.Type))
		}
		return invalid("malformed JSON body: %v", err)
	}
	if un := unknownFields(b, v); len(un) > 0 {
		s.log.Info("e2b: ignoring body fields this server does not know", "method", r.Method, "path", r.URL.Path, "fields", un)
	}
	return nil
}

// jsonKind names the JSON type that decodes into t.
func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return fmt.Sprintf("an integer (%s)", t.Kind())
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.Pointer:
		return jsonKind(t.Elem())
	}
	return t.String()
}

// unknownFields are the top-level keys of the JSON object b that the struct
// v points to has no field for, sorted.
func unknownFields(b []byte, v any) []string {
	var top map[string]json.RawMessage
	if json.Unmarshal(b, &top) != nil {
		return nil
	}
	known := map[string]bool{}
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for f := range t.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			switch {
			case f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct:
				walk(f.Type)
			case name == "":
				known[strings.ToLower(f.Name)] = true
			case name != "-":
				known[strings.ToLower(name)] = true
			}
		}
	}
	walk(reflect.TypeOf(v).Elem())
	var out []string
	for k := range top {
		// encoding/json matches names without regard to case.
		if !known[strings.ToLower(k)] {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// seconds turns a time to live into torpor's timeout_s: whole seconds, at
// least 1 (a setTimeout of 0 ends the sandbox at once in E2B; torpor's
// timeout_s 0 means none, so it ends at the next lifecycle check instead,
// within a second).
func seconds(d time.Duration) int { return max(1, int(d/time.Second)) }

func (s *Service) create(w http.ResponseWriter, r *http.Request) {
	var req NewSandbox
	if err := s.decodeBody(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	sb, err := s.createSandbox(r.Context(), req)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	reply(w, http.StatusCreated, s.answer(sb))
}

func (s *Service) createSandbox(ctx context.Context, req NewSandbox) (sandbox.Sandbox, error) {
	if un := req.Unsupported(); len(un) > 0 {
		return sandbox.Sandbox{}, invalid("not supported by this server: %s (docs/e2b.md)", strings.Join(un, ", "))
	}
	ttl, err := req.TTL()
	if err != nil {
		return sandbox.Sandbox{}, invalid("%v", err)
	}
	internet, allowOut, denyOut, err := req.Egress()
	if err != nil {
		return sandbox.Sandbox{}, invalid("%v", err)
	}
	idle := 0
	resume := req.ResumesOnRequest()
	spec := sandbox.Spec{
		Env: req.EnvVars, Metadata: req.Metadata, IdleTimeoutS: &idle, TimeoutS: seconds(ttl),
		OnTimeout: sandbox.OnTimeoutDelete, HibernationMode: sandbox.ModeMemory, ResumeOnRequest: &resume,
		InternetAccess: internet, AllowOut: allowOut, DenyOut: denyOut, PrivateTraffic: !req.PublicTraffic(),
	}
	if req.PausesOnTimeout() {
		spec.OnTimeout = sandbox.OnTimeoutHibernate
		if !req.KeepsMemoryOnPause() {
			spec.HibernationMode = sandbox.ModeFilesystem
		}
	}
	tmpl := req.TemplateID
	if tmpl == "" || tmpl == DefaultTemplate {
		spec.Image = s.cfg.BaseImage
		return s.cfg.Manager.Create(ctx, spec)
	}
	// A snapshot's id, an image's name or digest (a built-in image is built on
	// first use), a snapshot's name: in that order.
	if strings.HasPrefix(tmpl, "snap-") {
		if snap, err := s.cfg.Manager.GetKeptSnapshot(ctx, tmpl); err == nil {
			return s.cfg.Manager.StartFromSnapshot(ctx, snap.ID, spec)
		}
	}
	if _, _, err := s.cfg.Images.Get(ctx, tmpl); err == nil || image.IsBuiltin(tmpl) {
		spec.Image = tmpl
		return s.cfg.Manager.Create(ctx, spec)
	} else if !errors.Is(err, image.ErrNotFound) && !errors.Is(err, image.ErrInvalid) {
		return sandbox.Sandbox{}, err
	}
	if snap, err := s.cfg.Manager.GetKeptSnapshot(ctx, tmpl); err == nil {
		return s.cfg.Manager.StartFromSnapshot(ctx, snap.ID, spec)
	}
	return sandbox.Sandbox{}, sandbox.Errorf(sandbox.NotFound,
		"template %q not found: name one of this server's images (name or sha256 digest) or a snapshot (id or name)", tmpl)
}

// answer is the create, connect and fork answer for sb: with its
// trafficAccessToken when its traffic is not public (E2B gives it in these
// answers only, not in info or list).
func (s *Service) answer(sb sandbox.Sandbox) Sandbox {
	a := Sandbox{TemplateID: s.templateOf(sb), SandboxID: sb.ID, ClientID: ClientID, EnvdVersion: EnvdVersion,
		EnvdAccessToken: s.AccessToken(sb.ID), Domain: s.domain()}
	if sb.Network.PrivateTraffic {
		tok := s.TrafficToken(sb.ID)
		a.TrafficAccessToken = &tok
	}
	return a
}

func (s *Service) domain() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

// templateOf is the templateID a sandbox reports: "base" for the base image,
// else the image name it was created with.
func (s *Service) templateOf(sb sandbox.Sandbox) string {
	if sb.Image == s.cfg.BaseImage {
		return DefaultTemplate
	}
	return sb.Image
}

// stateOf maps torpor's state to E2B's: running (and creating) is running;
// paused, hibernating, hibernated and resuming are paused. A sandbox in state
// error has no E2B state (ok false).
func stateOf(st sandbox.State) (State, bool) {
	switch st {
	case sandbox.StateRunning, sandbox.StateCreating:
		return StateRunning, true
	case sandbox.StatePaused, sandbox.StateHibernating, sandbox.StateHibernated, sandbox.StateResuming:
		return StatePaused, true
	}
	return "", false
}

// noTimeout is how far endAt lies for a sandbox without a run timeout (one
// made through torpor's own API).
const noTimeout = 100 * 365 * 24 * time.Hour

func (s *Service) listed(sb sandbox.Sandbox, now time.Time) ListedSandbox {
	st, _ := stateOf(sb.State)
	end := sb.CreatedAt.Add(noTimeout)
	if sb.TimeoutS > 0 {
		end = now.Add(time.Duration(sb.TimeoutLeftS * float64(time.Second))).Truncate(time.Millisecond)
	}
	return ListedSandbox{
		TemplateID: s.templateOf(sb), SandboxID: sb.ID, ClientID: ClientID, StartedAt: sb.CreatedAt, EndAt: end,
		CPUCount: int32(math.Ceil(sb.CPUs)), MemoryMB: int32(sb.MemoryMiB),
		// The writable layer lives in the sandbox's memory.
		DiskSizeMB: int32(manager.WritableMiB(sb.MemoryMiB)), Metadata: sb.Metadata, State: st, EnvdVersion: EnvdVersion,
	}
}

func (s *Service) detail(sb sandbox.Sandbox) SandboxDetail {
	internet := sb.Network.InternetAccess
	on := OnTimeoutKill
	if sb.OnTimeout == sandbox.OnTimeoutHibernate && sb.Hibernation.Mode != sandbox.ModeNone {
		on = OnTimeoutPause
	}
	public := !sb.Network.PrivateTraffic
	return SandboxDetail{ListedSandbox: s.listed(sb, time.Now()), EnvdAccessToken: s.AccessToken(sb.ID),
		AllowInternetAccess: &internet, Domain: s.domain(), Network: &Network{AllowPublicTraffic: &public},
		Lifecycle: &Lifecycle{AutoResume: sb.ResumeOnRequest, OnTimeout: on}}
}

// get returns sandbox id as E2B sees it: one in state error is not found.
func (s *Service) get(ctx context.Context, id string) (sandbox.Sandbox, error) {
	sb, err := s.cfg.Manager.Get(ctx, id)
	if err != nil {
		return sb, err
	}
	return sb, known(id, sb.State, sb.Error)
}

// known is the error of get for a sandbox in state st (errMsg: why it is in
// state error): nil for a state E2B knows, else sandbox.ErrNotFound.
func known(id string, st sandbox.State, errMsg string) error {
	if _, ok := stateOf(st); !ok {
		return sandbox.Errorf(sandbox.NotFound, "sandbox %q is in state error (%s): kill it", id, errMsg)
	}
	return nil
}

func (s *Service) info(w http.ResponseWriter, r *http.Request) {
	sb, err := s.get(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	reply(w, http.StatusOK, s.detail(sb))
}

// queryOf is r's query, parsed strictly: a parameter whose name or value is
// not URL-decodable is an invalid-argument error naming it (r.URL.Query()
// would drop it, and a filter the caller set would silently match all).
func queryOf(r *http.Request) (url.Values, error) {
	q := url.Values{}
	for _, pair := range strings.Split(r.URL.RawQuery, "&") {
		if pair == "" {
			continue
		}
		rawKey, rawValue, _ := strings.Cut(pair, "=")
		key, err := url.QueryUnescape(rawKey)
		if err != nil {
			return nil, invalid("query parameter %q: %v", rawKey, err)
		}
		value, err := url.QueryUnescape(rawValue)
		if err != nil {
			return nil, invalid("query parameter %s=%q: %v", key, rawValue, err)
		}
		q.Add(key, value)
	}
	return q, nil
}

// listQuery is the ListQuery of r; errors are invalid-argument ones naming
// the parameter.
func listQuery(r *http.Request) (url.Values, ListQuery, error) {
	q, err := queryOf(r)
	if err != nil {
		return nil, ListQuery{}, err
	}
	lq, err := ParseListQuery(q)
	if err != nil {
		return nil, ListQuery{}, invalid("%v", err)
	}
	return q, lq, nil
}

func (s *Service) list(w http.ResponseWriter, r *http.Request) {
	_, q, err := listQuery(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	s.answerList(w, r, q)
}

// listRunning is the list of SDKs before /v2/sandboxes: running sandboxes
// unless the query names states.
func (s *Service) listRunning(w http.ResponseWriter, r *http.Request) {
	raw, q, err := listQuery(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if raw.Get("state") == "" {
		q.States = []State{StateRunning}
	}
	s.answerList(w, r, q)
}

func (s *Service) answerList(w http.ResponseWriter, r *http.Request, q ListQuery) {
	all, err := s.cfg.Manager.List(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	now := time.Now()
	var out []ListedSandbox
	for _, sb := range all {
		st, ok := stateOf(sb.State)
		if !ok || !slices.Contains(q.States, st) || (!q.StartedAfter.IsZero() && !sb.CreatedAt.After(q.StartedAfter)) {
			continue
		}
		if q.Template != "" && q.Template != s.templateOf(sb) && q.Template != sb.ImageDigest {
			continue
		}
		if !hasAll(sb.Metadata, q.Metadata) {
			continue
		}
		out = append(out, s.listed(sb, now))
	}
	desc := q.Order != "asc"
	// Manager.List is oldest first (creation time, then id).
	if desc {
		slices.Reverse(out)
	}
	page, next, err := paginate(out, func(l ListedSandbox) cursor { return cursor{l.StartedAt, l.SandboxID} }, desc, q.Limit, q.NextToken)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set(HeaderNextToken, next)
	}
	if page == nil {
		page = []ListedSandbox{}
	}
	reply(w, http.StatusOK, page)
}

// hasAll says whether md has every pair of want.
func hasAll(md, want map[string]string) bool {
	for k, v := range want {
		if got, ok := md[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (s *Service) kill(w http.ResponseWriter, r *http.Request) {
	if err := s.cfg.Manager.Delete(r.Context(), r.PathValue("id")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Service) setTimeout(w http.ResponseWriter, r *http.Request) {
	var req TimeoutRequest
	if err := s.decodeBody(r, &req, false); err != nil {
		s.fail(w, r, err)
		return
	}
	ttl, err := req.TTL()
	if err != nil {
		s.fail(w, r, invalid("%v", err))
		return
	}
	if _, err := s.get(r.Context(), r.PathValue("id")); err != nil {
		s.fail(w, r, err)
		return
	}
	secs := seconds(ttl)
	if _, err := s.cfg.Manager.Update(r.Context(), r.PathValue("id"), sandbox.PolicyUpdate{TimeoutS: &secs}); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Service) pause(w http.ResponseWriter, r *http.Request) {
	var req PauseRequest
	if err := s.decodeBody(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	id := r.PathValue("id")
	sb, err := s.get(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if st, _ := stateOf(sb.State); st == StatePaused && sb.State != sandbox.StateResuming {
		replyError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is already paused", id))
		return
	}
	// pause({keepMemory: false}) hibernates in mode filesystem; the sandbox's
	// own mode (what a timeout pause keeps) is set back afterwards.
	mode := sandbox.ModeMemory
	if !req.KeepsMemory() {
		mode = sandbox.ModeFilesystem
	}
	if mode != sb.Hibernation.Mode {
		if _, err := s.cfg.Manager.Update(r.Context(), id, sandbox.PolicyUpdate{HibernationMode: &mode}); err != nil {
			s.fail(w, r, err)
			return
		}
		defer func() {
			back := sb.Hibernation.Mode
			_, _ = s.cfg.Manager.Update(context.WithoutCancel(r.Context()), id, sandbox.PolicyUpdate{HibernationMode: &back})
		}()
	}
	if n := s.cutEnvd(id); n > 0 {
		s.log.Debug("pause: cut envd connections", "sandbox", id, "connections", n)
	}
	_, unchanged, err := s.cfg.Manager.HibernateCall(r.Context(), id, manager.HibernateOptions{})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if unchanged {
		replyError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is already paused", id))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Service) connect(w http.ResponseWriter, r *http.Request) {
	var req ConnectRequest
	if err := s.decodeBody(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	ttl, err := req.TTL()
	if err != nil {
		s.fail(w, r, invalid("%v", err))
		return
	}
	id := r.PathValue("id")
	sb, err := s.cfg.Manager.Get(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if !req.KeepsMemory() && sb.State == sandbox.StateHibernated && sb.Hibernation.Mode != sandbox.ModeFilesystem {
		s.fail(w, r, invalid("memory false (resume as a reboot) is not supported for sandbox %s, paused with its memory: connect resumes it with its memory", id))
		return
	}
	sb, unchanged, err := s.cfg.Manager.ResumeCall(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	// A sandbox that connect resumed ends now + timeout (E2B sets the timeout
	// on resume); a running one keeps the later of its end and now + timeout
	// (E2B: "the timeout will update only if the new timeout is longer"). A
	// sandbox without an end (made through torpor's own API with no timeout)
	// keeps none: connect never gives a sandbox an end it did not have.
	if secs := seconds(ttl); sb.TimeoutS != 0 && (!unchanged || float64(secs) > sb.TimeoutLeftS) {
		if sb, err = s.cfg.Manager.Update(r.Context(), id, sandbox.PolicyUpdate{TimeoutS: &secs}); err != nil {
			s.fail(w, r, err)
			return
		}
	}
	status := http.StatusCreated
	if unchanged {
		status = http.StatusOK
	}
	reply(w, status, s.answer(sb))
}

func (s *Service) createSnapshot(w http.ResponseWriter, r *http.Request) {
	var req SnapshotRequest
	if err := s.decodeBody(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	if strings.HasPrefix(req.Name, "snap-") {
		s.fail(w, r, invalid("snapshot name %q: must not start with snap- (snapshot ids do)", req.Name))
		return
	}
	if _, err := s.get(r.Context(), r.PathValue("id")); err != nil {
		s.fail(w, r, err)
		return
	}
	snap, err := s.cfg.Manager.KeepSnapshot(r.Context(), r.PathValue("id"), req.Name)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	reply(w, http.StatusCreated, snapshotInfo(snap))
}

func snapshotInfo(snap sandbox.KeptSnapshot) SnapshotInfo {
	names := []string{}
	if snap.Name != "" {
		names = append(names, snap.Name)
	}
	return SnapshotInfo{SnapshotID: snap.ID, Names: names}
}

func (s *Service) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q, err := queryOf(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	limit := DefaultListLimit
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxListLimit {
			s.fail(w, r, invalid("limit %q: want 1 to %d", v, MaxListLimit))
			return
		}
		limit = n
	}
	all, err := s.cfg.Manager.ListKeptSnapshots(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	var kept []sandbox.KeptSnapshot
	for _, snap := range all {
		if (q.Get("sandboxID") == "" || snap.SandboxID == q.Get("sandboxID")) && (q.Get("name") == "" || snap.Name == q.Get("name")) {
			kept = append(kept, snap)
		}
	}
	slices.Reverse(kept) // newest first
	page, next, err := paginate(kept, func(k sandbox.KeptSnapshot) cursor { return cursor{k.CreatedAt, k.ID} }, true, limit, q.Get("nextToken"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set(HeaderNextToken, next)
	}
	out := []SnapshotInfo{}
	for _, snap := range page {
		out = append(out, snapshotInfo(snap))
	}
	reply(w, http.StatusOK, out)
}

func (s *Service) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	snap, err := s.cfg.Manager.GetKeptSnapshot(r.Context(), r.PathValue("id"))
	if err == nil {
		err = s.cfg.Manager.DeleteKeptSnapshot(r.Context(), snap.ID)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Service) fork(w http.ResponseWriter, r *http.Request) {
	var req ForkRequest
	if err := s.decodeBody(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	n, err := req.N()
	if err != nil {
		s.fail(w, r, invalid("%v", err))
		return
	}
	ttl, err := req.TTL()
	if err != nil {
		s.fail(w, r, invalid("%v", err))
		return
	}
	id := r.PathValue("id")
	if _, err := s.get(r.Context(), id); err != nil {
		s.fail(w, r, err)
		return
	}
	clones, err := s.cfg.Manager.Fork(r.Context(), id, n)
	if len(clones) == 0 {
		s.fail(w, r, err)
		return
	}
	secs := seconds(ttl)
	out := make([]ForkResult, len(clones))
	for i, c := range clones {
		if c.State == sandbox.StateRunning {
			if c, err = s.cfg.Manager.Update(context.WithoutCancel(r.Context()), c.ID, sandbox.PolicyUpdate{TimeoutS: &secs}); err == nil {
				a := s.answer(c)
				out[i] = ForkResult{Sandbox: &a}
				continue
			}
		} else {
			err = fmt.Errorf("fork %d of %s (%s) did not start: %s", i+1, id, c.ID, c.Error)
		}
		out[i] = ForkResult{Error: &Error{Code: StatusOf(err), Message: err.Error()}}
	}
	reply(w, http.StatusCreated, out)
}

// cpuWindow is how long a metrics call meters a sandbox's CPU use.
const cpuWindow = 200 * time.Millisecond

func (s *Service) metrics(w http.ResponseWriter, r *http.Request) {
	q, err := queryOf(r)
	var win MetricsWindow
	if err == nil {
		if win, err = ParseMetricsWindow(q); err != nil {
			err = invalid("%v", err)
		}
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	id := r.PathValue("id")
	sb, err := s.get(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	// A paused sandbox uses nothing; no sample is kept, so a window that
	// ends before now has none.
	if sb.State != sandbox.StateRunning || !win.Holds(time.Now().Truncate(time.Second)) {
		reply(w, http.StatusOK, []Metric{})
		return
	}
	a, err := s.cfg.Manager.Sample(r.Context(), id)
	if err == nil {
		time.Sleep(cpuWindow)
		var b sandbox.ResourceSample
		if b, err = s.cfg.Manager.Sample(r.Context(), id); err == nil {
			reply(w, http.StatusOK, []Metric{metricOf(sb, a, b)})
			return
		}
	}
	if errors.Is(err, sandbox.ErrConflict) { // paused meanwhile
		reply(w, http.StatusOK, []Metric{})
		return
	}
	s.fail(w, r, err)
}

// metricOf is the sample of sandbox sb from two readings a and b: CPU use
// between them in percent of its cores, memory and its limit at b. Disk is
// not metered: the writable layer is part of the sandbox's memory.
func metricOf(sb sandbox.Sandbox, a, b sandbox.ResourceSample) Metric {
	cores := math.Ceil(sb.CPUs)
	pct := 0.0
	if wall := b.At.Sub(a.At); wall > 0 && cores > 0 {
		pct = float64(b.CPUTime-a.CPUTime) / float64(wall) / cores * 100
	}
	at := b.At.Truncate(time.Second)
	return Metric{Timestamp: at, TimestampUnix: at.Unix(), CPUCount: int32(cores), CPUUsedPct: float32(math.Round(pct*100) / 100),
		MemUsed: b.MemoryBytes, MemTotal: b.MemoryLimitBytes, DiskTotal: int64(manager.WritableMiB(int(b.MemoryLimitBytes>>20))) << 20}
}
