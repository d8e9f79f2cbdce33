package ingress

import (
	"context"
	"errors"
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

// TestNoAnswer: a server in the sandbox that reads a GET and closes the
// connection without answering gets the GET twice (the one retry), and Fail
// then gets an error wrapping ErrNoAnswer (a 502 for its callers, not a 500
// "EOF").
func TestNoAnswer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Read(make([]byte, 4096))
			c.Close()
		}
	}()
	var dials atomic.Int64
	var failErr error
	target := Target{
		Path: "/reset",
		Dial: func(ctx context.Context) (net.Conn, error) {
			dials.Add(1)
			return (&net.Dialer{}).DialContext(ctx, "tcp", ln.Addr().String())
		},
		Fail: func(w http.ResponseWriter, r *http.Request, err error) {
			failErr = err
			http.Error(w, err.Error(), http.StatusBadGateway)
		},
	}
	rec := httptest.NewRecorder()
	New(nil).Serve(rec, httptest.NewRequest(http.MethodGet, "http://front/reset", nil), target)
	if !errors.Is(failErr, ErrNoAnswer) || dials.Load() != 2 {
		t.Fatalf("Fail got %v after %d dials, want ErrNoAnswer after 2", failErr, dials.Load())
	}
}
