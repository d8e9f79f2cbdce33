package e2b

import (
	"net/http"
	"testing"
)

func TestRouteOf(t *testing.T) {
	const domain = "sandboxes.example.org"
	hdr := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	for _, tc := range []struct {
		name   string
		h      http.Header
		host   string
		want   Route
		ok     bool
		failed bool
	}{
		{"headers", hdr(HeaderSandboxID, "sbx-abc", HeaderSandboxPort, "49983"), "127.0.0.1:3000", Route{"sbx-abc", 49983}, true, false},
		{"headers win over host", hdr(HeaderSandboxID, "sbx-a", HeaderSandboxPort, "8080"), "49983-sbx-b." + domain, Route{"sbx-a", 8080}, true, false},
		{"host", nil, "49983-sbx-abc." + domain, Route{"sbx-abc", 49983}, true, false},
		{"host with port and case", nil, "8080-SBX-abc.Sandboxes.Example.org:443", Route{"sbx-abc", 8080}, true, false},
		{"control plane host", nil, "api." + domain, Route{}, false, false},
		{"other name with a dash", nil, "my-app." + domain, Route{}, false, false},
		{"other domain", nil, "49983-sbx-abc.example.com", Route{}, false, false},
		{"deeper name", nil, "x.49983-sbx-abc." + domain, Route{}, false, false},
		{"bare domain", nil, domain, Route{}, false, false},
		{"one header", hdr(HeaderSandboxID, "sbx-a"), "", Route{}, false, true},
		{"bad header port", hdr(HeaderSandboxID, "sbx-a", HeaderSandboxPort, "99999"), "", Route{}, false, true},
		{"bad host port", nil, "99999-sbx-abc." + domain, Route{}, false, true},
	} {
		got, ok, err := RouteOf(tc.h, tc.host, domain)
		if got != tc.want || ok != tc.ok || (err != nil) != tc.failed {
			t.Errorf("%s: RouteOf = %+v, %v, %v; want %+v, %v, error %v", tc.name, got, ok, err, tc.want, tc.ok, tc.failed)
		}
	}
	if _, ok, _ := RouteOf(nil, "49983-sbx-a.", ""); ok {
		t.Error("no domain configured: a host name routed")
	}
}

// TestNamesSandboxHost: the host names Front answers with the --e2b-domain
// hint on a server started without a domain.
func TestNamesSandboxHost(t *testing.T) {
	for host, want := range map[string]bool{
		"8000-sbx-abcdefghij12.sandboxes.example.org": true,
		"49983-SBX-abcdefghij12.example.com:443":      true,
		"127.0.0.1:7070":                              false,
		"api.example.com":                             false,
		"my-app.example.com":                          false,
		"8000-sbx-short.example.com":                  false,
		"x.8000-sbx-abcdefghij12.example.com":         false,
		"8000-sbx-abcdefghij12":                       false,
	} {
		if got := namesSandboxHost(host); got != want {
			t.Errorf("namesSandboxHost(%q) = %v, want %v", host, got, want)
		}
	}
}
