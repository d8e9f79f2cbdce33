package sandboxnet_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/sandboxnet/internettest"
)

var (
	webIP  = internettest.Web
	web2IP = internettest.Web2
	privIP = internettest.Private
	metaIP = internettest.Metadata
)

// get fetches http://addr/ from inside the guest namespace of p and returns the
// body, the error and how long it took.
func get(t *testing.T, p sandboxnet.Pair, addr netip.Addr) (string, error, time.Duration) {
	t.Helper()
	// A fresh pair's eth0 has its carrier a moment after Create: a packet sent
	// before is lost (and retried a second later). A sandbox's engine starts
	// long after; the test waits for it.
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var up bool
		sandboxnet.RunInNetns(p.Guest, func() error {
			i, err := net.InterfaceByName("eth0")
			up = err == nil && i.Flags&net.FlagRunning != 0
			return err
		})
		if up {
			break
		}
	}
	var c net.Conn
	t0 := time.Now()
	err := sandboxnet.RunInNetns(p.Guest, func() (err error) {
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

func TestEgressRules(t *testing.T) {
	hostIP := internettest.HostAddr(t)
	tn := internettest.New(t, hostIP)
	eg, err := sandboxnet.NewEgress(tn.Scope, sandboxnet.EgressConfig{UplinkNetns: tn.Uplink, Pool: netip.MustParsePrefix("10.214.0.0/24")})
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
	cases := []struct {
		name  string
		rules sandboxnet.Rules
		open  []netip.Addr
		shut  []netip.Addr
	}{
		{"internet", sandboxnet.Rules{InternetAccess: true}, []netip.Addr{webIP, web2IP}, []netip.Addr{privIP, metaIP, hostIP}},
		{"deny", sandboxnet.Rules{InternetAccess: true, DenyOut: pfx("198.19.0.10/32")}, []netip.Addr{web2IP}, []netip.Addr{webIP, privIP}},
		{"allow private", sandboxnet.Rules{InternetAccess: true, AllowOut: pfx("10.77.0.0/24")}, []netip.Addr{webIP, privIP}, []netip.Addr{metaIP, hostIP}},
		{"deny wins", sandboxnet.Rules{InternetAccess: true, AllowOut: pfx("198.19.0.0/24"), DenyOut: pfx("198.19.0.0/24")}, nil, []netip.Addr{webIP}},
		{"allow cannot open", sandboxnet.Rules{InternetAccess: true, AllowOut: pfx("169.254.0.0/16", hostIP.String()+"/32", "10.214.0.0/16")},
			[]netip.Addr{webIP}, []netip.Addr{metaIP, hostIP}},
		{"off", sandboxnet.Rules{}, nil, []netip.Addr{webIP, privIP}},
		{"off but allowed", sandboxnet.Rules{AllowOut: pfx("198.19.0.11/32")}, []netip.Addr{web2IP}, []netip.Addr{webIP, privIP}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := sandboxnet.For(tn.Scope, fmt.Sprintf("c%d", i))
			ctx := context.Background()
			if err := sandboxnet.Create(ctx, p); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { sandboxnet.Delete(ctx, p) })
			if err := eg.Attach(ctx, p, c.rules); err != nil {
				t.Fatal(err)
			}
			for _, a := range c.open {
				body, err, _ := get(t, p, a)
				if err != nil || body != "hello from "+a.String()+":80" {
					t.Errorf("%s: want it reached, got %q, %v", a, body, err)
				}
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
	for _, a := range []netip.Addr{privIP, metaIP, hostIP} {
		if err := tn.Reachable(a); err != nil {
			t.Errorf("from the uplink %s does not answer: the refusals above prove nothing: %v", a, err)
		}
	}
}

// TestEgressClones: two instances with the same guest address (clones of one
// snapshot) reach out at once, each behind its own pool address; deleting
// their pairs removes their uplink links.
func TestEgressClones(t *testing.T) {
	tn := internettest.New(t)
	eg, err := sandboxnet.NewEgress(tn.Scope, sandboxnet.EgressConfig{UplinkNetns: tn.Uplink, Pool: netip.MustParsePrefix("10.214.0.0/24")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eg.Close() })
	ctx := context.Background()
	var pairs []sandboxnet.Pair
	for i := range 2 {
		p := sandboxnet.For(tn.Scope, fmt.Sprintf("k%d", i))
		if err := sandboxnet.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sandboxnet.Delete(ctx, p) })
		t0 := time.Now()
		if err := eg.Attach(ctx, p, sandboxnet.Rules{InternetAccess: true}); err != nil {
			t.Fatal(err)
		}
		t.Logf("attach %s: %v", p.Host, time.Since(t0).Round(10*time.Microsecond))
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
		sandboxnet.Delete(ctx, p)
	}
	if l := links(); strings.Contains(l, "10.214.0.") {
		t.Errorf("uplink addresses after delete:\n%s", l)
	}
}

// TestEgressUplinkInterface: with an uplink interface (torpor serve --uplink)
// instead of a namespace, traffic leaves through that interface, masqueraded.
// The "host" here is the stand-in's uplink namespace: NewEgress runs on a
// thread inside it, so the interface and its forwarding setting are that
// namespace's, and nothing of the real host's is touched.
func TestEgressUplinkInterface(t *testing.T) {
	tn := internettest.New(t)
	var eg *sandboxnet.Egress
	err := sandboxnet.RunInNetns(tn.Uplink, func() error {
		if _, err := sandboxnet.NewEgress(tn.Scope, sandboxnet.EgressConfig{UplinkIface: "i0"}); err == nil ||
			!strings.Contains(err.Error(), "ip_forward") {
			t.Errorf("without forwarding: %v, want refused naming ip_forward", err)
		}
		if err := writeSysctl("/proc/sys/net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
		var err error
		eg, err = sandboxnet.NewEgress(tn.Scope, sandboxnet.EgressConfig{UplinkIface: "i0", Pool: netip.MustParsePrefix("10.214.0.0/24")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eg.Close() })
	ctx := context.Background()
	p := sandboxnet.For(tn.Scope, "if0")
	if err := sandboxnet.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sandboxnet.Delete(ctx, p) })
	if err := eg.Attach(ctx, p, sandboxnet.Rules{InternetAccess: true}); err != nil {
		t.Fatal(err)
	}
	if body, err, _ := get(t, p, webIP); err != nil || body != "hello from "+webIP.String()+":80" {
		t.Errorf("through the uplink interface: %q, %v", body, err)
	}
	if _, err, _ := get(t, p, privIP); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("private address: %v, want refused", err)
	}
}

func writeSysctl(path, v string) error { return os.WriteFile(path, []byte(v), 0) }
