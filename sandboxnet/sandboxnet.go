// Package sandboxnet gives every sandbox instance its own network: two network
// namespaces joined by a veth pair.
//
//	guest namespace  "<prefix>-<id>-g": eth0 10.213.0.2/30, default route via .1
//	host namespace   "<prefix>-<id>-h": veth0 10.213.0.1/30
//
// The sandboxing engine takes over the guest namespace's eth0 (gVisor's netstack
// strips the address from the host kernel's view when it starts, see
// docs/decisions/gvisor-engine.md). The host side lives in a namespace of its own,
// not in the root namespace, so every instance — and every clone of one snapshot,
// which keeps the guest's address — can use the same addresses without clashing, and
// no sandbox has a route to another sandbox or to the host's networks. The host
// reaches a guest by dialing from inside the instance's host namespace (Dial).
//
// Names are kept in /run/netns (ip-netns(8)), so they outlive the server process and
// a restarted server finds them again (List). Since every pair is the same but for
// its names, a pair made ahead of time can be given to an instance by renaming it
// (Rename; the gVisor engine's spare pairs).
package sandboxnet

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Addresses every instance uses inside its own pair of namespaces.
const (
	GuestIP   = "10.213.0.2"
	HostIP    = "10.213.0.1"
	prefixLen = "30"
	// Fixed MACs keep the guest's ARP cache valid across a restore into a freshly
	// made namespace pair.
	guestMAC = "02:74:70:00:00:02"
	hostMAC  = "02:74:70:00:00:01"
)

const netnsDir = "/run/netns"

// Pair names the two namespaces of one instance.
type Pair struct {
	Guest string // name under /run/netns of the namespace the engine runs in
	Host  string // name under /run/netns of the host-side namespace
}

// For returns the pair of namespace names for instance id under prefix. It makes
// nothing.
func For(prefix, id string) Pair {
	return Pair{Guest: prefix + "-" + id + "-g", Host: prefix + "-" + id + "-h"}
}

// GuestPath is the path of the guest namespace, as an OCI spec names it.
func (p Pair) GuestPath() string { return netnsDir + "/" + p.Guest }

// Create makes both namespaces, the veth pair, addresses and routes. A pair left
// from an earlier incarnation under the same names is removed first. On error
// nothing is left behind.
func Create(ctx context.Context, p Pair) error {
	_ = Delete(ctx, p)
	steps := []struct {
		ns    string
		batch string
	}{
		{"", "netns add " + p.Guest + "\nnetns add " + p.Host + "\n"},
		{p.Guest, "link set lo up\n" +
			"link add eth0 address " + guestMAC + " type veth peer name veth0 address " + hostMAC + " netns " + p.Host + "\n" +
			"addr add " + GuestIP + "/" + prefixLen + " dev eth0\n" +
			"link set eth0 up\n" +
			"route add default via " + HostIP + "\n"},
		{p.Host, "link set lo up\n" +
			"addr add " + HostIP + "/" + prefixLen + " dev veth0\n" +
			"link set veth0 up\n"},
	}
	for _, s := range steps {
		args := []string{"-batch", "-"}
		if s.ns != "" {
			args = append([]string{"-n", s.ns}, args...)
		}
		if err := ip(ctx, s.batch, args...); err != nil {
			_ = Delete(ctx, p)
			return fmt.Errorf("sandboxnet: create %s: %w", p.Guest, err)
		}
	}
	return nil
}

// Delete removes both namespaces (and with them the veth pairs, the uplink's
// first: the kernel removes a deleted namespace's links later, and the
// uplink's end would hold its pool address until then). Missing namespaces
// are not an error.
func Delete(ctx context.Context, p Pair) error {
	var errs []string
	if err := detach(p); err != nil {
		errs = append(errs, err.Error())
	}
	for _, n := range []string{p.Guest, p.Host} {
		if _, err := os.Stat(netnsDir + "/" + n); err != nil {
			continue
		}
		if err := ip(ctx, "", "netns", "delete", n); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("sandboxnet: delete %s: %s", p.Guest, strings.Join(errs, "; "))
	}
	return nil
}

// Rename gives pair from's namespaces the names of pair to, keeping
// everything in them (links, addresses, routes, egress rules): each name under
// /run/netns is a bind mount of its namespace (ip-netns(8)), so the namespace is
// bind-mounted under the new name and the old mount is detached. A made pair
// renamed costs two bind mounts instead of Create's namespaces, veth pair and
// three ip(8) runs. Errors: to's names taken (fs.ErrExist), from's missing, or
// mount(2)'s; on error from keeps its names and nothing is made under to's.
func Rename(from, to Pair) error {
	moves := [][2]string{{from.Guest, to.Guest}, {from.Host, to.Host}}
	for i, mv := range moves {
		if err := renameNetns(mv[0], mv[1]); err != nil {
			for _, done := range moves[:i] {
				_ = renameNetns(done[1], done[0])
			}
			return fmt.Errorf("sandboxnet: rename %s to %s: %w", from.Guest, to.Guest, err)
		}
	}
	return nil
}

// renameNetns moves the namespace mounted at /run/netns/from to
// /run/netns/to.
func renameNetns(from, to string) error {
	src, dst := netnsDir+"/"+from, netnsDir+"/"+to
	f, err := os.OpenFile(dst, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return err
	}
	f.Close()
	if err := unix.Mount(src, dst, "none", unix.MS_BIND, ""); err != nil {
		os.Remove(dst)
		return fmt.Errorf("bind %s: %w", src, err)
	}
	if err := unix.Unmount(src, unix.MNT_DETACH); err != nil {
		_ = unix.Unmount(dst, unix.MNT_DETACH)
		os.Remove(dst)
		return fmt.Errorf("unmount %s: %w", src, err)
	}
	return os.Remove(src)
}

// List returns the names under /run/netns that start with prefix+"-".
func List(prefix string) ([]string, error) {
	ents, err := os.ReadDir(netnsDir)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), prefix+"-") {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// Dial connects to port on the guest from inside the pair's host namespace. The
// socket is created on an OS thread that has entered the namespace and keeps that
// namespace for its life; the thread returns to the original namespace afterwards.
func (p Pair) Dial(ctx context.Context, port int) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, fmt.Errorf("sandboxnet: open own netns: %w", err)}
			return
		}
		defer unix.Close(orig)
		target, err := unix.Open(netnsDir+"/"+p.Host, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, fmt.Errorf("sandboxnet: open netns %s: %w", p.Host, err)}
			return
		}
		defer unix.Close(target)
		if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, fmt.Errorf("sandboxnet: enter netns %s: %w", p.Host, err)}
			return
		}
		d := net.Dialer{Timeout: 5 * time.Second}
		c, derr := d.DialContext(ctx, "tcp", net.JoinHostPort(GuestIP, fmt.Sprint(port)))
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: Go discards it when this goroutine ends,
			// so no other goroutine ever runs in the wrong namespace.
			if c != nil {
				c.Close()
			}
			ch <- result{nil, fmt.Errorf("sandboxnet: return from netns %s: %w", p.Host, err)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{c, derr}
	}()
	r := <-ch
	return r.c, r.err
}

// RunIn runs fn on an OS thread inside the pair's host namespace (for tests that
// start a host-side server the guest can reach at HostIP).
func (p Pair) RunIn(fn func() error) error { return RunInNetns(p.Host, fn) }

// RunInNetns runs fn on an OS thread inside the network namespace named name
// (under /run/netns) and returns fn's error, or why the namespace could not be
// entered. A socket fn makes stays in that namespace.
func RunInNetns(name string, fn func() error) error {
	ns, err := netns.GetFromPath(netnsDir + "/" + name)
	if err != nil {
		return err
	}
	defer ns.Close()
	return inNetns(ns, fn)
}

func ip(ctx context.Context, stdin string, args ...string) error {
	cmd := exec.CommandContext(ctx, "ip", args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}
