// Package internettest gives egress tests a stand-in internet: an uplink
// network namespace (what torpor serve --uplink-netns names) and an "internet"
// namespace behind it, joined by a veth, with addresses of the benchmark range
// 198.18.0.0/15, which no real network uses, and on the internet's loopback the
// addresses tests aim at, an HTTP server and a DNS server. Nothing is routed
// outside these two namespaces, so nothing a sandbox sends can leave the
// machine whatever the rules under test do; the test's cleanup removes both
// namespaces by name.
package internettest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/torpor/torpor/sandboxnet"
)

// Addresses the stand-in internet serves. Web and Web2 are public-looking
// (benchmark range), Private is in 10/8, Metadata is the cloud metadata
// address, Resolver runs the DNS server.
var (
	Web      = netip.MustParseAddr("198.19.0.10")
	Web2     = netip.MustParseAddr("198.19.0.11")
	Private  = netip.MustParseAddr("10.77.0.10")
	Metadata = netip.MustParseAddr("169.254.169.254")
	Resolver = netip.MustParseAddr("198.18.5.53")
)

// Names the DNS server answers (A records), with a dot at the end.
var Names = map[string]netip.Addr{"web.test.": Web, "web2.test.": Web2, "private.test.": Private}

const (
	uplinkEnd = "198.18.0.1"
	inetEnd   = "198.18.0.2"
)

// Internet is a stand-in internet.
type Internet struct {
	// Uplink and Internet name the two namespaces (under /run/netns).
	Uplink, Internet string
	// Scope is a short random prefix (8 characters, like an engine's) the
	// names start with.
	Scope string
}

// New makes a stand-in internet that also answers on extra (e.g. one of the
// host's own addresses, to show that a refusal is the filter's), serving HTTP
// on port 80 of every address ("hello from <address>:80") and DNS for Names
// at Resolver. It skips the test without root.
func New(t testing.TB, extra ...netip.Addr) *Internet {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	b := make([]byte, 3)
	rand.Read(b)
	n := &Internet{Scope: "tpt" + hex.EncodeToString(b)[:5]}
	n.Uplink, n.Internet = n.Scope+"-up", n.Scope+"-inet"
	t.Cleanup(func() {
		for _, ns := range []string{n.Uplink, n.Internet} {
			_ = exec.Command("ip", "netns", "delete", ns).Run()
		}
	})
	ipBatch(t, "", "netns add "+n.Uplink+"\nnetns add "+n.Internet+"\n")
	ipBatch(t, n.Uplink, "link set lo up\nlink add i0 type veth peer name u0 netns "+n.Internet+"\n"+
		"addr add "+uplinkEnd+"/30 dev i0\nlink set i0 up\nroute add default via "+inetEnd+"\n")
	lo := ""
	for _, a := range append([]netip.Addr{Web, Web2, Private, Metadata, Resolver}, extra...) {
		lo += "addr add " + a.String() + "/32 dev lo\n"
	}
	ipBatch(t, n.Internet, "link set lo up\n"+lo+"addr add "+inetEnd+"/30 dev u0\nlink set u0 up\n")
	n.serveHTTP(t)
	n.serveDNS(t)
	return n
}

func ipBatch(t testing.TB, ns, batch string) {
	t.Helper()
	args := []string{"-batch", "-"}
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	cmd := exec.Command("ip", args...)
	cmd.Stdin = strings.NewReader(batch)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func (n *Internet) serveHTTP(t testing.TB) {
	var ln net.Listener
	if err := sandboxnet.RunInNetns(n.Internet, func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:80"); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s", r.Context().Value(http.LocalAddrContextKey))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}

func (n *Internet) serveDNS(t testing.TB) {
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		for _, qu := range q.Question {
			if a, ok := Names[strings.ToLower(qu.Name)]; ok && qu.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: qu.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60},
					A: a.AsSlice()})
			}
		}
		if len(m.Answer) == 0 && !strings.HasSuffix(strings.ToLower(q.Question[0].Name), ".test.") {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})
	addr := net.JoinHostPort(Resolver.String(), "53")
	var pc net.PacketConn
	var ln net.Listener
	err := sandboxnet.RunInNetns(n.Internet, func() (err error) {
		if pc, err = net.ListenPacket("udp4", addr); err != nil {
			return err
		}
		ln, err = net.Listen("tcp4", addr)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	udp, tcp := &dns.Server{PacketConn: pc, Handler: h}, &dns.Server{Listener: ln, Handler: h}
	go udp.ActivateAndServe()
	go tcp.ActivateAndServe()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		udp.ShutdownContext(ctx)
		tcp.ShutdownContext(ctx)
	})
}

// HostAddr returns one of the host's own IPv4 addresses (not loopback, not
// link-local), for tests that check it is refused; it skips the test when the
// host has none.
func HostAddr(t testing.TB) netip.Addr {
	t.Helper()
	ifs, _ := net.InterfaceAddrs()
	for _, a := range ifs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP.To4()); ok && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() && ip != Private {
				return ip
			}
		}
	}
	t.Skip("the host has no IPv4 address but loopback")
	return netip.Addr{}
}

// Reachable reports, from the uplink namespace itself (no sandbox filter in
// the way), whether HTTP on a answers: what a refusal test checks so that it
// proves the filter refused, not that nothing was there.
func (n *Internet) Reachable(a netip.Addr) error {
	return sandboxnet.RunInNetns(n.Uplink, func() error {
		c, err := net.DialTimeout("tcp4", a.String()+":80", 2*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
}
