package e2b

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/manager"
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
//     proxy does; of a sandbox created with network.allowPublicTraffic false
//     only with its trafficAccessToken in HeaderTrafficToken, else 403 with a
//     TrafficRefusal, answered from the sandbox's record alone: the refused
//     request wakes nothing and changes nothing.
//
// Both wake a paused sandbox that resumes on request (autoResume) and wait
// out a pause or resume in progress; a paused sandbox without autoResume is
// refused until connect resumes it. Answers are streamed frame by frame
// (Connect's server streams). Refusals are E2B's {"code", "message"}: 400 for
// a malformed route, 502 for an unknown sandbox, a paused one without
// autoResume and a port nothing listens on (failInSandbox), 501 for envd when
// the sandbox's agent predates it (serveEnvd); a refused call of envd's RPC
// services is answered in its own protocol instead (refuse).
func (s *Service) Front(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		route, ok, err := RouteOf(r.Header, r.Host, s.cfg.Domain)
		if err != nil {
			refuse(w, r, http.StatusBadRequest, connect.CodeInvalidArgument, err.Error())
			return
		}
		if !ok && s.cfg.Domain == "" && namesSandboxHost(r.Host) {
			refuse(w, r, http.StatusNotFound, connect.CodeNotFound, fmt.Sprintf("host %q names a sandbox's port, but this server routes by host name only when started with `torpor serve --e2b-domain DOMAIN` (for hosts {port}-{id}.DOMAIN); or send the %s and %s headers (E2B_SANDBOX_URL)", r.Host, HeaderSandboxID, HeaderSandboxPort))
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
		refuse(w, r, http.StatusUnauthorized, connect.CodeUnauthenticated,
			fmt.Sprintf("sandbox %s: missing or wrong %s (the envdAccessToken of create or connect)", id, HeaderAccessToken))
		return
	}
	traffic := r.Header.Get(HeaderTrafficToken)
	// The routing headers, the tokens and an API key stay on this side.
	r.Header.Del(HeaderAPIKey)
	r.Header.Del(HeaderSandboxID)
	r.Header.Del(HeaderSandboxPort)
	r.Header.Del(HeaderAccessToken)
	r.Header.Del(HeaderTrafficToken)
	if route.Port == EnvdPort {
		// The manager checks the sandbox (reachable) on its record as it
		// reads it under the sandbox's lock, the request's one read of it.
		s.serveEnvd(w, r, id)
		return
	}
	// The sandbox's record alone (Get's views would cost several reads
	// more); the manager reads it again under the sandbox's lock.
	st, err := s.cfg.Manager.RequestStateOf(r.Context(), id)
	if err == nil {
		err = known(id, st.State, st.Error)
	}
	if err == nil && st.PrivateTraffic {
		// Checked before anything else of the sandbox: a refused request
		// wakes nothing and changes nothing.
		if msg, ok := s.trafficRefusal(id, traffic); !ok {
			s.log.Debug("e2b: in-sandbox request refused: traffic token", "sandbox", id, "port", route.Port, "why", msg)
			reply(w, http.StatusForbidden, TrafficRefusal{SandboxID: id, Message: msg, Code: http.StatusForbidden})
			return
		}
	}
	if err == nil {
		err = reachable(id, st)
	}
	if err != nil {
		s.failInSandbox(w, r, err)
		return
	}
	port := route.Port
	s.cfg.Ingress.Serve(w, r, ingress.Target{
		Path: r.URL.Path,
		Dial: func(ctx context.Context) (net.Conn, error) { return s.cfg.Manager.DialPort(ctx, id, port) },
		Fail: s.failInSandbox,
	})
}

// trafficRefusal checks the traffic token a request for a port of sandbox id
// (whose traffic is not public) carries: ok, or the refusal's message in
// E2B's words (the token missing, or wrong).
func (s *Service) trafficRefusal(id, token string) (msg string, ok bool) {
	switch {
	case token == "":
		return fmt.Sprintf("Sandbox is secured with traffic access token. Token header '%s' is missing", strings.ToLower(HeaderTrafficToken)), false
	case !s.trafficTokenOK(id, token):
		return "Sandbox is secured with traffic access token. Provided token is invalid.", false
	}
	return "", true
}

// reachable is nil when an in-sandbox request may go on to sandbox id in
// state st: known's error for a sandbox in state error, sandbox.Conflict for
// one paused without autoResume.
func reachable(id string, st manager.RequestState) error {
	if err := known(id, st.State, st.Error); err != nil {
		return err
	}
	if st.State == sandbox.StateHibernated && !st.ResumeOnRequest {
		return sandbox.Errorf(sandbox.Conflict, "sandbox %s is paused and was created without autoResume: Sandbox.connect resumes it", id)
	}
	return nil
}

// failInSandbox answers an in-sandbox request that could not reach the
// sandbox. A sandbox that is unknown, or paused without autoResume, is 502
// with the reason in the message: E2B's own front answers 502 for a sandbox
// that is not running, and its SDKs read that status (isRunning is false,
// other calls raise the sandbox-not-running error, not a missing file's or an
// unimplemented method's). An RPC gets unavailable for an unknown sandbox
// (what the SDKs make of E2B's 502) and failed_precondition, with the
// message, for a paused one. Other failures are answered as by fail.
func (s *Service) failInSandbox(w http.ResponseWriter, r *http.Request, err error) {
	if s.referred(r, err) {
		return // another node owns the sandbox: the call goes there
	}
	switch sandbox.KindOf(err) {
	case sandbox.NotFound:
		s.log.Debug("e2b: in-sandbox request to a sandbox not running", "path", r.URL.Path, "err", err)
		refuse(w, r, http.StatusBadGateway, connect.CodeUnavailable, err.Error())
		return
	case sandbox.Conflict:
		s.log.Debug("e2b: in-sandbox request to a sandbox not running", "path", r.URL.Path, "err", err)
		refuse(w, r, http.StatusBadGateway, connect.CodeFailedPrecondition, err.Error())
		return
	}
	if errors.Is(err, ingress.ErrNoAnswer) {
		s.log.Warn("e2b: in-sandbox request got no answer", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	if isDialError(err) {
		// The dial's own words name the sandbox's address and instance: they
		// stay in the log (this route takes no key).
		s.log.Debug("e2b: in-sandbox request: the port refused the connection", "path", r.URL.Path, "err", err)
		refuse(w, r, http.StatusBadGateway, connect.CodeUnavailable, "nothing answers on this port of the sandbox (the connection was refused: no server listens on it)")
		return
	}
	if !isEnvdRPC(r) {
		s.fail(w, r, err)
		return
	}
	status := StatusOf(err)
	if status == http.StatusInternalServerError {
		s.log.Error("e2b request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	refuse(w, r, status, rpcCode(status), err.Error())
}

// rpcErrors writes errors in the RPC protocol of a request: Connect (unary
// JSON, or a server stream's end-of-stream message), gRPC, gRPC-Web.
var rpcErrors = connect.NewErrorWriter()

// isEnvdRPC says whether r calls a method of envd's RPC services
// (process.Process, filesystem.Filesystem) in a protocol rpcErrors writes.
func isEnvdRPC(r *http.Request) bool {
	p := r.URL.Path
	return (strings.HasPrefix(p, "/"+processconnect.ProcessName+"/") || strings.HasPrefix(p, "/"+filesystemconnect.FilesystemName+"/")) &&
		rpcErrors.IsSupported(r)
}

// refuse answers an in-sandbox request the front does not pass on. A call of
// envd's RPC services gets the error in its protocol, with code and msg (a
// Connect unary call: {"code": "unavailable", "message": msg} with code's
// HTTP status; a server stream: 200 and an end-of-stream message
// {"error": {"code", "message"}}; gRPC: grpc-status): connect-web raises it
// as a ConnectError of that code, which E2B's SDKs map to their error classes
// (unavailable → SandboxNotFoundError for commands and watchDir, TimeoutError
// for the rest; not_found → NotFoundError, and false from files.exists and
// commands.kill; anything else a SandboxError "<code>: <msg>"). Any other
// request gets E2B's {"code": status, "message": msg}.
func refuse(w http.ResponseWriter, r *http.Request, status int, code connect.Code, msg string) {
	if !isEnvdRPC(r) {
		replyError(w, status, msg)
		return
	}
	_ = rpcErrors.Write(w, r, connect.NewError(code, errors.New(msg)))
}

// rpcCode is the RPC code of a refusal of HTTP status (StatusOf's).
func rpcCode(status int) connect.Code {
	switch status {
	case http.StatusBadRequest:
		return connect.CodeInvalidArgument
	case http.StatusUnauthorized:
		return connect.CodeUnauthenticated
	case http.StatusNotFound:
		return connect.CodeNotFound
	case http.StatusConflict:
		return connect.CodeFailedPrecondition
	case http.StatusUnprocessableEntity:
		return connect.CodeDataLoss
	case http.StatusNotImplemented:
		return connect.CodeUnimplemented
	case http.StatusBadGateway, http.StatusServiceUnavailable:
		return connect.CodeUnavailable
	}
	return connect.CodeInternal
}
