package manager_test

import (
	"context"
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// uplinked is the fake engine with an uplink (engine.EgressProvider); it
// records the Egress of every start and restore.
type uplinked struct {
	*fake.Engine
	mu      sync.Mutex
	egress  []*engine.Egress
	resolve netip.Addr
}

func (e *uplinked) Resolver() (netip.Addr, error) { return e.resolve, nil }

func (e *uplinked) Start(ctx context.Context, spec engine.Spec) error {
	e.note(spec)
	return e.Engine.Start(ctx, spec)
}

func (e *uplinked) Restore(ctx context.Context, spec engine.Spec, dir string) error {
	e.note(spec)
	return e.Engine.Restore(ctx, spec, dir)
}

func (e *uplinked) note(spec engine.Spec) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.egress = append(e.egress, spec.Egress)
}

func (e *uplinked) last() *engine.Egress {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.egress[len(e.egress)-1]
}

// TestNetworkPolicy: a sandbox's egress policy is validated at create,
// defaults to internet access on a host with an uplink, is kept in its record
// and handed to the engine on every start and restore, and a fork clone has
// its source's; /etc/resolv.conf names the engine's resolver.
func TestNetworkPolicy(t *testing.T) {
	var up *uplinked
	h := newHost(t, hostOpts{wrap: func(f *fake.Engine) engine.Engine {
		up = &uplinked{Engine: f, resolve: netip.MustParseAddr("192.0.2.53")}
		return up
	}})
	ctx := context.Background()
	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, AllowOut: []string{"10.1.2.3", "10.9.0.0/16"},
		DenyOut: []string{" 2001:db8::/32 ", "198.51.100.7/24"}})
	if err != nil {
		t.Fatal(err)
	}
	want := sandbox.Network{InternetAccess: true,
		AllowOut: []netip.Prefix{netip.MustParsePrefix("10.1.2.3/32"), netip.MustParsePrefix("10.9.0.0/16")},
		DenyOut:  []netip.Prefix{netip.MustParsePrefix("2001:db8::/32"), netip.MustParsePrefix("198.51.100.0/24")}}
	if !reflect.DeepEqual(sb.Network, want) {
		t.Errorf("created: %+v, want %+v", sb.Network, want)
	}
	wantEngine := &engine.Egress{InternetAccess: true, AllowOut: want.AllowOut, DenyOut: want.DenyOut}
	if got := up.last(); !reflect.DeepEqual(got, wantEngine) {
		t.Errorf("start's egress %+v, want %+v", got, wantEngine)
	}
	if rc := h.readFile(sb.ID, "/etc/resolv.conf"); !strings.Contains(rc, "nameserver 192.0.2.53\n") {
		t.Errorf("/etc/resolv.conf: %q", rc)
	}
	if _, err := h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if got := up.last(); !reflect.DeepEqual(got, wantEngine) {
		t.Errorf("restore's egress %+v, want %+v", got, wantEngine)
	}
	clones, err := h.m.Fork(ctx, sb.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(clones[0].Network, want) || !reflect.DeepEqual(up.last(), wantEngine) {
		t.Errorf("clone: %+v, engine %+v", clones[0].Network, up.last())
	}
	if got := h.record(sb.ID).Network; !reflect.DeepEqual(got, want) {
		t.Errorf("record: %+v", got)
	}

	no := false
	off, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, InternetAccess: &no})
	if err != nil {
		t.Fatal(err)
	}
	if off.Network.InternetAccess || !reflect.DeepEqual(up.last(), &engine.Egress{}) {
		t.Errorf("internet off: %+v, engine %+v", off.Network, up.last())
	}
	for _, bad := range [][]string{{"10.0.0.0/33"}, {"example.com"}, {"fe80::1%eth0"}} {
		_, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, DenyOut: bad})
		if !errors.Is(err, sandbox.ErrInvalidArgument) || !strings.Contains(err.Error(), "deny_out") {
			t.Errorf("deny_out %q: %v, want invalid argument naming deny_out", bad, err)
		}
	}
}

// TestNetworkWithoutUplink: on an engine without an uplink a sandbox has no
// internet access by default, and asking for it or for allow_out is refused.
func TestNetworkWithoutUplink(t *testing.T) {
	h := newHost(t, hostOpts{})
	ctx := context.Background()
	yes := true
	for _, spec := range []sandbox.Spec{{InternetAccess: &yes}, {AllowOut: []string{"10.0.0.0/8"}}} {
		spec.Image, spec.MemoryMiB = "tiny", 64
		if _, err := h.m.Create(ctx, spec); !errors.Is(err, sandbox.ErrInvalidArgument) {
			t.Errorf("%+v: %v, want invalid argument", spec, err)
		}
	}
	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, DenyOut: []string{"10.0.0.0/8"}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Network.InternetAccess || len(sb.Network.DenyOut) != 1 {
		t.Errorf("default: %+v", sb.Network)
	}
}
