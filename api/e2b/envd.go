package e2b

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"sync"

	"connectrpc.com/connect"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// serveEnvd forwards an envd request (the SDK's own paths: "/files",
// "/process.Process/Start", …) to sandbox id's guest agent, which serves envd.
// The manager's EnvdRoundTrip sends it (it checks the sandbox is reachable on
// the record it reads under the sandbox's lock, wakes a hibernated sandbox that
// resumes on request and sends after the resume contract), over the agent
// client's envd connections, kept alive between requests; an idle one holds
// no hibernate (EnvdRoundTrip counts a request in flight until its answer is
// done, not a connection). agentclient.EnvdTransport rewrites the path with
// proto.EnvdPath and keeps the query. Answers are flushed as they come
// (Connect's server streams, whose length is not known, and every other
// answer without a Content-Length).
//
// The request is kept in s.envd until its answer is done, so that pause can
// cut it (cutEnvd).
//
// Errors are E2B's {"code", "message"} (an RPC's in its protocol, see
// refuse): 501 (unimplemented) when the sandbox's agent predates envd (a
// sandbox made or hibernated by an older torpor), else failInSandbox's.
func (s *Service) serveEnvd(w http.ResponseWriter, r *http.Request, id string) {
	ctx, cancel := context.WithCancelCause(r.Context())
	defer s.envd.add(id, cancel)()
	check := func(st manager.RequestState) error { return reachable(id, st) }
	if isHealthProbe(r) {
		check = func(st manager.RequestState) error { return probed(id, st) }
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			// The transport sets the path and ignores the host name.
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "envd"
			if sameHost(pr.In) {
				// envd gzips GET /files when asked, and Node's fetch and
				// Python's httpx ask on every request. For a client on this
				// host that only spends the sandbox's CPU and the client's
				// (reading 1 MiB through E2B's JS SDK took twice as long):
				// the answer comes unencoded, which every client takes.
				pr.Out.Header.Del("Accept-Encoding")
			}
			pr.SetXForwarded()
		},
		Transport: roundTripper(func(req *http.Request) (*http.Response, error) {
			return s.cfg.Manager.EnvdRoundTrip(id, req, check)
		}),
		BufferPool: envdBuffers,
		// A stream cut by pause or a hibernate is not worth more than a debug line.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, agentclient.ErrNoEnvd) {
				refuse(w, r, http.StatusNotImplemented, connect.CodeUnimplemented, fmt.Sprintf("%v; a sandbox made by this server's torpor serves envd (the commands, files and PTY of E2B's SDKs); torpor's own API still reaches this one", err))
				return
			}
			if errors.Is(context.Cause(r.Context()), errEnvdCut) {
				// As when the connection itself was closed under it.
				refuse(w, r, http.StatusBadGateway, connect.CodeUnavailable, fmt.Sprintf("sandbox %s: %v", id, errEnvdCut))
				return
			}
			s.failInSandbox(w, r, err)
		},
	}
	rp.ServeHTTP(w, r.WithContext(ctx))
}

// isHealthProbe reports whether r is envd's GET /health: the SDKs' probe of
// whether a sandbox runs (Sandbox.isRunning, and the check they make after a
// stream was cut, to tell a killed sandbox from a dropped connection).
func isHealthProbe(r *http.Request) bool {
	return r.URL.Path == "/health" && (r.Method == http.MethodGet || r.Method == http.MethodHead)
}

// probed is reachable for a health probe: a probe never wakes a sandbox,
// autoResume or not. A paused sandbox (torpor's hibernated or paused) is
// sandbox.ErrConflict, which failInSandbox answers 502 (isRunning is false).
// A probe that races a pause waits on the sandbox's lock and then finds it
// paused: E2B's SDK sends one when pause cuts a background command's stream,
// and a probe that resumed the sandbox would undo the pause it asked for.
func probed(id string, st manager.RequestState) error {
	if err := known(id, st.State, st.Error); err != nil {
		return err
	}
	if st.State == sandbox.StateHibernated || st.State == sandbox.StatePaused {
		return sandbox.Errorf(sandbox.Conflict, "sandbox %s is paused; a health check does not resume it (Sandbox.connect or, with autoResume, any other request does)", id)
	}
	return nil
}

// roundTripper is an http.RoundTripper of a function.
type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// envdBufferSize is the size of the pieces serveEnvd copies an answer in (a
// file of GET /files, a stream's frames as they come).
const envdBufferSize = 256 << 10

// envdBuffers are serveEnvd's copy buffers, shared by its requests
// (httputil.BufferPool).
var envdBuffers = &bufferPool{sync.Pool{New: func() any { b := make([]byte, envdBufferSize); return &b }}}

type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte  { return *b.p.Get().(*[]byte) }
func (b *bufferPool) Put(x []byte) { b.p.Put(&x) }

// errEnvdCut is the cause of an envd request cut by cutEnvd.
var errEnvdCut = errors.New("the request was cut by a pause of the sandbox")

// envdCalls are the envd requests being forwarded, by sandbox id: each one's
// cancel, which cuts its connection to the agent.
type envdCalls struct {
	mu sync.Mutex
	m  map[string]map[*context.CancelCauseFunc]struct{}
}

// add keeps cancel as one of sandbox id's requests until the returned
// function forgets it (and cancels it: the request is done).
func (e *envdCalls) add(id string, cancel context.CancelCauseFunc) (forget func()) {
	key := &cancel
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.m == nil {
		e.m = make(map[string]map[*context.CancelCauseFunc]struct{})
	}
	if e.m[id] == nil {
		e.m[id] = make(map[*context.CancelCauseFunc]struct{})
	}
	e.m[id][key] = struct{}{}
	return func() {
		cancel(nil)
		e.mu.Lock()
		defer e.mu.Unlock()
		delete(e.m[id], key)
		if len(e.m[id]) == 0 {
			delete(e.m, id)
		}
	}
}

// cutEnvd cuts every envd request of sandbox id in flight (its connection to
// the agent is closed) and returns how many there were. pause calls it before
// hibernating: the streams E2B's SDKs keep open (a background command's
// output, a PTY, watchDir) never end on their own and would hold the
// hibernate for its whole drain (manager.HibernateDrain) when the agent is too
// old to end them itself (the hibernate's prepare step); E2B's own pause cuts
// them too, and the SDK re-attaches after connect (commands.connect). A
// request that arrives in between is drained as any other. Idle connections
// are not requests: the hibernate closes them.
func (s *Service) cutEnvd(id string) int {
	s.envd.mu.Lock()
	calls := make([]context.CancelCauseFunc, 0, len(s.envd.m[id]))
	for c := range s.envd.m[id] {
		calls = append(calls, *c)
	}
	s.envd.mu.Unlock()
	for _, cancel := range calls {
		cancel(errEnvdCut)
	}
	return len(calls)
}

// sameHost reports whether r comes straight from this host: a loopback peer
// and no X-Forwarded-For or Forwarded header (a reverse proxy on this host
// forwards clients from elsewhere).
func sameHost(r *http.Request) bool {
	if r.Header.Get("X-Forwarded-For") != "" || r.Header.Get("Forwarded") != "" {
		return false
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
