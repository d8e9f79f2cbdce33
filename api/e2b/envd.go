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
)

// serveEnvd forwards an envd request (the SDK's own paths: "/files",
// "/process.Process/Start", …) to sandbox id's guest agent, which serves envd.
// The connection is made by the manager's DialAgent (it wakes a hibernated
// sandbox that resumes on request and connects after the resume contract);
// agentclient.EnvdTransport rewrites the path with proto.EnvdPath and keeps
// the query. Answers are flushed as they come (Connect's server streams).
//
// Each request has its own transport, whose connections are closed when the
// answer is done: an open connection to the agent counts as a request in
// flight and would hold a hibernate until its drain ends.
//
// The connections are kept in s.envd until closed, so that pause can cut
// them (cutEnvd).
//
// Errors are E2B's {"code", "message"} (an RPC's in its protocol, see
// refuse): 501 (unimplemented) when the sandbox's agent predates envd (a
// sandbox made or hibernated by an older torpor), else failInSandbox's.
func (s *Service) serveEnvd(w http.ResponseWriter, r *http.Request, id string) {
	tr := agentclient.NewEnvdTransport(func(ctx context.Context) (net.Conn, error) {
		c, err := s.cfg.Manager.DialAgent(ctx, id)
		if err != nil {
			return nil, err
		}
		return s.envd.add(id, c), nil
	})
	defer tr.CloseIdleConnections()
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
		Transport:     tr,
		FlushInterval: -1,
		// A stream cut by pause or a hibernate is not worth more than a debug line.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, agentclient.ErrNoEnvd) {
				refuse(w, r, http.StatusNotImplemented, connect.CodeUnimplemented, fmt.Sprintf("%v; a sandbox made by this server's torpor serves envd (the commands, files and PTY of E2B's SDKs); torpor's own API still reaches this one", err))
				return
			}
			s.failInSandbox(w, r, err)
		},
	}
	rp.ServeHTTP(w, r)
}

// envdConns are the open connections of envd requests, by sandbox id.
type envdConns struct {
	mu sync.Mutex
	m  map[string]map[*envdConn]struct{}
}

// envdConn is a connection of envdConns; Close removes it.
type envdConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *envdConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}

// add keeps c as one of sandbox id's connections until it is closed.
func (e *envdConns) add(id string, c net.Conn) net.Conn {
	ec := &envdConn{Conn: c}
	ec.done = func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		delete(e.m[id], ec)
		if len(e.m[id]) == 0 {
			delete(e.m, id)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.m == nil {
		e.m = make(map[string]map[*envdConn]struct{})
	}
	if e.m[id] == nil {
		e.m[id] = make(map[*envdConn]struct{})
	}
	e.m[id][ec] = struct{}{}
	return ec
}

// cutEnvd closes every open envd connection of sandbox id and returns how
// many there were. pause calls it before hibernating: the streams E2B's SDKs
// keep open (a background command's output, a PTY, watchDir) never end on
// their own and would hold the hibernate for its whole drain
// (manager.HibernateDrain); E2B's own pause cuts them too, and the SDK
// re-attaches after connect (commands.connect). A request that dials in
// between is drained as any other.
func (s *Service) cutEnvd(id string) int {
	s.envd.mu.Lock()
	conns := make([]*envdConn, 0, len(s.envd.m[id]))
	for c := range s.envd.m[id] {
		conns = append(conns, c)
	}
	s.envd.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	return len(conns)
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
