package e2b

import (
	"fmt"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
)

// Route is where an in-sandbox request goes: a sandbox and a port inside it (EnvdPort
// for envd, any other for the user's own servers).
type Route struct {
	SandboxID string
	Port      int
}

// RouteOf finds the route of an in-sandbox request. The SDKs name it one of two ways:
//
//   - with E2B_SANDBOX_URL set, every request goes to that one address with headers
//     E2b-Sandbox-Id and E2b-Sandbox-Port (both must be set);
//   - otherwise, and for every URL sandbox.getHost(port) returns, by the host name
//     "<port>-<sandboxID>.<domain>": the id is everything after the first "-" (it may
//     hold more, as torpor's "sbx-…" ids do); host names are matched and answered in
//     lower case, which sandbox ids are; a ":port" after the name is ignored.
//
// The headers win when present. ok is false when neither names a sandbox (a request
// for the control plane at "api.<domain>", say); err is set when one does but is
// malformed (a single header, a port outside 1 to 65535).
func RouteOf(h http.Header, host, domain string) (r Route, ok bool, err error) {
	if id, port := h.Get(HeaderSandboxID), h.Get(HeaderSandboxPort); id != "" || port != "" {
		if id == "" || port == "" {
			return Route{}, false, fmt.Errorf("%s and %s must be set together (got %q, %q)", HeaderSandboxID, HeaderSandboxPort, id, port)
		}
		p, err := parsePort(port)
		if err != nil {
			return Route{}, false, fmt.Errorf("%s %q: %w", HeaderSandboxPort, port, err)
		}
		return Route{SandboxID: id, Port: p}, true, nil
	}
	if hostOnly, _, err := net.SplitHostPort(host); err == nil {
		host = hostOnly
	}
	suffix := "." + strings.ToLower(strings.TrimSuffix(domain, "."))
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	label, found := strings.CutSuffix(host, suffix)
	if domain == "" || !found || strings.Contains(label, ".") {
		return Route{}, false, nil
	}
	port, id, found := strings.Cut(label, "-")
	if !found || id == "" || port == "" || strings.Trim(port, "0123456789") != "" {
		// Another name under the domain ("api.<domain>"): not a sandbox's.
		return Route{}, false, nil
	}
	p, err := parsePort(port)
	if err != nil {
		return Route{}, false, fmt.Errorf("host %q: port %q: %w", host, port, err)
	}
	return Route{SandboxID: id, Port: p}, true, nil
}

func parsePort(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("want a port number 1 to 65535")
	}
	return p, nil
}

// sandboxHostRE matches a host name that reads as "<port>-<sandboxID>.…" with
// one of torpor's sandbox ids: a request for a sandbox's port by host name.
var sandboxHostRE = regexp.MustCompile(`^[0-9]{1,5}-sbx-[a-z0-9]{12}\.`)

// namesSandboxHost reports whether host (a ":port" after it ignored) reads as
// a sandbox's "<port>-<sandboxID>.<domain>" whatever the domain: Front's hint
// for a server started without a domain, which cannot route by host name.
func namesSandboxHost(host string) bool {
	if hostOnly, _, err := net.SplitHostPort(host); err == nil {
		host = hostOnly
	}
	return sandboxHostRE.MatchString(strings.ToLower(host))
}
