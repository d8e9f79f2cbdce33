package sandboxnet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
)

// testNet is a stand-in internet for egress tests: an uplink namespace and an
// "internet" namespace behind it, joined by a veth, with addresses of the
// benchmark range 198.18.0.0/15 and, on the internet's loopback, the addresses
// the tests aim at. Nothing is routed outside these namespaces; Cleanup removes
// them by name.
type testNet struct {
	Uplink, Internet string
	scope            string
}

// Addresses served by the stand-in internet.
var (
	webIP     = netip.MustParseAddr("198.19.0.10")
	web2IP    = netip.MustParseAddr("198.19.0.11")
	privIP    = netip.MustParseAddr("10.77.0.10")
	metaIP    = netip.MustParseAddr("169.254.169.254")
	uplinkEnd = "198.18.0.1"
	inetEnd   = "198.18.0.2"
)

func ipBatch(t *testing.T, ns, batch string) {
	t.Helper()
	args := []string{"-batch", "-"}
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	if err := ip(context.Background(), batch, args...); err != nil {
		t.Fatal(err)
	}
}

func newTestNet(t *testing.T, extra ...netip.Addr) *testNet {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	b := make([]byte, 3)
	rand.Read(b)
	n := &testNet{scope: "tpt" + hex.EncodeToString(b)[:5]}
	n.Uplink, n.Internet = n.scope+"-up", n.scope+"-inet"
	t.Cleanup(func() {
		for _, ns := range []string{n.Uplink, n.Internet} {
			_ = ip(context.Background(), "", "netns", "delete", ns)
		}
	})
	ipBatch(t, "", "netns add "+n.Uplink+"\nnetns add "+n.Internet+"\n")
	ipBatch(t, n.Uplink, "link set lo up\nlink add i0 type veth peer name u0 netns "+n.Internet+"\n"+
		"addr add "+uplinkEnd+"/30 dev i0\nlink set i0 up\nroute add default via "+inetEnd+"\n")
	lo := ""
	for _, a := range append([]netip.Addr{webIP, web2IP, privIP, metaIP}, extra...) {
		lo += "addr add " + a.String() + "/32 dev lo\n"
	}
	ipBatch(t, n.Internet, "link set lo up\n"+lo+"addr add "+inetEnd+"/30 dev u0\nlink set u0 up\n")
	return n
}

// serveHTTP serves "hello from <local address>" on port 80 of every address of
// namespace ns.
func serveHTTP(t *testing.T, ns string) {
	t.Helper()
	h, err := netns.GetFromPath(netnsDir + "/" + ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var ln net.Listener
	if err := inNetns(h, func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:80"); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s", r.Context().Value(http.LocalAddrContextKey))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}

// get fetches http://addr/ from inside the guest namespace of p and returns the
// body, the error and how long it took.
func get(t *testing.T, p Pair, addr netip.Addr) (string, error, time.Duration) {
	t.Helper()
	h, err := netns.GetFromPath(p.GuestPath())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var c net.Conn
	t0 := time.Now()
	err = inNetns(h, func() (err error) {
		c, err = net.DialTimeout("tcp4", addr.String()+":80", 3*time.Second)
		return err
	})
	if err != nil {
		return "", err, time.Since(t0)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: x\r\n\r\n")
	b, err := io.ReadAll(c)
	body := string(b)
	if i := strings.Index(body, "\r\n\r\n"); i >= 0 {
		body = body[i+4:]
	}
	return body, err, time.Since(t0)
}

func hostAddr(t *testing.T) netip.Addr {
	t.Helper()
	ifs, _ := net.InterfaceAddrs()
	for _, a := range ifs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP.To4()); ok && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
				return ip
			}
		}
	}
	t.Skip("the host has no IPv4 address but loopback")
	return netip.Addr{}
}

func TestEgressRules(t *testing.T) {
	hostIP := hostAddr(t)
	if privIP == hostIP {
		t.Skip("the host uses " + privIP.String())
	}
	tn := newTestNet(t, hostIP)
	serveHTTP(t, tn.Internet)
	eg, err := NewEgress(tn.scope, EgressConfig{UplinkNetns: tn.Uplink, Pool: netip.MustParsePrefix("10.214.0.0/24")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eg.Close() })

	pfx := func(s ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, x := range s {
			out = append(out, netip.MustParsePrefix(x))
		}
		return out
	}
	reach := map[string]bool{} // filled per case: address -> reachable
	cases := []struct {
		name  string
		rules Rules
		open  []netip.Addr
		shut  []netip.Addr
	}{
		{"internet", Rules{InternetAccess: true}, []netip.Addr{webIP, web2IP}, []netip.Addr{privIP, metaIP, hostIP}},
		{"deny", Rules{InternetAccess: true, DenyOut: pfx("198.19.0.10/32")}, []netip.Addr{web2IP}, []netip.Addr{webIP, privIP}},
		{"allow private", Rules{InternetAccess: true, AllowOut: pfx("10.77.0.0/24")}, []netip.Addr{webIP, privIP}, []netip.Addr{metaIP, hostIP}},
		{"deny wins", Rules{InternetAccess: true, AllowOut: pfx("198.19.0.0/24"), DenyOut: pfx("198.19.0.0/24")}, nil, []netip.Addr{webIP}},
		{"allow cannot open", Rules{InternetAccess: true, AllowOut: pfx("169.254.0.0/16", hostIP.String()+"/32", "10.214.0.0/16")},
			[]netip.Addr{webIP}, []netip.Addr{metaIP, hostIP}},
		{"off but allowed", Rules{AllowOut: pfx("198.19.0.11/32")}, []netip.Addr{web2IP}, []netip.Addr{webIP, privIP}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := For(tn.scope, fmt.Sprintf("c%d", i))
			ctx := context.Background()
			if err := Create(ctx, p); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { Delete(ctx, p) })
			if err := eg.Attach(ctx, p, c.rules); err != nil {
				t.Fatal(err)
			}
			for _, a := range c.open {
				body, err, _ := get(t, p, a)
				if err != nil || body != "hello from "+a.String()+":80" {
					t.Errorf("%s: want it reached, got %q, %v", a, body, err)
				}
				reach[a.String()] = true
			}
			for _, a := range c.shut {
				body, err, took := get(t, p, a)
				if err == nil {
					t.Errorf("%s: reached (%q), want refused", a, body)
				} else if !errors.Is(err, syscall.ECONNREFUSED) || took > time.Second {
					t.Errorf("%s: %v after %v, want connection refused at once", a, err, took)
				}
			}
		})
	}
	// Without the rules each shut address would answer: the stand-in internet
	// serves every one of them (checked from the uplink namespace directly).
	up, _ := netns.GetFromPath(netnsDir + "/" + tn.Uplink)
	defer up.Close()
	for _, a := range []netip.Addr{privIP, metaIP, hostIP} {
		var c net.Conn
		if err := inNetns(up, func() (err error) { c, err = net.DialTimeout("tcp4", a.String()+":80", 2*time.Second); return err }); err != nil {
			t.Errorf("from the uplink %s does not answer: the refusals above prove nothing: %v", a, err)
		} else {
			c.Close()
		}
	}
}

// TestEgressClones: two instances with the same guest address (clones of one
// snapshot) reach out at once, each behind its own pool address; deleting
// their pairs removes their uplink links.
func TestEgressClones(t *testing.T) {
	tn := newTestNet(t)
	serveHTTP(t, tn.Internet)
	eg, err := NewEgress(tn.scope, EgressConfig{UplinkNetns: tn.Uplink, Pool: netip.MustParsePrefix("10.214.0.0/24")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eg.Close() })
	ctx := context.Background()
	var pairs []Pair
	for i := range 2 {
		p := For(tn.scope, fmt.Sprintf("k%d", i))
		if err := Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { Delete(ctx, p) })
		if err := eg.Attach(ctx, p, Rules{InternetAccess: true}); err != nil {
			t.Fatal(err)
		}
		pairs = append(pairs, p)
	}
	for _, p := range pairs {
		if body, err, _ := get(t, p, webIP); err != nil || !strings.HasPrefix(body, "hello") {
			t.Errorf("%s: %q, %v", p.Guest, body, err)
		}
	}
	links := func() string {
		out, _ := exec.Command("ip", "-n", tn.Uplink, "-o", "addr", "show").CombinedOutput()
		return string(out)
	}
	if l := links(); !strings.Contains(l, "10.214.0.1/30") || !strings.Contains(l, "10.214.0.5/30") {
		t.Errorf("uplink addresses: want two slots, got\n%s", l)
	}
	for _, p := range pairs {
		Delete(ctx, p)
	}
	if l := links(); strings.Contains(l, "10.214.0.") {
		t.Errorf("uplink addresses after delete:\n%s", l)
	}
}
