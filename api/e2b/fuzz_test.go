package e2b

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

// controlBodies are the JSON bodies of E2B's control plane, each as its
// handler reads it (allowEmpty) and uses it (use: the methods it calls).
var controlBodies = []struct {
	name       string
	new        func() any
	allowEmpty bool
	use        func(t *testing.T, v any)
}{
	{"create", func() any { return &NewSandbox{} }, true, func(t *testing.T, v any) {
		r := v.(*NewSandbox)
		checkTTL(t, r.Timeout, r.TTL)
		r.PausesOnTimeout()
		r.KeepsMemoryOnPause()
		r.ResumesOnRequest()
		r.InternetAccess()
		r.Unsupported()
	}},
	{"timeout", func() any { return &TimeoutRequest{} }, false, func(t *testing.T, v any) {
		r := v.(*TimeoutRequest)
		if _, err := r.TTL(); r.Timeout == nil && err == nil {
			t.Fatal("no timeout accepted: it is required")
		} else if r.Timeout != nil {
			checkTTL(t, r.Timeout, r.TTL)
		}
	}},
	{"pause", func() any { return &PauseRequest{} }, true, func(t *testing.T, v any) { v.(*PauseRequest).KeepsMemory() }},
	{"connect", func() any { return &ConnectRequest{} }, true, func(t *testing.T, v any) {
		r := v.(*ConnectRequest)
		checkTTL(t, r.Timeout, r.TTL)
		r.KeepsMemory()
	}},
	{"snapshot", func() any { return &SnapshotRequest{} }, true, nil},
	{"fork", func() any { return &ForkRequest{} }, true, func(t *testing.T, v any) {
		r := v.(*ForkRequest)
		checkTTL(t, r.Timeout, r.TTL)
		n, err := r.N()
		if err == nil && (n < 1 || n > MaxForkCount) {
			t.Fatalf("count %v: N %d accepted", r.Count, n)
		}
	}},
}

// checkTTL checks a time to live: DefaultTimeout when left out, else the
// timeout's seconds, never more than MaxTimeout; a refusal names the timeout.
func checkTTL(t *testing.T, timeout *int32, ttl func() (time.Duration, error)) {
	t.Helper()
	d, err := ttl()
	switch {
	case err != nil:
		if timeout == nil || !strings.Contains(err.Error(), "timeout") {
			t.Fatalf("timeout %v: refused with %v", timeout, err)
		}
	case timeout == nil:
		if d != DefaultTimeout {
			t.Fatalf("no timeout: TTL %v", d)
		}
	case d != time.Duration(*timeout)*time.Second || d < 0 || d > MaxTimeout:
		t.Fatalf("timeout %d: TTL %v", *timeout, d)
	}
}

// FuzzControlBody feeds any bytes to the body decoder of E2B's control plane. A
// refused body is a 400 with a message; an accepted one is one JSON object
// (with any white space around it), its handler's methods do not panic, and
// encoding the decoded value and decoding that again gives the same value.
func FuzzControlBody(f *testing.F) {
	f.Add(uint8(0), []byte(`{"templateID":"base","metadata":{"user":"abc"},"envVars":{"A":"1"},"timeout":60,"autoPause":true,"autoResume":{"enabled":true},"secure":true,"allow_internet_access":true}`))
	f.Add(uint8(0), []byte(`{"templateID":"base","network":{"allowOut":["1.2.3.4/32"],"rules":{"x":1}},"mcp":null}`))
	f.Add(uint8(1), []byte(`{"timeout":30}`))
	f.Add(uint8(2), []byte(`{"memory":false}`))
	f.Add(uint8(3), []byte(`{"timeout":300,"memory":true}`))
	f.Add(uint8(4), []byte(`{"name":"snap"}`))
	f.Add(uint8(5), []byte(`{"timeout":300,"count":2}`))
	svc := &Service{log: slog.New(slog.DiscardHandler)}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		cb := controlBodies[int(which)%len(controlBodies)]
		v := cb.new()
		err := svc.decodeBody(httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body)), v, cb.allowEmpty)
		if err != nil {
			if StatusOf(err) != http.StatusBadRequest || err.Error() == "" {
				t.Fatalf("%s: refused with %d %q, want 400 and a message", cb.name, StatusOf(err), err)
			}
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			return
		}
		if !json.Valid(bytes.TrimSpace(body)) { // white space around it is allowed, Unicode's too
			t.Fatalf("%s: accepted a body that is not one JSON value: %q", cb.name, body)
		}
		if cb.use != nil {
			cb.use(t, v)
		}
		enc, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("%s: accepted %q, which does not encode: %v", cb.name, body, err)
		}
		v2 := cb.new()
		if err := svc.decodeBody(httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(enc)), v2, cb.allowEmpty); err != nil {
			t.Fatalf("%s: accepted %q but not its encoding %s: %v", cb.name, body, enc, err)
		}
		if enc2, _ := json.Marshal(v2); !bytes.Equal(enc, enc2) {
			t.Fatalf("%s: round trip changed the value: %s then %s", cb.name, enc, enc2)
		}
	})
}

// metadataParam encodes md as E2B's SDKs send the list call's metadata: each
// key and value escaped, the pairs joined, that escaped as one value.
func metadataParam(md map[string]string) string {
	var pairs []string
	for k, v := range md {
		pairs = append(pairs, url.QueryEscape(k)+"="+url.QueryEscape(v))
	}
	return url.QueryEscape(strings.Join(pairs, "&"))
}

// FuzzListQuery parses any query string as GET /v2/sandboxes does. An accepted
// query has a limit of 1 to MaxListLimit, an order of asc or desc and states
// E2B names; its metadata, encoded again the SDKs' way, parses to the same
// pairs. A refused one names the parameter. nextToken is a cursor: a token
// this server could not have given is refused, and a cursor's token parses
// back to it.
func FuzzListQuery(f *testing.F) {
	f.Add("metadata=my%252520key%3Da%252526b%25253Dc%26user%3Dabc&state=running&limit=2&nextToken=tok&order=asc&startedAfter=2026-01-02T03:04:05.000Z&template=base")
	f.Add("state=running,paused&limit=100&order=desc")
	f.Add("metadata=%3D&limit=0")
	f.Add("nextToken=" + cursor{ID: "sbx-1"}.token())
	f.Fuzz(func(t *testing.T, raw string) {
		q, err := url.ParseQuery(raw)
		if err != nil {
			return // net/http refuses it before a handler sees it
		}
		lq, err := ParseListQuery(q)
		if err != nil {
			named := false
			for _, p := range []string{"metadata", "state", "limit", "order", "startedAfter"} {
				named = named || strings.HasPrefix(err.Error(), p+" ")
			}
			if !named {
				t.Fatalf("refused %q: %v (want the parameter named)", raw, err)
			}
			return
		}
		if lq.Limit < 1 || lq.Limit > MaxListLimit || (lq.Order != "asc" && lq.Order != "desc") || len(lq.States) == 0 {
			t.Fatalf("accepted %q as %+v", raw, lq)
		}
		for _, s := range lq.States {
			if s != StateRunning && s != StatePaused {
				t.Fatalf("accepted state %q", s)
			}
		}
		if len(lq.Metadata) > 0 {
			again, err := ParseListQuery(url.Values{"metadata": {metadataParam(lq.Metadata)}})
			if err != nil || !maps.Equal(again.Metadata, lq.Metadata) {
				t.Fatalf("metadata %v encoded again parses as %v (%v)", lq.Metadata, again.Metadata, err)
			}
		}
		if lq.NextToken != "" {
			c, err := parseCursor(lq.NextToken)
			if err != nil {
				if StatusOf(err) != http.StatusBadRequest {
					t.Fatalf("token %q refused with %d: %v", lq.NextToken, StatusOf(err), err)
				}
				return
			}
			c2, err := parseCursor(c.token())
			if err != nil || !c2.At.Equal(c.At) || c2.ID != c.ID {
				t.Fatalf("cursor %+v: its token parses as %+v (%v)", c, c2, err)
			}
		}
	})
}

// FuzzRoute finds the route of any host name and routing headers. A route
// has a port of 1 to 65535 and a sandbox id; a host route, written again as
// "<port>-<id>.<domain>", routes the same.
func FuzzRoute(f *testing.F) {
	f.Add("49983-sbx-abc.e2b.example:443", "e2b.example", "", "")
	f.Add("api.e2b.example", "e2b.example", "", "")
	f.Add("8080-SBX-1.E2B.example.", "e2b.example.", "", "")
	f.Add("localhost:3000", "", "sbx-1", "49983")
	f.Add("localhost:3000", "", "sbx-1", "")
	f.Add("0-x.d", "d", "", "")
	f.Fuzz(func(t *testing.T, host, domain, id, port string) {
		h := http.Header{}
		if id != "" {
			h.Set(HeaderSandboxID, id)
		}
		if port != "" {
			h.Set(HeaderSandboxPort, port)
		}
		r, ok, err := RouteOf(h, host, domain)
		if err != nil {
			if ok || err.Error() == "" {
				t.Fatalf("route %+v ok with error %v", r, err)
			}
			return
		}
		if !ok {
			return
		}
		if r.Port < 1 || r.Port > 65535 || r.SandboxID == "" {
			t.Fatalf("host %q headers %q %q: route %+v", host, id, port, r)
		}
		if len(h) > 0 {
			return
		}
		again, ok, err := RouteOf(http.Header{}, fmt.Sprintf("%d-%s.%s", r.Port, r.SandboxID, domain), domain)
		if !ok || err != nil || again != r {
			t.Fatalf("route %+v written as a host routes to %+v (%v, %v)", r, again, ok, err)
		}
	})
}
