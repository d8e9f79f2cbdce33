package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// NodeHeader is the response header of GET /healthz that names the server
// process that answered: "<node>@<registration time, Unix ms>", the identity
// idempotency records name (idemHolder). A cluster server reads it to check
// that its advertised URL reaches itself (checkAdvertise).
const NodeHeader = "Torpor-Node"

// CheckAdvertise says whether u can be a node's advertised URL: the base
// URL of its API, http:// or https:// with a host (and a port, or the
// scheme's), nothing after it but an optional "/": no other path, query,
// fragment or user info, which other nodes would not keep when they forward
// a call to it.
func CheckAdvertise(u string) error {
	bad := func(why string) error {
		return fmt.Errorf("--advertise %q: want http://host:port or https://host:port (%s)", u, why)
	}
	p, err := url.Parse(u)
	switch {
	case err != nil:
		return bad("not a URL")
	case p.Scheme != "http" && p.Scheme != "https":
		return bad("the scheme is not http or https")
	case p.Opaque != "" || p.Host == "" || p.Hostname() == "":
		return bad("no host")
	case p.User != nil:
		return bad("user info")
	case p.Path != "" && p.Path != "/":
		return bad("a path")
	case p.RawQuery != "" || p.ForceQuery:
		return bad("a query")
	case p.Fragment != "" || strings.Contains(u, "#"):
		return bad("a fragment")
	}
	return nil
}

// advertiseCheckFor is how long a cluster server tries to reach itself at
// its advertised URL before it gives up (checkAdvertise); a variable for
// the tests.
var advertiseCheckFor = 10 * time.Second

// checkAdvertise checks, once the server serves, that GET <adv>/healthz
// answers from this very server process (NodeHeader is idemHolder): other
// nodes forward calls to adv, and a URL that reaches nothing, or another
// server, would answer them 502 or wrong. It tries every half second for
// advertiseCheckFor. A certificate whose names do not fit adv is no
// failure (the header tells the server). Errors: it never reached itself,
// naming adv and what it reached the last time; nil as well when ctx ends.
func (s *Server) checkAdvertise(ctx context.Context, adv string) error {
	want := s.idemHolder()
	target := strings.TrimSuffix(adv, "/") + "/healthz"
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 2 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	deadline := time.Now().Add(advertiseCheckFor)
	for {
		reached := reach(ctx, client, target, want)
		if reached == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("--advertise %s does not reach this server (node %s, %s %s): for %s, GET %s reached %s; the other nodes forward calls to this URL: give --advertise a URL of this server's --listen",
				adv, s.node, NodeHeader, want, advertiseCheckFor, target, reached)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// reach is what GET target reached: "" this server (NodeHeader want), else
// a description: nothing (the error: connection refused, a timeout, …),
// another torpor server (its NodeHeader), or a server that sends none.
func reach(ctx context.Context, client *http.Client, target, want string) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return "nothing (" + err.Error() + ")"
	}
	resp, err := client.Do(req)
	if err != nil {
		var ue *url.Error
		switch {
		case errors.Is(err, syscall.ECONNREFUSED):
			return "nothing (connection refused)"
		case errors.As(err, &ue):
			return "nothing (" + ue.Err.Error() + ")"
		}
		return "nothing (" + err.Error() + ")"
	}
	resp.Body.Close()
	switch got := resp.Header.Get(NodeHeader); got {
	case want:
		return ""
	case "":
		return fmt.Sprintf("a server that sends no %s header (%s: not a torpor server, or an older one)", NodeHeader, resp.Status)
	default:
		return fmt.Sprintf("another torpor server (%s %s)", NodeHeader, got)
	}
}
