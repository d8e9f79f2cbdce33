package e2b

import (
	"context"
	"fmt"
	"net"
	"net/http"

	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/sandbox"
)

// Front routes in-sandbox requests and passes every other request to next
// (torpor's REST API and E2B's control plane). A request is in-sandbox when
// RouteOf finds a sandbox in it (E2b-Sandbox-Id and E2b-Sandbox-Port headers,
// or a Host "<port>-<sandboxID>.<Domain>"):
//
//   - port EnvdPort goes to the sandbox's envd (torpor's guest agent), and
//     must carry the sandbox's X-Access-Token (else 401);
//   - any other port reaches that port inside the sandbox, as torpor's port
//     proxy does.
//
// Both wake a paused sandbox that resumes on request (autoResume) and wait
// out a pause or resume in progress; a paused sandbox without autoResume is
// refused until connect resumes it. Answers are streamed frame by frame
// (Connect's server streams). Errors are E2B's {"code", "message"}: 400 for a
// malformed route, 502 for an unknown sandbox, a paused one without
// autoResume and a port nothing listens on (failInSandbox), 501 for envd when
// the sandbox's agent predates it (serveEnvd).
func (s *Service) Front(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		route, ok, err := RouteOf(r.Header, r.Host, s.cfg.Domain)
		if err != nil {
			replyError(w, http.StatusBadRequest, err.Error())
			return
		}
		if !ok {
			next.ServeHTTP(w, r)
			return
		}
		s.inSandbox(w, r, route)
	})
}

func (s *Service) inSandbox(w http.ResponseWriter, r *http.Request, route Route) {
	id := route.SandboxID
	if route.Port == EnvdPort && !s.tokenOK(id, r.Header.Get(HeaderAccessToken)) {
		replyError(w, http.StatusUnauthorized, fmt.Sprintf("sandbox %s: missing or wrong %s (the envdAccessToken of create or connect)", id, HeaderAccessToken))
		return
	}
	if _, err := s.get(r.Context(), id); err != nil {
		s.failInSandbox(w, r, err)
		return
	}
	// The routing headers and the token stay on this side.
	r.Header.Del(HeaderSandboxID)
	r.Header.Del(HeaderSandboxPort)
	r.Header.Del(HeaderAccessToken)
	if route.Port == EnvdPort {
		s.serveEnvd(w, r, id)
		return
	}
	port := route.Port
	s.cfg.Ingress.Serve(w, r, ingress.Target{
		Path: r.URL.Path,
		Dial: func(ctx context.Context) (net.Conn, error) { return s.cfg.Manager.DialPort(ctx, id, port) },
		Fail: s.failInSandbox,
	})
}

// failInSandbox answers an in-sandbox request that could not reach the
// sandbox. A sandbox that is unknown, or paused without autoResume, is 502
// with the reason in the message: E2B's own front answers 502 for a sandbox
// that is not running, and its SDKs read that status (isRunning is false,
// other calls raise the sandbox-not-running error, not a missing file's or an
// unimplemented method's). Other failures are answered as by fail.
func (s *Service) failInSandbox(w http.ResponseWriter, r *http.Request, err error) {
	if k := sandbox.KindOf(err); k == sandbox.NotFound || k == sandbox.Conflict {
		s.log.Debug("e2b: in-sandbox request to a sandbox not running", "path", r.URL.Path, "err", err)
		replyError(w, http.StatusBadGateway, err.Error())
		return
	}
	s.fail(w, r, err)
}
