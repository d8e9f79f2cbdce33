package server

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/apiv1"
)

// AuthMode says whether the REST API requires API keys (Config.Auth,
// `torpor serve --auth`).
type AuthMode string

const (
	// AuthAuto (the default) is AuthRequired when the listen address is not
	// a loopback address, else AuthNone.
	AuthAuto AuthMode = "auto"
	// AuthRequired: every REST v1 call, the port proxy and /metrics need
	// "Authorization: Bearer <key>"; /healthz stays open.
	AuthRequired AuthMode = "required"
	// AuthNone: no keys; only on a loopback address.
	AuthNone AuthMode = "none"
)

// ResolveAuth returns whether a server with mode listening on listen (host:port;
// "" is the default 127.0.0.1:7070) requires API keys. Loopback means an IP
// literal in 127.0.0.0/8 or ::1, or the name localhost; any other address,
// a host name, or an empty host (every interface) is not. Errors: an unknown
// mode, or AuthNone on an address that is not loopback (the API would be open
// to anyone who can reach it).
func ResolveAuth(mode AuthMode, listen string) (bool, error) {
	if listen == "" {
		listen = "127.0.0.1:7070"
	}
	switch mode {
	case AuthRequired:
		return true, nil
	case AuthNone:
		if !isLoopback(listen) {
			return false, fmt.Errorf("--auth none on %s: refused, the API would be open to anyone who can reach that address; use --auth required (make a key with `torpor key create`) or listen on 127.0.0.1", listen)
		}
		return false, nil
	case AuthAuto, "":
		return !isLoopback(listen), nil
	}
	return false, fmt.Errorf("--auth %q: want required, none or auto", mode)
}

// isLoopback reports whether listen's host is a loopback address (see
// ResolveAuth).
func isLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		host = listen
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(strings.Trim(host, "[]"))
	return err == nil && ip.Unmap().IsLoopback()
}

// needsKey reports whether a request to path needs a key when keys are
// required: REST v1 (everything under /v1/, the port proxy with it) and
// /metrics. /healthz and paths the server has no route for do not (another
// surface on the same listener checks its own keys).
func needsKey(path string) bool {
	return strings.HasPrefix(path, "/v1/") || path == "/metrics"
}

// requireKeys wraps h so that the requests needsKey names carry a key the
// verifier admits (Authorization: Bearer).
func (s *Server) requireKeys(h http.Handler) http.Handler {
	checked := s.keys.Require(h, apikey.FromBearer, s.denyKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if needsKey(r.URL.Path) {
			checked.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// denyKey answers a request apikey refused (apikey.Deny): 401
// unauthenticated (missing or wrong key; nothing else is said) with
// WWW-Authenticate, 429 rate_limited with Retry-After, or 503 with Retry-After when
// the key store failed.
func (s *Server) denyKey(w http.ResponseWriter, r *http.Request, err error) {
	status, retryAfter, msg := apikey.Deny(err)
	code := apiv1.CodeUnauthenticated
	switch {
	case status == http.StatusTooManyRequests:
		code = apiv1.CodeRateLimited
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(retryAfter.Seconds()))))
	case errors.Is(err, apikey.ErrMissing):
		w.Header().Set("WWW-Authenticate", `Bearer realm="torpor"`)
		msg += ": send Authorization: Bearer <key>"
	case status == http.StatusUnauthorized:
		w.Header().Set("WWW-Authenticate", `Bearer realm="torpor", error="invalid_token"`)
	default:
		code = apiv1.CodeUnavailable
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(retryAfter.Seconds()))))
		s.log.Error("api key check failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeError(w, status, code, msg)
}
