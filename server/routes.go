package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
)

// maxJSONBody bounds request bodies that are JSON documents (1 MiB; an exec's
// stdin travels inside its JSON body, so it is bounded by this too).
const maxJSONBody = 1 << 20

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /v1/openapi.json", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(apiv1.OpenAPI)
	})
	mux.HandleFunc("POST /v1/sandboxes", s.createSandbox)
	mux.HandleFunc("GET /v1/sandboxes", s.listSandboxes)
	mux.HandleFunc("GET /v1/sandboxes/{id}", s.getSandbox)
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", s.deleteSandbox)
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", s.exec)
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", s.readFile)
	mux.HandleFunc("PUT /v1/sandboxes/{id}/files", s.writeFile)
	mux.HandleFunc("POST /v1/sandboxes/{id}/hibernate", s.hibernate)
	mux.HandleFunc("POST /v1/sandboxes/{id}/pause", s.pause)
	mux.HandleFunc("POST /v1/sandboxes/{id}/resume", s.resume)
	mux.HandleFunc("POST /v1/sandboxes/{id}/fork", s.fork)
	mux.HandleFunc("GET /v1/sandboxes/{id}/metrics", s.sandboxMetrics)
	mux.Handle("/v1/sandboxes/{id}/ports/{port}/{path...}", s.proxy())
	mux.Handle("/v1/sandboxes/{id}/ports/{port}", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, r.URL.Path+"/", http.StatusTemporaryRedirect)
	}))
	s.lifecycleRoutes(mux)
	s.snapshotRoutes(mux)
	s.poolRoutes(mux)
	s.nodeRoutes(mux)
	mux.HandleFunc("GET /v1/images", s.listImages)
	mux.HandleFunc("POST /v1/images/build", s.buildImage)
	mux.HandleFunc("POST /v1/images/import", s.importImage)
	s.e2b.Register(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if allow := allowedMethods(mux, r); len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			writeError(w, http.StatusMethodNotAllowed, apiv1.CodeMethodNotAllowed,
				fmt.Sprintf("%s %s: method not allowed; this path takes %s", r.Method, r.URL.Path, strings.Join(allow, ", ")))
			return
		}
		writeError(w, http.StatusNotFound, apiv1.CodeNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
	return checkQuery(mux)
}

// queryParams are the query parameters of the /v1 routes that take any, by
// mux pattern; every other /v1 route takes none.
var queryParams = map[string][]string{
	"GET /v1/sandboxes/{id}/files": {"path"},
	"PUT /v1/sandboxes/{id}/files": {"path"},
	"POST /v1/images/import":       {"name", "replace"},
}

// checkQuery refuses, with 400 invalid_argument naming it, a /v1 call with a
// query parameter its route does not take, or one given more than once, so that one the route does not
// have (GET /v1/sandboxes?limit=10) is not silently ignored. The port proxy
// (/v1/sandboxes/{id}/ports/…) passes its query to the sandbox and is not
// checked; nor are routes outside /v1 (the E2B API checks its own).
func checkQuery(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.RawQuery == "" || !strings.HasPrefix(r.URL.Path, "/v1/") {
			mux.ServeHTTP(w, r)
			return
		}
		_, pattern := mux.Handler(r)
		if pattern == "/" || strings.Contains(pattern, "/ports/") {
			mux.ServeHTTP(w, r)
			return
		}
		q, err := url.ParseQuery(r.URL.RawQuery)
		if err != nil {
			writeError(w, http.StatusBadRequest, apiv1.CodeInvalidArgument, fmt.Sprintf("malformed query string: %v", err))
			return
		}
		allowed := queryParams[pattern]
		for _, name := range slices.Sorted(maps.Keys(q)) {
			if !slices.Contains(allowed, name) {
				takes := "no query parameters"
				if len(allowed) > 0 {
					takes = "only " + strings.Join(allowed, ", ")
				}
				writeError(w, http.StatusBadRequest, apiv1.CodeInvalidArgument,
					fmt.Sprintf("query parameter %q: %s %s takes %s", name, r.Method, r.URL.Path, takes))
				return
			}
			if len(q[name]) > 1 {
				writeError(w, http.StatusBadRequest, apiv1.CodeInvalidArgument,
					fmt.Sprintf("query parameter %q given %d times: %s %s takes it once", name, len(q[name]), r.Method, r.URL.Path))
				return
			}
		}
		mux.ServeHTTP(w, r)
	})
}

// allowedMethods returns the methods for which mux has a route (other than the
// catch-all "/") matching r's path: an unmatched request to such a path is 405
// Method Not Allowed (RFC 9110 §15.5.6), not 404.
func allowedMethods(mux *http.ServeMux, r *http.Request) []string {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		probe := &http.Request{Method: m, URL: r.URL, Host: r.Host, Header: http.Header{}}
		if _, pattern := mux.Handler(probe); pattern != "" && pattern != "/" {
			allow = append(allow, m)
		}
	}
	return allow
}

// errBodyTooLarge is a request body over maxJSONBody: 413.
var errBodyTooLarge = errors.New("body too large")

// invalidArgument is a request the server refuses before it reaches the
// manager (400).
func invalidArgument(format string, a ...any) error {
	return sandbox.Errorf(sandbox.InvalidArgument, format, a...)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: code, Message: msg}})
}

// kindStatus is the HTTP status and API code of each kind of sandbox.Error.
var kindStatus = map[sandbox.Kind]struct {
	status int
	code   string
}{
	sandbox.NotFound:            {http.StatusNotFound, apiv1.CodeNotFound},
	sandbox.InvalidArgument:     {http.StatusBadRequest, apiv1.CodeInvalidArgument},
	sandbox.Conflict:            {http.StatusConflict, apiv1.CodeConflict},
	sandbox.SnapshotCorrupt:     {http.StatusUnprocessableEntity, apiv1.CodeSnapshotCorrupt},
	sandbox.Unavailable:         {http.StatusServiceUnavailable, apiv1.CodeUnavailable},
	sandbox.InsufficientStorage: {http.StatusInsufficientStorage, apiv1.CodeInsufficientStorage},
}

// classify maps an error to its HTTP status and API code: a sandbox.Error by
// its Kind; the image store's and the snapshot store's own errors (the server
// calls the image store directly), the metadata store's record gone (404) or
// changed by another node (409) and ended contexts by what they mean;
// anything else is 500 internal.
func classify(err error) (int, string) {
	var se *sandbox.Error
	switch {
	case errors.Is(err, errBodyTooLarge):
		return http.StatusRequestEntityTooLarge, apiv1.CodeInvalidArgument
	case errors.As(err, &se) && se.Kind != sandbox.Internal:
		ks := kindStatus[se.Kind]
		return ks.status, ks.code
	case errors.Is(err, image.ErrNotFound), errors.Is(err, metadata.ErrNotFound):
		// metadata.ErrNotFound: a record another node deleted meanwhile.
		return http.StatusNotFound, apiv1.CodeNotFound
	case errors.Is(err, metadata.ErrStale):
		// A record another node changed meanwhile, under every retry of
		// the call's: the caller retries.
		return http.StatusConflict, apiv1.CodeConflict
	case errors.Is(err, image.ErrInvalid):
		return http.StatusBadRequest, apiv1.CodeInvalidArgument
	case errors.Is(err, chunked.ErrOwnedElsewhere):
		// The S3 prefix is another store's (found on the first write of a
		// server that started while S3 was down).
		return http.StatusConflict, apiv1.CodeConflict
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded), errors.Is(err, snapshot.ErrUnavailable):
		return http.StatusServiceUnavailable, apiv1.CodeUnavailable
	case manager.NoSpace(err):
		// A write to the data directory's disk that found it full outside
		// the manager's own checks (an image import, a create's files).
		return http.StatusInsufficientStorage, apiv1.CodeInsufficientStorage
	}
	return http.StatusInternalServerError, apiv1.CodeInternal
}

func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	if s.refer(r, err) {
		return
	}
	status, code := classify(err)
	switch {
	case r.Context().Err() != nil && errors.Is(err, context.Canceled):
		// The client went away (its connection closed): nothing failed here.
		s.log.Info("request ended by its client", "method", r.Method, "path", r.URL.Path, "err", err)
	case status >= 500 && manager.RetryAfterSeconds(err) == 0:
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	setRetryAfter(w, err)
	msg := err.Error()
	if status == http.StatusInsufficientStorage && !strings.Contains(msg, s.dataDir) && !errors.Is(err, manager.ErrSandboxFull) {
		// A write that found the disk full below the manager (the database,
		// an image import): the answer names the disk.
		msg = fmt.Sprintf("the data directory's disk is full (%s): %s; free space on that disk and try again", s.dataDir, msg)
	}
	writeError(w, status, code, msg)
}

// setRetryAfter sets Retry-After on the answer to a call that admission
// control refused (503: the host's memory is full).
func setRetryAfter(w http.ResponseWriter, err error) {
	if n := manager.RetryAfterSeconds(err); n > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(n))
	}
}

// decode reads a JSON object body into v: other JSON values (null, arrays),
// unknown fields, trailing data and bodies over 1 MiB are errors. An empty body
// leaves v as it is when allowEmpty.
func decode(r *http.Request, v any, allowEmpty bool) error {
	_, err := decodeBody(r, v, allowEmpty)
	return err
}

// decodeBody is decode that also returns the body's bytes.
func decodeBody(r *http.Request, v any, allowEmpty bool) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxJSONBody+1))
	if err != nil {
		return nil, invalidArgument("reading body: %v", err)
	}
	if len(b) > maxJSONBody {
		return nil, sandbox.Errorf(sandbox.InvalidArgument, "%w: %d bytes at most", errBodyTooLarge, maxJSONBody)
	}
	return b, decodeJSON(b, v, allowEmpty)
}

// decodeJSON is decode of the body b.
func decodeJSON(b []byte, v any, allowEmpty bool) error {
	if len(bytes.TrimSpace(b)) == 0 {
		if allowEmpty {
			return nil
		}
		return invalidArgument("empty body; a JSON object is required")
	}
	if bytes.TrimSpace(b)[0] != '{' { // `null` would decode as "no fields" (a trial's create)
		return invalidArgument("the body must be a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if name, raw, ok := badTimeField(b, v, err); ok {
			return invalidArgument("%s: want an RFC 3339 time as a JSON string (e.g. \"2030-01-02T15:04:05Z\"), not %s", name, raw)
		}
		return invalidArgument("malformed JSON body: %v", err)
	}
	// Anything but white space after the object is an error; More alone
	// passed a stray "}" or "]" ("{}}").
	if _, err := dec.Token(); err != io.EOF {
		return invalidArgument("malformed JSON body: data after the object")
	}
	return nil
}

// badTimeField names the field of the JSON object b that made decoding it
// into v (a pointer to a struct) fail with err, when err is time.Time's (a
// *time.ParseError, or the value not a JSON string), which names no field: the
// field's JSON name and its raw value, ok true. Only v's own fields of type
// time.Time or *time.Time are looked at, their names matched
// case-insensitively as encoding/json does.
func badTimeField(b []byte, v any, err error) (name string, raw json.RawMessage, ok bool) {
	var pe *time.ParseError
	if !errors.As(err, &pe) && !strings.HasPrefix(err.Error(), "Time.UnmarshalJSON") {
		return "", nil, false
	}
	t := reflect.TypeOf(v)
	if t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return "", nil, false
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(b, &fields) != nil {
		return "", nil, false
	}
	timeType := reflect.TypeFor[time.Time]()
	for _, f := range reflect.VisibleFields(t.Elem()) {
		if f.Type != timeType && f.Type != reflect.PointerTo(timeType) {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		for key, raw := range fields { // names match case-insensitively, as json's
			if !strings.EqualFold(key, name) || (f.Type.Kind() == reflect.Pointer && string(raw) == "null") {
				continue
			}
			var tm time.Time
			if json.Unmarshal(raw, &tm) != nil {
				return name, raw, true
			}
		}
	}
	return "", nil, false
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var req apiv1.CreateSandboxRequest
	body, err := decodeBody(r, &req, true)
	if err == nil {
		err = checkCreateZeros(body)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	s.serveIdempotent(w, r, body, idempotentCall{n: 1,
		run: func(ctx context.Context, ids []string) (int, any, error) {
			spec := specFromWire(req)
			if ids != nil {
				spec.ID = ids[0]
			}
			sb, err := s.Manager.Create(ctx, spec)
			return http.StatusCreated, wireSandbox(sb), err
		},
		view: func(ctx context.Context, ids []string) any {
			sb, _ := s.Manager.Get(ctx, ids[0])
			return wireSandbox(sb)
		}})
}

// checkCreateZeros refuses a create body that gives memory_mib, cpus or
// pids_limit as 0: absent means the default, and 0 given is more likely a
// caller's "unlimited" (as in other container tools) than a wish for it.
// The error names the field and its range.
func checkCreateZeros(body []byte) error {
	var given struct {
		MemoryMiB *int     `json:"memory_mib"`
		CPUs      *float64 `json:"cpus"`
		PidsLimit *int     `json:"pids_limit"`
	}
	if len(bytes.TrimSpace(body)) == 0 || json.Unmarshal(body, &given) != nil {
		return nil // decodeBody has judged the body
	}
	switch {
	case given.MemoryMiB != nil && *given.MemoryMiB == 0:
		return invalidArgument("memory_mib 0: must be between %d and %d; omit it for the default (%d)", manager.MinMemoryMiB, manager.MaxMemoryMiB, manager.DefaultMemoryMiB)
	case given.CPUs != nil && *given.CPUs == 0:
		return invalidArgument("cpus 0: must be between %g and %d; omit it for the default (%d)", manager.MinCPUs, manager.MaxCPUs, manager.DefaultCPUs)
	case given.PidsLimit != nil && *given.PidsLimit == 0:
		return invalidArgument("pids_limit 0: must be between %d and %d; there is no unlimited, omit it for the server's default", manager.MinPidsLimit, manager.MaxPidsLimit)
	}
	return nil
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	all, err := s.Manager.List(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.ListSandboxesResponse{Sandboxes: wireSandboxes(all)})
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	sb, err := s.Manager.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, wireSandbox(sb))
}

func (s *Server) deleteSandbox(w http.ResponseWriter, r *http.Request) {
	if err := s.Manager.Delete(r.Context(), r.PathValue("id")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) hibernate(w http.ResponseWriter, r *http.Request) {
	var req apiv1.HibernateRequest
	if err := decode(r, &req, true); err != nil {
		s.fail(w, r, err)
		return
	}
	sb, unchanged, err := s.Manager.HibernateCall(r.Context(), r.PathValue("id"), manager.HibernateOptions{AsyncUpload: req.AsyncUpload})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.HibernateResponse{Sandbox: wireSandbox(sb), Unchanged: unchanged})
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	if err := decode(r, &struct{}{}, true); err != nil { // no options: an empty body or {}
		s.fail(w, r, err)
		return
	}
	sb, unchanged, err := s.Manager.Pause(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.PauseResponse{Sandbox: wireSandbox(sb), Unchanged: unchanged})
}

// sandboxMetrics answers what a running or paused sandbox uses now
// (apiv1.SandboxMetrics); it wakes no sandbox.
func (s *Server) sandboxMetrics(w http.ResponseWriter, r *http.Request) {
	a, err := s.Manager.Sample(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.SandboxMetrics{At: a.At, State: string(a.State), CPUTimeS: a.CPUTime.Seconds(),
		MemoryBytes: a.MemoryBytes, MemoryLimitBytes: a.MemoryLimitBytes})
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	// No options: an empty body or {} (anything else is refused, as for
	// hibernate and fork, rather than ignored).
	if err := decode(r, &struct{}{}, true); err != nil {
		s.fail(w, r, err)
		return
	}
	sb, unchanged, err := s.Manager.ResumeCall(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.ResumeResponse{Sandbox: wireSandbox(sb), Unchanged: unchanged})
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	// An absent count means 1; an explicit 0 is out of range (OpenAPI: minimum 1).
	req := apiv1.ForkRequest{Count: 1}
	body, err := decodeBody(r, &req, true)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if req.Count < 1 || req.Count > manager.MaxForkCount {
		s.fail(w, r, invalidArgument("count %d: must be between 1 and %d", req.Count, manager.MaxForkCount))
		return
	}
	if req.Wait != "" && req.Wait != apiv1.ForkWaitAll && req.Wait != apiv1.ForkWaitFirst {
		s.fail(w, r, invalidArgument("wait %q: want %q (the default) or %q", req.Wait, apiv1.ForkWaitAll, apiv1.ForkWaitFirst))
		return
	}
	s.serveIdempotent(w, r, body, idempotentCall{n: req.Count,
		run: func(ctx context.Context, ids []string) (int, any, error) {
			out, err := s.Manager.Fork(ctx, r.PathValue("id"), req.Count, manager.ForkOptions{Volumes: req.Volumes, IDs: ids, First: req.Wait == apiv1.ForkWaitFirst})
			return http.StatusCreated, apiv1.ForkResponse{Sandboxes: wireSandboxes(out)}, err
		},
		view: func(ctx context.Context, ids []string) any {
			out := make([]sandbox.Sandbox, 0, len(ids))
			for _, id := range ids {
				if sb, err := s.Manager.Get(ctx, id); err == nil {
					out = append(out, sb)
				}
			}
			return apiv1.ForkResponse{Sandboxes: wireSandboxes(out)}
		}})
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	var req apiv1.ExecRequest
	if err := decode(r, &req, false); err != nil {
		s.fail(w, r, err)
		return
	}
	stream, err := s.Manager.Exec(r.Context(), r.PathValue("id"), sandbox.ExecRequest(req))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	defer stream.Close()
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	enc := json.NewEncoder(w)
	for {
		ev, err := stream.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			code := 255
			enc.Encode(apiv1.ExecEvent{Error: s.execCutMessage(r.Context(), r.PathValue("id"), err), ExitCode: &code})
			return
		}
		if err := enc.Encode(apiv1.ExecEvent(ev)); err != nil {
			return // the client went away; closing the stream kills the process
		}
		if fl != nil {
			fl.Flush()
		}
	}
}

// execCutMessage says why sandbox id's exec stream broke with err before the
// command's exit status, from the sandbox's state after the cut: the manager
// records a delete, a hibernate or the death of the sandbox's process before it
// closes the connections to the guest agent, so the state names the cause.
// Only a cut it cannot explain carries err's own text.
func (s *Server) execCutMessage(ctx context.Context, id string, err error) string {
	const prefix = "exec stream broken: "
	sb, gerr := s.Manager.Get(context.WithoutCancel(ctx), id)
	switch {
	case sandbox.KindOf(gerr) == sandbox.NotFound:
		return prefix + "the sandbox was deleted while the command ran"
	case gerr != nil:
	case sb.State == sandbox.StateHibernating || sb.State == sandbox.StateHibernated:
		return fmt.Sprintf(prefix+"cut by a hibernate of the sandbox after its %v drain; the command is ended when the sandbox resumes (run work that must outlive a hibernate with \"background\": true)", manager.HibernateDrain)
	case sb.State == sandbox.StateError:
		return prefix + "the sandbox stopped while the command ran and is in state error: " + sb.Error
	}
	return prefix + "the connection to the sandbox's guest agent ended before the command's exit status: " + err.Error()
}

func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	rc, n, err := s.Manager.ReadFile(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if n >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	}
	io.Copy(w, rc)
}

// What a refused upload reads of its body's rest before it answers (writeFile).
const (
	uploadDrainMax  = 4 << 30 // bytes
	uploadDrainWait = 5 * time.Second
)

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	if err := s.Manager.WriteFile(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"), r.Body, r.ContentLength); err != nil {
		if s.refer(r, err) {
			return // the owner gets the body, unread
		}
		// An upload cut short leaves its body unread. The rest is read and
		// dropped first (up to uploadDrainMax bytes, for up to
		// uploadDrainWait), so that a client still sending gets the answer
		// and not a connection reset mid-body (torpor cp of 200 MB into a
		// full sandbox said "cannot reach the server" 2 times in 3). A client
		// that sends nothing more is cut at the deadline; a read ended so
		// cancels the connection's context (net/http's connReader), and every
		// later request on it would start cancelled (503 "context canceled"
		// after a refused PUT, found by TestFileErrorsOfThePath): close it.
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Now().Add(uploadDrainWait))
		if n, derr := io.Copy(io.Discard, io.LimitReader(r.Body, uploadDrainMax)); derr != nil || n == uploadDrainMax {
			_ = rc.SetReadDeadline(time.Now())
			w.Header().Set("Connection", "close")
		}
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listImages(w http.ResponseWriter, r *http.Request) {
	imgs, err := s.Images.List(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if imgs == nil {
		imgs = []sandbox.Image{}
	}
	writeJSON(w, http.StatusOK, apiv1.ListImagesResponse{Images: wireImages(imgs)})
}

// lineWriter turns written text into {"log": line} events.
type lineWriter struct {
	enc *json.Encoder
	fl  http.Flusher
	buf []byte
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		line := strings.TrimRight(string(l.buf[:i]), "\r")
		l.buf = l.buf[i+1:]
		if line != "" {
			l.enc.Encode(apiv1.BuildEvent{Log: line})
			if l.fl != nil {
				l.fl.Flush()
			}
		}
	}
	return len(p), nil
}

func (s *Server) buildImage(w http.ResponseWriter, r *http.Request) {
	var req apiv1.BuildImageRequest
	if err := decode(r, &req, false); err != nil {
		s.fail(w, r, err)
		return
	}
	// Before the 200 of the build stream: a bad name or package, or a built-in
	// image's name (409), is the call's status.
	if err := image.CheckBuild(req.Name, req.Packages); err != nil {
		s.fail(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	enc := json.NewEncoder(w)
	lw := &lineWriter{enc: enc, fl: fl}
	img, err := s.Images.Build(r.Context(), req.Name, req.Packages, lw)
	if err != nil {
		_, code := classify(err)
		enc.Encode(apiv1.BuildEvent{Error: &apiv1.ErrorDetail{Code: code, Message: err.Error()}})
		return
	}
	wimg := apiv1.Image(img)
	enc.Encode(apiv1.BuildEvent{Image: &wimg})
}

func (s *Server) importImage(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("name")
	if !image.ValidName(name) {
		s.fail(w, r, invalidArgument("image name %q: must match [a-z0-9][a-z0-9._-]{0,62}", name))
		return
	}
	if r.URL.Query().Get("replace") != "true" {
		if ok, err := s.Images.Has(r.Context(), name); err == nil && ok {
			s.fail(w, r, sandbox.Errorf(sandbox.Conflict, "image %q exists; import with replace=true (torpor image import --replace) to point the name at the new image", name))
			return
		}
	}
	img, err := s.Images.Import(r.Context(), name, r.Body, io.Discard)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, apiv1.Image(img))
}

// proxy forwards /v1/sandboxes/{id}/ports/{port}/{path...} to port inside the
// sandbox (package ingress). The dial goes through the manager, which resumes a
// hibernated sandbox and waits out a hibernate or resume in progress, so such a
// request is answered once the sandbox runs.
func (s *Server) proxy() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		port, err := strconv.Atoi(r.PathValue("port"))
		if err != nil || port < 1 || port > 65535 {
			writeError(w, http.StatusBadRequest, apiv1.CodeInvalidArgument, fmt.Sprintf("port %q: must be a number between 1 and 65535", r.PathValue("port")))
			return
		}
		id := r.PathValue("id")
		if _, err := s.Manager.Get(r.Context(), id); err != nil {
			s.fail(w, r, err)
			return
		}
		if s.AuthRequired {
			// It carried torpor's API key, which is not the sandbox's.
			r.Header.Del("Authorization")
		}
		s.ingress.Serve(w, r, ingress.Target{
			Dial: func(ctx context.Context) (net.Conn, error) { return s.Manager.DialPort(ctx, id, port) },
			Path: "/" + r.PathValue("path"),
			Fail: s.failPortProxy,
		})
	})
}

// failPortProxy answers a port-proxy request that got no answer from the
// sandbox: 502 bad_gateway when nothing listens on the port (the dial failed)
// or the server there closed the connection without answering
// (ingress.ErrNoAnswer), logged as a warning; other errors as classify says,
// a 5xx logged as an error.
func (s *Server) failPortProxy(w http.ResponseWriter, r *http.Request, err error) {
	if s.refer(r, err) {
		return
	}
	status, code := classify(err)
	switch {
	case status == http.StatusInternalServerError && (isDialError(err) || errors.Is(err, ingress.ErrNoAnswer)):
		status, code = http.StatusBadGateway, apiv1.CodeBadGateway
		s.log.Warn("port proxy: no answer from the sandbox", "method", r.Method, "path", r.URL.Path, "err", err)
	case status >= 500 && manager.RetryAfterSeconds(err) == 0:
		s.log.Error("port proxy request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	setRetryAfter(w, err)
	writeError(w, status, code, err.Error())
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) || errors.Is(err, syscall.ECONNREFUSED)
}
