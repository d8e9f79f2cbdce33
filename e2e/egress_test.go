package e2e

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/sandboxnet/internettest"
	"github.com/torpor/torpor/server/servertest"
)

// probe fetches argv[1] with urllib and prints "OK <body>" or "ERR <seconds>
// <error>".
const probe = `import sys, time, urllib.request
t = time.time()
try:
    print("OK", urllib.request.urlopen(sys.argv[1], timeout=8).read().decode())
except Exception as e:
    print("ERR %.2f %r" % (time.time() - t, e))
`

// fetch runs probe on url in sandbox id.
func fetch(t *testing.T, c *client.Client, id, url string) string {
	t.Helper()
	out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"python3", "-c", probe, url}})
	if code != 0 {
		t.Fatalf("probe in %s: exit %d: %s", id, code, errb)
	}
	return strings.TrimSpace(out)
}

// wantReach checks that sandbox id reaches url and gets the stand-in's hello
// from addr.
func wantReach(t *testing.T, c *client.Client, id, url string, addr netip.Addr) {
	t.Helper()
	if got, want := fetch(t, c, id, url), "OK hello from "+addr.String()+":80"; got != want {
		t.Errorf("%s: %s: got %q, want %q", id, url, got, want)
	}
}

// wantRefused checks that sandbox id's request to url fails within a second
// (refused by the filter, not timed out).
func wantRefused(t *testing.T, c *client.Client, id, url string) {
	t.Helper()
	got := fetch(t, c, id, url)
	var secs float64
	if !strings.HasPrefix(got, "ERR ") {
		t.Errorf("%s: %s: reached (%q), want refused", id, url, got)
		return
	}
	if _, err := fmt.Sscan(got[4:], &secs); err != nil || secs > 1 {
		t.Errorf("%s: %s: %q, want refused at once", id, url, got)
	}
}

// TestEgress: sandboxes reach a stand-in internet (internettest) through the
// server's uplink by DNS name, as their rules allow, and nothing else; the
// rules hold after a hibernate and resume and in a fork clone.
func TestEgress(t *testing.T) {
	hostIP := internettest.HostAddr(t)
	tn := internettest.New(t, hostIP)
	srv := start(t, servertest.Options{Egress: &sandboxnet.EgressConfig{UplinkNetns: tn.Uplink,
		DNS: internettest.Resolver, Pool: netip.MustParsePrefix("10.214.0.0/24")}})
	c := srv.Client
	for _, a := range []netip.Addr{internettest.Private, internettest.Metadata, hostIP} {
		if err := tn.Reachable(a); err != nil {
			t.Fatalf("the stand-in internet does not answer on %s: the refusals below would prove nothing: %v", a, err)
		}
	}
	no := false
	web, web2, priv := "http://web.test/", "http://web2.test/", "http://private.test/"
	meta, host := "http://169.254.169.254/", "http://"+hostIP.String()+"/"

	open := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128})
	if !open.InternetAccess {
		t.Errorf("default create: internet_access false, want true on a server with an uplink")
	}
	if rc := readFile(t, c, open.ID, "/etc/resolv.conf"); !strings.Contains(string(rc), "nameserver "+internettest.Resolver.String()) {
		t.Errorf("/etc/resolv.conf: %q", rc)
	}
	wantReach(t, c, open.ID, web, internettest.Web)
	for _, u := range []string{priv, "http://" + internettest.Private.String() + "/", meta, host} {
		wantRefused(t, c, open.ID, u)
	}

	off := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128, InternetAccess: &no})
	wantRefused(t, c, off.ID, "http://"+internettest.Web.String()+"/")

	// deny_out covers the resolver's network too: names still resolve (the
	// resolver's port 53 comes before deny_out).
	deny := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128, DenyOut: []string{"198.19.0.10", "198.18.5.0/24"}})
	if len(deny.DenyOut) != 2 || deny.DenyOut[0] != "198.19.0.10/32" {
		t.Errorf("deny_out in the answer: %q", deny.DenyOut)
	}
	allow := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128,
		AllowOut: []string{"10.77.0.0/24", "169.254.0.0/16", hostIP.String()}})

	checkDeny := func(id string) {
		wantRefused(t, c, id, web)
		wantReach(t, c, id, web2, internettest.Web2)
	}
	checkAllow := func(id string) {
		wantReach(t, c, id, priv, internettest.Private)
		wantReach(t, c, id, web, internettest.Web)
		wantRefused(t, c, id, meta)
		wantRefused(t, c, id, host)
	}
	checkDeny(deny.ID)
	checkAllow(allow.ID)

	for _, id := range []string{deny.ID, allow.ID} {
		hibernate(t, c, id)
		if _, err := c.Resume(ctxFor(t, 2*time.Minute), id); err != nil {
			t.Fatalf("resume %s: %v", id, err)
		}
	}
	checkDeny(deny.ID)
	checkAllow(allow.ID)

	clones, err := c.Fork(ctxFor(t, 5*time.Minute), allow.ID, 1)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	clone := clones[0]
	if len(clone.AllowOut) != 3 || !clone.InternetAccess {
		t.Errorf("clone's policy: internet %v, allow_out %q", clone.InternetAccess, clone.AllowOut)
	}
	// The clone keeps the guest's address; both reach out at once.
	checkAllow(clone.ID)
	checkAllow(allow.ID)
}

// TestEgressWithoutUplink: a server without an uplink gives sandboxes no
// egress, says so in the sandbox, and refuses a create that asks for it.
func TestEgressWithoutUplink(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	yes := true
	for _, req := range []apiv1.CreateSandboxRequest{
		{MemoryMiB: 128, InternetAccess: &yes},
		{MemoryMiB: 128, AllowOut: []string{"10.0.0.0/8"}},
	} {
		_, err := c.CreateSandbox(ctxFor(t, time.Minute), req)
		if err == nil || !strings.Contains(err.Error(), "no uplink") {
			t.Errorf("create %+v: %v, want refused for want of an uplink", req, err)
		}
	}
	if _, err := c.CreateSandbox(ctxFor(t, time.Minute), apiv1.CreateSandboxRequest{DenyOut: []string{"10.0.0.0/33"}}); err == nil ||
		!strings.Contains(err.Error(), "deny_out") {
		t.Errorf("a bad prefix: %v", err)
	}
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128})
	if sb.InternetAccess {
		t.Errorf("default create without an uplink: internet_access true")
	}
	if got := fetch(t, c, sb.ID, "http://"+internettest.Web.String()+"/"); !strings.HasPrefix(got, "ERR") {
		t.Errorf("a sandbox without egress reached out: %q", got)
	}
}
