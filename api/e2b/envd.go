package e2b

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"

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
// Errors are E2B's {"code", "message"}: 501 when the sandbox's agent predates
// envd (a sandbox made or hibernated by an older torpor), else StatusOf's.
func (s *Service) serveEnvd(w http.ResponseWriter, r *http.Request, id string) {
	tr := agentclient.NewEnvdTransport(func(ctx context.Context) (net.Conn, error) {
		return s.cfg.Manager.DialAgent(ctx, id)
	})
	defer tr.CloseIdleConnections()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			// The transport sets the path and ignores the host name.
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "envd"
			pr.SetXForwarded()
		},
		Transport:     tr,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, agentclient.ErrNoEnvd) {
				replyError(w, http.StatusNotImplemented, fmt.Sprintf("%v; a sandbox made by this server's torpor serves envd (the commands, files and PTY of E2B's SDKs); torpor's own API still reaches this one", err))
				return
			}
			s.fail(w, r, err)
		},
	}
	rp.ServeHTTP(w, r)
}
