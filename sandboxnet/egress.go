package sandboxnet

// Egress: a way out for an instance's traffic, through an uplink the operator
// chooses.
//
//	guest ns            host ns "<p>-<id>-h"                 uplink (a named ns, or the root ns)
//	eth0 10.213.0.2 --- veth0 10.213.0.1
//	                    up0  <pool>.n+2/30  ---------------  <scope>u<n>  <pool>.n+1/30 --> the uplink's routes
//	                    nft: filter (forward), masquerade
//	                    out of up0 behind <pool>.n+2
//
// Every instance gets its own /30 of the pool (the lowest free one), so clones of
// one snapshot, which keep the guest's address, never clash: the host namespace
// masquerades the guest behind the instance's pool address. The uplink's table
// (Egress.prepare) masquerades the pool behind the uplink's own address, refuses
// the pool any packet to the uplink namespace itself (but the resolver) and any
// packet between two pool addresses, and in the root namespace lets pool traffic
// leave through the chosen interface only.
//
// The filter lives in the instance's host namespace, which nothing inside the
// sandbox can reach. Its order (rules.go) is what docs/security.md documents.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// DefaultPool is the pool of per-instance uplink addresses when the
// configuration names none.
var DefaultPool = netip.MustParsePrefix("10.214.0.0/16")

// EgressConfig is the host's uplink for sandbox traffic: exactly one of
// UplinkNetns and UplinkIface.
type EgressConfig struct {
	// UplinkNetns names (under /run/netns) the network namespace sandbox
	// traffic leaves through; its routes take it on. Egress turns on IPv4
	// forwarding in it.
	UplinkNetns string
	// UplinkIface is an interface of the root network namespace sandbox traffic
	// leaves through (masqueraded behind its address). The host must forward
	// IPv4 already (net.ipv4.ip_forward=1): NewEgress refuses otherwise.
	UplinkIface string
	// Pool is where each instance's uplink /30 comes from (default DefaultPool):
	// an IPv4 prefix from /8 to /29 that no network the uplink reaches uses.
	Pool netip.Prefix
	// DNS is the resolver named in the guests' /etc/resolv.conf and the only
	// address a sandbox reaches on port 53 whatever its rules (zero: the
	// uplink's own, UplinkResolver).
	DNS netip.Addr
	// Refuse are more addresses no sandbox may reach (the API's listen
	// address when it is not one of the host's own).
	Refuse []netip.Prefix
}

// Egress gives instances of one engine (its scope) their way out. It is safe for
// concurrent use.
type Egress struct {
	cfg   EgressConfig
	scope string
	// root is the server's own network namespace (the root one), opened at
	// NewEgress; uplink the uplink's (root again for UplinkIface).
	root, uplink netns.NsHandle
	mu           sync.Mutex // serializes pool allocation
}

// Rules are one instance's egress rules (see docs/security.md, "Network egress").
type Rules struct {
	// InternetAccess: public addresses are reachable. Without it only AllowOut is.
	InternetAccess bool
	// AllowOut opens these prefixes, private ranges included; DenyOut refuses
	// these and wins over AllowOut. Neither opens the always-refused set.
	// IPv6 prefixes are kept and have no effect (sandboxes have IPv4 only).
	AllowOut, DenyOut []netip.Prefix
}

// Wanted reports whether an instance with these rules gets an uplink at all
// (internet access or something allowed).
func (r Rules) Wanted() bool { return r.InternetAccess || len(r.AllowOut) > 0 }

// Private are the ranges refused unless AllowOut names them: RFC 1918, the
// shared address space of RFC 6598 and IPv6 unique local addresses.
var Private = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("fc00::/7"),
}

// AlwaysRefused are the ranges no rule opens besides the host's own addresses,
// the pool and EgressConfig.Refuse: "this network", loopback, link-local (cloud
// metadata at 169.254.169.254), multicast and the reserved block with broadcast.
var AlwaysRefused = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// NewEgress checks cfg and prepares the uplink for engine scope: IPv4
// forwarding there (UplinkNetns) and the uplink's table (masquerade, the
// pool's guards). Errors: neither or both uplinks set, an uplink namespace or
// interface that does not exist, a bad pool, the root namespace not forwarding.
func NewEgress(scope string, cfg EgressConfig) (*Egress, error) {
	if (cfg.UplinkNetns == "") == (cfg.UplinkIface == "") {
		return nil, errors.New("sandboxnet: egress needs exactly one of an uplink namespace and an uplink interface")
	}
	if !cfg.Pool.IsValid() {
		cfg.Pool = DefaultPool
	}
	cfg.Pool = cfg.Pool.Masked()
	if !cfg.Pool.Addr().Is4() || cfg.Pool.Bits() < 8 || cfg.Pool.Bits() > 29 {
		return nil, fmt.Errorf("sandboxnet: egress pool %s: want an IPv4 prefix from /8 to /29", cfg.Pool)
	}
	if cfg.Pool.Overlaps(netip.MustParsePrefix(GuestIP + "/" + prefixLen)) {
		return nil, fmt.Errorf("sandboxnet: egress pool %s overlaps the guests' own %s/%s", cfg.Pool, GuestIP, prefixLen)
	}
	if cfg.DNS.IsValid() && !cfg.DNS.Is4() {
		return nil, fmt.Errorf("sandboxnet: resolver %s: sandboxes have IPv4 only", cfg.DNS)
	}
	e := &Egress{cfg: cfg, scope: scope}
	var err error
	if e.root, err = netns.Get(); err != nil {
		return nil, fmt.Errorf("sandboxnet: own network namespace: %w", err)
	}
	if cfg.UplinkNetns != "" {
		if e.uplink, err = netns.GetFromPath(netnsDir + "/" + cfg.UplinkNetns); err != nil {
			e.root.Close()
			return nil, fmt.Errorf("sandboxnet: uplink namespace %s: %w", cfg.UplinkNetns, err)
		}
		err = inNetns(e.uplink, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0) })
		if err != nil {
			e.Close()
			return nil, fmt.Errorf("sandboxnet: uplink namespace %s: turn on forwarding: %w", cfg.UplinkNetns, err)
		}
	} else {
		if e.uplink, err = netns.Get(); err != nil {
			e.root.Close()
			return nil, err
		}
		if _, err := netlink.LinkByName(cfg.UplinkIface); err != nil {
			e.Close()
			return nil, fmt.Errorf("sandboxnet: uplink interface %s: %w", cfg.UplinkIface, err)
		}
		if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
			e.Close()
			return nil, fmt.Errorf("sandboxnet: uplink interface %s: the host does not forward IPv4 (net.ipv4.ip_forward is not 1); turn it on (sysctl -w net.ipv4.ip_forward=1) or use an uplink namespace", cfg.UplinkIface)
		}
	}
	if err := e.prepareUplink(); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// Config returns the configuration in use (Pool filled in).
func (e *Egress) Config() EgressConfig { return e.cfg }

// Resolver returns the address the guests' /etc/resolv.conf names: the
// configured DNS or, when none was configured, the uplink's (UplinkResolver);
// zero when there is none.
func (e *Egress) Resolver() netip.Addr {
	if e.cfg.DNS.IsValid() {
		return e.cfg.DNS
	}
	return UplinkResolver(e.cfg.UplinkNetns)
}

// Close removes the uplink's table and releases the namespace handles. Call it
// only when no instance of the scope has an uplink any more.
func (e *Egress) Close() error {
	var err error
	if e.uplink.IsOpen() {
		err = e.removeUplinkTable()
		e.uplink.Close()
	}
	if e.root.IsOpen() {
		e.root.Close()
	}
	return err
}

// UplinkResolver returns the first IPv4 nameserver of an uplink's resolver
// configuration: /etc/netns/<netns>/resolv.conf when netns is set and has one
// (ip-netns(8)), else /etc/resolv.conf; a loopback server (systemd-resolved's
// stub, 127.0.0.53) is replaced by /run/systemd/resolve/resolv.conf's. Zero
// when none is found.
func UplinkResolver(uplinkNetns string) netip.Addr {
	files := []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"}
	if uplinkNetns != "" {
		if _, err := os.Stat("/etc/netns/" + uplinkNetns + "/resolv.conf"); err == nil {
			files = []string{"/etc/netns/" + uplinkNetns + "/resolv.conf"}
		}
	}
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) >= 2 && fs[0] == "nameserver" {
				if a, err := netip.ParseAddr(fs[1]); err == nil && a.Is4() && !a.IsLoopback() {
					fh.Close()
					return a
				}
			}
		}
		fh.Close()
	}
	return netip.Addr{}
}

const upName = "up0" // the uplink veth's end in an instance's host namespace

// Attach gives the instance of pair p its way out with rules r: the second
// veth pair from its host namespace to the uplink with the lowest free /30 of
// the pool, the default route, forwarding, masquerade and the filter. The
// pair must exist (Create); Delete removes what Attach made with it. On error
// the caller deletes the pair.
//
// Rules that reach nothing (not Wanted) get no uplink, only a filter that
// refuses every packet from the guest at once (a TCP reset, an ICMP port
// unreachable) instead of letting it time out.
func (e *Egress) Attach(ctx context.Context, p Pair, r Rules) error {
	host, err := netns.GetFromPath(netnsDir + "/" + p.Host)
	if err != nil {
		return fmt.Errorf("sandboxnet: egress %s: %w", p.Host, err)
	}
	defer host.Close()
	if !r.Wanted() {
		if err := refuseAll(host); err != nil {
			return fmt.Errorf("sandboxnet: egress %s: rules: %w", p.Host, err)
		}
		return nil
	}
	hostH, err := netlink.NewHandleAt(host)
	if err != nil {
		return fmt.Errorf("sandboxnet: egress %s: %w", p.Host, err)
	}
	defer hostH.Close()
	upH, err := netlink.NewHandleAt(e.uplink)
	if err != nil {
		return fmt.Errorf("sandboxnet: egress: uplink: %w", err)
	}
	defer upH.Close()
	refused, err := e.hostAddrs()
	if err != nil {
		return err
	}

	e.mu.Lock()
	n, err := e.freeSlot(upH)
	if err == nil {
		err = e.link(hostH, upH, n)
	}
	e.mu.Unlock()
	if err != nil {
		return fmt.Errorf("sandboxnet: egress %s: %w", p.Host, err)
	}
	waitUp(hostH, upName)
	if err := inNetns(host, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0) }); err != nil {
		return fmt.Errorf("sandboxnet: egress %s: forwarding: %w", p.Host, err)
	}
	refused = append(append(refused, e.cfg.Pool), e.cfg.Refuse...)
	if err := applyRules(host, r, refused, e.Resolver()); err != nil {
		return fmt.Errorf("sandboxnet: egress %s: rules: %w", p.Host, err)
	}
	return nil
}

// slot returns the addresses of the pool's n-th /30: the uplink's end and the
// instance's.
func (e *Egress) slot(n int) (uplinkEnd, instanceEnd netip.Addr) {
	v := u32(e.cfg.Pool.Addr()) + uint32(n)*4
	return fromU32(v + 1), fromU32(v + 2)
}

// u32 is IPv4 address a as a number; fromU32 its inverse.
func u32(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func fromU32(x uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(x >> 24), byte(x >> 16), byte(x >> 8), byte(x)})
}

// freeSlot returns the lowest /30 of the pool with no address in the uplink.
func (e *Egress) freeSlot(upH *netlink.Handle) (int, error) {
	addrs, err := upH.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return 0, fmt.Errorf("uplink addresses: %w", err)
	}
	used := map[int]bool{}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok && e.cfg.Pool.Contains(ip) {
			used[int((u32(ip)-u32(e.cfg.Pool.Addr()))/4)] = true
		}
	}
	slots := 1 << (32 - e.cfg.Pool.Bits() - 2)
	for n := 0; n < slots; n++ {
		if !used[n] {
			return n, nil
		}
	}
	return 0, fmt.Errorf("pool %s is full (%d instances)", e.cfg.Pool, slots)
}

// link makes the veth pair of slot n, its addresses and the default route.
func (e *Egress) link(hostH, upH *netlink.Handle, n int) error {
	upEnd, instEnd := e.slot(n)
	peer := fmt.Sprintf("%su%x", e.scope, n)
	if len(peer) > unix.IFNAMSIZ-1 {
		return fmt.Errorf("interface name %s is too long", peer)
	}
	// A leftover of a crashed server's instance in this slot would hold its
	// address; it has none (freeSlot), but its name may be taken.
	if old, err := upH.LinkByName(peer); err == nil {
		_ = upH.LinkDel(old)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: upName}, PeerName: peer,
		PeerNamespace: netlink.NsFd(int(e.uplink))}
	if err := hostH.LinkAdd(veth); err != nil {
		return fmt.Errorf("veth %s/%s: %w", upName, peer, err)
	}
	steps := []struct {
		h    *netlink.Handle
		name string
		addr netip.Addr
	}{{hostH, upName, instEnd}, {upH, peer, upEnd}}
	for _, s := range steps {
		l, err := s.h.LinkByName(s.name)
		if err != nil {
			return err
		}
		if err := s.h.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(s.addr, 30))}); err != nil {
			return fmt.Errorf("address %s on %s: %w", s.addr, s.name, err)
		}
		if err := s.h.LinkSetUp(l); err != nil {
			return err
		}
	}
	l, err := hostH.LinkByName(upName)
	if err != nil {
		return err
	}
	gw := upEnd.AsSlice()
	if err := hostH.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw}); err != nil {
		return fmt.Errorf("default route via %s: %w", upEnd, err)
	}
	return nil
}

// hostAddrs returns the addresses of the root namespace and of the uplink
// (IPv4, each as a /32), which no sandbox may reach.
func (e *Egress) hostAddrs() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, ns := range []netns.NsHandle{e.root, e.uplink} {
		h, err := netlink.NewHandleAt(ns)
		if err != nil {
			return nil, fmt.Errorf("sandboxnet: host addresses: %w", err)
		}
		addrs, err := h.AddrList(nil, netlink.FAMILY_V4)
		h.Close()
		if err != nil {
			return nil, fmt.Errorf("sandboxnet: host addresses: %w", err)
		}
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok && !e.cfg.Pool.Contains(ip) {
				out = append(out, netip.PrefixFrom(ip, 32))
			}
		}
	}
	return out, nil
}

// inNetns runs fn on an OS thread inside network namespace ns and returns its
// error. The thread is discarded if it cannot go back.
func inNetns(ns netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- ferr
	}()
	return <-errc
}

// detach removes the uplink veth of pair p (Attach), if there is one.
func detach(p Pair) error {
	host, err := netns.GetFromPath(netnsDir + "/" + p.Host)
	if err != nil {
		return nil // no namespace, no link
	}
	defer host.Close()
	h, err := netlink.NewHandleAt(host)
	if err != nil {
		return err
	}
	defer h.Close()
	l, err := h.LinkByName(upName)
	if err != nil {
		return nil
	}
	if err := h.LinkDel(l); err != nil {
		return fmt.Errorf("delete %s in %s: %w", upName, p.Host, err)
	}
	return nil
}

// waitUp waits up to a second for link name to be operationally up (a veth's
// carrier comes a moment after both ends are set up; packets sent before are
// dropped).
func waitUp(h *netlink.Handle, name string) {
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if l, err := h.LinkByName(name); err == nil && l.Attrs().OperState == netlink.OperUp {
			return
		}
	}
}
