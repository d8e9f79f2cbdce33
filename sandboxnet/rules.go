package sandboxnet

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The filter of an instance's host namespace, table ip "torpor" (nft list
// ruleset inside the namespace shows it):
//
//	chain forward (hook forward, policy drop)
//	  ct state established,related accept
//	  iifname != veth0 drop; oifname != up0 drop
//	  ip daddr <resolver> udp/tcp dport 53 accept
//	  ip daddr <always refused> goto refuse   host, pool, API, link-local, loopback, multicast
//	  ip daddr <deny_out> goto refuse
//	  ip daddr <allow_out> accept
//	  goto refuse                              (internet_access off)
//	  ip daddr <private> goto refuse
//	  accept
//	chain refuse: tcp reset, else icmp port unreachable (the guest's call fails at once)
//	chain input (hook input): from up0 only established,related; from veth0 only to 10.213.0.1
//	chain postrouting (nat): oifname up0 masquerade
//
// Rules that reach nothing get chain refuse and refuseAll's prerouting chain
// only.
const hostTable = "torpor"

// applyRules writes the host namespace's table for rules r.
func applyRules(host netns.NsHandle, r Rules, refused []netip.Prefix, dns netip.Addr) error {
	c, t, _, err := hostTableConn(host)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	drop, accept := nftables.ChainPolicyDrop, nftables.ChainPolicyAccept
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &drop})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	add := func(ch *nftables.Chain, exprs ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: exprs})
	}
	toRefuse := verdict(expr.VerdictGoto, "refuse")

	add(fwd, append(established(), verdict(expr.VerdictAccept, ""))...)
	add(fwd, append(ifname(expr.MetaKeyIIFNAME, "veth0", expr.CmpOpNeq), verdict(expr.VerdictDrop, ""))...)
	add(fwd, append(ifname(expr.MetaKeyOIFNAME, upName, expr.CmpOpNeq), verdict(expr.VerdictDrop, ""))...)
	if dns.IsValid() {
		for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
			add(fwd, concat(addrIn(dstOff, netip.PrefixFrom(dns, 32), expr.CmpOpEq), l4proto(proto), dport(53),
				[]expr.Any{verdict(expr.VerdictAccept, "")})...)
		}
	}
	for _, p := range v4(refused) {
		add(fwd, append(addrIn(dstOff, p, expr.CmpOpEq), toRefuse)...)
	}
	for _, p := range v4(AlwaysRefused) {
		add(fwd, append(addrIn(dstOff, p, expr.CmpOpEq), toRefuse)...)
	}
	for _, p := range v4(r.DenyOut) {
		add(fwd, append(addrIn(dstOff, p, expr.CmpOpEq), toRefuse)...)
	}
	for _, p := range v4(r.AllowOut) {
		add(fwd, append(addrIn(dstOff, p, expr.CmpOpEq), verdict(expr.VerdictAccept, ""))...)
	}
	if !r.InternetAccess {
		add(fwd, toRefuse)
	} else {
		for _, p := range v4(Private) {
			add(fwd, append(addrIn(dstOff, p, expr.CmpOpEq), toRefuse)...)
		}
		add(fwd, verdict(expr.VerdictAccept, ""))
	}

	add(in, concat(ifname(expr.MetaKeyIIFNAME, upName, expr.CmpOpEq), established(), []expr.Any{verdict(expr.VerdictAccept, "")})...)
	add(in, append(ifname(expr.MetaKeyIIFNAME, upName, expr.CmpOpEq), verdict(expr.VerdictDrop, ""))...)
	add(in, concat(ifname(expr.MetaKeyIIFNAME, "veth0", expr.CmpOpEq),
		addrIn(dstOff, netip.MustParsePrefix(HostIP+"/32"), expr.CmpOpNeq), []expr.Any{toRefuse})...)

	add(post, append(ifname(expr.MetaKeyOIFNAME, upName, expr.CmpOpEq), &expr.Masq{})...)
	return c.Flush()
}

// hostTableConn opens an nftables connection in namespace host and adds the
// host table with its chain refuse: tcp reset, else icmp port unreachable.
func hostTableConn(host netns.NsHandle) (*nftables.Conn, *nftables.Table, *nftables.Chain, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(host)))
	if err != nil {
		return nil, nil, nil, err
	}
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: hostTable})
	ref := c.AddChain(&nftables.Chain{Name: "refuse", Table: t})
	c.AddRule(&nftables.Rule{Table: t, Chain: ref, Exprs: append(l4proto(unix.IPPROTO_TCP), &expr.Reject{Type: unix.NFT_REJECT_TCP_RST})})
	c.AddRule(&nftables.Rule{Table: t, Chain: ref, Exprs: []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: 3}}})
	return c, t, ref, nil
}

// refuseAll writes the host table of an instance that reaches nothing: chain
// prerouting (hook prerouting) sends every packet from veth0 not to
// 10.213.0.1 to refuse. The namespace has no route out; without it the
// guest's connections would time out rather than fail.
func refuseAll(host netns.NsHandle) error {
	c, t, _, err := hostTableConn(host)
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: concat(ifname(expr.MetaKeyIIFNAME, "veth0", expr.CmpOpEq),
		addrIn(dstOff, netip.MustParsePrefix(HostIP+"/32"), expr.CmpOpNeq), []expr.Any{verdict(expr.VerdictGoto, "refuse")})})
	return c.Flush()
}

// uplinkTable is the uplink's table of engine scope.
func (e *Egress) uplinkTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "torpor-" + e.scope}
}

// prepareUplink (re)writes the uplink's table, table ip "torpor-<scope>":
//
//	chain postrouting (nat): ip saddr <pool> [oifname <iface> | ip daddr != <pool>] masquerade
//	chain input:   ip saddr <pool> ip daddr <resolver> udp/tcp dport 53 accept; ip saddr <pool> drop
//	chain forward: ip saddr <pool> ip daddr <pool> drop; [ip saddr <pool> oifname != <iface> drop]
func (e *Egress) prepareUplink() error {
	c, err := nftables.New(nftables.WithNetNSFd(int(e.uplink)))
	if err != nil {
		return fmt.Errorf("sandboxnet: uplink table: %w", err)
	}
	defer c.CloseLasting()
	t := e.uplinkTable()
	if tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4); err == nil {
		for _, old := range tables {
			if old.Name == t.Name {
				c.DelTable(old)
			}
		}
	}
	t = c.AddTable(t)
	accept := nftables.ChainPolicyAccept
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	add := func(ch *nftables.Chain, exprs ...[]expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: concat(exprs...)})
	}
	pool := addrIn(srcOff, e.cfg.Pool, expr.CmpOpEq)
	one := func(x expr.Any) []expr.Any { return []expr.Any{x} }
	if e.cfg.UplinkIface != "" {
		add(post, pool, ifname(expr.MetaKeyOIFNAME, e.cfg.UplinkIface, expr.CmpOpEq), one(&expr.Masq{}))
		add(fwd, pool, ifname(expr.MetaKeyOIFNAME, e.cfg.UplinkIface, expr.CmpOpNeq), one(verdict(expr.VerdictDrop, "")))
	} else {
		add(post, pool, addrIn(dstOff, e.cfg.Pool, expr.CmpOpNeq), one(&expr.Masq{}))
	}
	add(fwd, pool, addrIn(dstOff, e.cfg.Pool, expr.CmpOpEq), one(verdict(expr.VerdictDrop, "")))
	if dns := e.Resolver(); dns.IsValid() {
		for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
			add(in, pool, addrIn(dstOff, netip.PrefixFrom(dns, 32), expr.CmpOpEq), l4proto(proto), dport(53),
				one(verdict(expr.VerdictAccept, "")))
		}
	}
	add(in, pool, one(verdict(expr.VerdictDrop, "")))
	if err := c.Flush(); err != nil {
		return fmt.Errorf("sandboxnet: uplink table %s: %w", t.Name, err)
	}
	return nil
}

func (e *Egress) removeUplinkTable() error {
	c, err := nftables.New(nftables.WithNetNSFd(int(e.uplink)))
	if err != nil {
		return err
	}
	defer c.CloseLasting()
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return err
	}
	for _, t := range tables {
		if t.Name == e.uplinkTable().Name {
			c.DelTable(t)
			return c.Flush()
		}
	}
	return nil
}

// Offsets of the IPv4 header's source and destination addresses.
const (
	srcOff = 12
	dstOff = 16
)

func concat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func verdict(k expr.VerdictKind, chain string) *expr.Verdict {
	return &expr.Verdict{Kind: k, Chain: chain}
}

// addrIn matches (op Eq) or does not match (op Neq) the IPv4 address at off
// against prefix p.
func addrIn(off uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	p = p.Masked()
	out := []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4}}
	if p.Bits() < 32 {
		mask := net.CIDRMask(p.Bits(), 32)
		out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)})
	}
	return append(out, &expr.Cmp{Op: op, Register: 1, Data: p.Addr().AsSlice()})
}

func ifname(key expr.MetaKey, name string, op expr.CmpOp) []expr.Any {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: b}}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

func dport(port uint16) []expr.Any {
	return []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)}}
}

func established() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

// v4 keeps the IPv4 prefixes of ps.
func v4(ps []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		if p.Addr().Is4() {
			out = append(out, p)
		}
	}
	return out
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
