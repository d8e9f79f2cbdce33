package manager

import (
	"context"
	"errors"
	"net/netip"
	"strings"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// MaxNetworkRules bounds each of a sandbox's allow_out and deny_out lists.
const MaxNetworkRules = 1024

// resolver asks the default engine for the resolver sandboxes with egress
// reach; the error says why no sandbox gets a way out.
func (m *Manager) resolver() (netip.Addr, error) {
	e := m.cfg.Engines.Default()
	p, ok := e.(engine.EgressProvider)
	if !ok {
		return netip.Addr{}, errors.New("engine " + e.Name() + " gives sandboxes no way out")
	}
	return p.Resolver()
}

// createNetwork validates the network fields of a create request and returns
// the sandbox's Network. Errors (sandbox.ErrInvalidArgument): a bad or
// too long list, internet_access true or an allow_out on a server without an
// uplink.
func (m *Manager) createNetwork(req sandbox.Spec) (sandbox.Network, error) {
	n := sandbox.Network{PrivateTraffic: req.PrivateTraffic}
	var err error
	if n.AllowOut, err = parsePrefixes("allow_out", req.AllowOut); err != nil {
		return n, err
	}
	if n.DenyOut, err = parsePrefixes("deny_out", req.DenyOut); err != nil {
		return n, err
	}
	_, upErr := m.resolver()
	switch {
	case upErr == nil:
		n.InternetAccess = req.InternetAccess == nil || *req.InternetAccess
	case req.InternetAccess != nil && *req.InternetAccess:
		return n, invalid("internet_access: %v", upErr).WithHint("leave internet_access out or false")
	case len(n.AllowOut) > 0:
		return n, invalid("allow_out: %v", upErr)
	}
	return n, nil
}

// parsePrefixes parses a list of CIDR prefixes or single addresses (a /32 or
// /128), masked to their prefix.
func parsePrefixes(field string, in []string) ([]netip.Prefix, error) {
	if len(in) > MaxNetworkRules {
		return nil, invalid("%s: %d entries, at most %d", field, len(in), MaxNetworkRules)
	}
	var out []netip.Prefix
	for _, s := range in {
		s = strings.TrimSpace(s)
		var p netip.Prefix
		var err error
		if strings.Contains(s, "/") {
			p, err = netip.ParsePrefix(s)
		} else {
			var a netip.Addr
			if a, err = netip.ParseAddr(s); err == nil && a.Zone() != "" {
				err = errors.New("a zone")
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if err != nil {
			return nil, invalid("%s: %q is not a CIDR prefix or an IP address", field, s)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// engineEgress is the engine's view of n (also for a policy that reaches
// nothing: an engine with an uplink then refuses the guest's packets at once).
func engineEgress(n sandbox.Network) *engine.Egress {
	return &engine.Egress{InternetAccess: n.InternetAccess, AllowOut: n.AllowOut, DenyOut: n.DenyOut}
}

// writeResolvConf writes the guest's /etc/resolv.conf naming the engine's
// resolver, for a sandbox with egress that was just started (create, start
// from a snapshot); resumes and fork clones keep the file they had. A failure
// is logged: the sandbox runs, without name resolution.
func (m *Manager) writeResolvConf(ctx context.Context, s *metadata.Sandbox) {
	if !s.Network.Wanted() {
		return
	}
	dns, err := m.resolver()
	c := m.liveClient(s.ID)
	if err != nil || c == nil {
		return
	}
	body := "# written by torpor at create: no resolver is configured (torpor serve --dns)\n"
	if dns.IsValid() {
		body = "# written by torpor at create (torpor serve --dns)\nnameserver " + dns.String() + "\n"
	}
	if err := c.WriteFile(ctx, "/etc/resolv.conf", strings.NewReader(body), int64(len(body))); err != nil {
		m.log.Warn("sandbox without name resolution: writing /etc/resolv.conf failed", "sandbox", s.ID, "err", err)
	}
}
