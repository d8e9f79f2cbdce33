package server

import (
	"fmt"
	"net/url"
	"strings"
)

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
