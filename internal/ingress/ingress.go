// Package ingress forwards HTTP requests to servers inside sandboxes: the one
// reverse proxy behind torpor's port proxy (/v1/sandboxes/{id}/ports/…) and
// E2B's in-sandbox requests (api/e2b). The caller chooses, per request, how to
// reach the sandbox (a dial through the sandbox manager, which wakes a
// hibernated sandbox first), the path inside it and how a failure is
// answered.
package ingress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"syscall"
)

// Target is where one request goes: Dial connects to the server in the
// sandbox (called once per request: connections are not pooled, since a
// pooled one would not survive a hibernate and would count as a request in
// flight, holding a hibernate's drain), Path is the request's path there (the
// query string is forwarded as it is), and Fail answers the client when the
// dial or the exchange fails before an answer started.
type Target struct {
	Dial func(ctx context.Context) (net.Conn, error)
	Path string
	Fail func(w http.ResponseWriter, r *http.Request, err error)
}

type targetKey struct{}

// ErrNoAnswer is wrapped by the error Target.Fail gets when the connection to
// the server in the sandbox was made and then lost (closed, reset or ended by
// that server) before an answer came, after the one retry a GET, HEAD or
// OPTIONS gets. It is a bad gateway (502), not an error of torpor's.
var ErrNoAnswer = errors.New("the server in the sandbox closed the connection without answering")

// Proxy is a reverse proxy to Targets. Every answer is flushed as it comes
// (FlushInterval -1: server-sent events and Connect streams pass frame by
// frame); the Host header is the client's; X-Forwarded-For, -Host and -Proto
// are set. Upgrades (WebSocket) pass through.
type Proxy struct {
	rp *httputil.ReverseProxy
}

// New returns a Proxy whose own errors (a body cut while it is copied) go to
// errorLog (nil: the log package's standard logger).
func New(errorLog *log.Logger) *Proxy {
	return &Proxy{rp: &httputil.ReverseProxy{
		ErrorLog: errorLog,
		Rewrite: func(pr *httputil.ProxyRequest) {
			t := pr.In.Context().Value(targetKey{}).(Target)
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "sandbox"
			pr.Out.URL.Path = t.Path
			pr.Out.URL.RawPath = ""
			pr.Out.Host = pr.In.Host
			pr.SetXForwarded()
		},
		Transport: retryOnce{&http.Transport{
			DisableKeepAlives: true,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return ctx.Value(targetKey{}).(Target).Dial(ctx)
			},
		}},
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if connectionLost(err) && r.Context().Err() == nil {
				err = fmt.Errorf("%w (%w)", ErrNoAnswer, err)
			}
			r.Context().Value(targetKey{}).(Target).Fail(w, r, err)
		},
	}}
}

// Serve forwards r to t and copies the answer to w.
func (p *Proxy) Serve(w http.ResponseWriter, r *http.Request, t Target) {
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), targetKey{}, t)))
}

// retryOnce sends a request again, once, on a new connection (a new
// Target.Dial, which waits for the sandbox to be running again) when its
// connection was lost before an answer came — closed under it, reset, or
// ended — and the request can be sent twice: a GET, HEAD or OPTIONS without
// a body. A request racing a hibernate, pause or resume of its sandbox is so
// answered rather than failed with 502 (issue 18: "use of closed network
// connection"). A refused dial (nothing listens on the port) is not retried.
type retryOnce struct{ t *http.Transport }

func (rt retryOnce) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := rt.t.RoundTrip(req)
	if err == nil || !replayable(req) || !connectionLost(err) || req.Context().Err() != nil {
		return resp, err
	}
	return rt.t.RoundTrip(req)
}

func replayable(req *http.Request) bool {
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return req.Body == nil || req.Body == http.NoBody
	}
	return false
}

// connectionLost reports an error of a connection that was made and then
// lost (not a dial's).
func connectionLost(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false
	}
	return errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}
