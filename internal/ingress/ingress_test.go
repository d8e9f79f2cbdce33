package ingress

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// TestRetryOnceOnLostConnection: a GET whose first connection is closed
// under it before the answer (as a hibernate, pause or resume racing it
// does) is sent again on a new dial and answered; a POST with a body is not
// sent twice (the client gets Fail's answer), nor is a refused dial retried.
func TestRetryOnceOnLostConnection(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok "+r.Method)
	}))
	defer backend.Close()
	addr := backend.Listener.Addr().String()
	p := New(nil)
	for _, tc := range []struct {
		method, body string
		refused      bool
		wantStatus   int
		wantDials    int64
	}{
		{http.MethodGet, "", false, 200, 2},
		{http.MethodHead, "", false, 200, 2},
		{http.MethodPost, "data", false, 502, 1},
		{http.MethodGet, "", true, 502, 1},
	} {
		var dials atomic.Int64
		target := Target{
			Path: "/",
			Dial: func(ctx context.Context) (net.Conn, error) {
				n := dials.Add(1)
				if tc.refused {
					return (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:1")
				}
				c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
				if err == nil && n == 1 {
					c.Close() // lost before the request is written: net.ErrClosed
				}
				return c, err
			},
			Fail: func(w http.ResponseWriter, r *http.Request, err error) {
				http.Error(w, err.Error(), http.StatusBadGateway)
			},
		}
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
		}
		rec := httptest.NewRecorder()
		p.Serve(rec, httptest.NewRequest(tc.method, "http://front/x", body), target)
		if rec.Code != tc.wantStatus || dials.Load() != tc.wantDials {
			t.Errorf("%s (refused %v): %d %q after %d dials, want %d after %d", tc.method, tc.refused, rec.Code, rec.Body.String(), dials.Load(), tc.wantStatus, tc.wantDials)
		}
	}
}
