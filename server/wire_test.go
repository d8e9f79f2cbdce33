package server

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/sandbox"
)

// fill sets every field reachable from v (a pointer) to a distinct non-zero
// value: strings, numbers, bools, times, pointers, one-element slices and
// maps, nested structs. A conversion that drops a field then shows in a
// round trip.
func fill(v any) {
	n := 0
	var f func(reflect.Value)
	f = func(v reflect.Value) {
		n++
		switch v.Kind() {
		case reflect.String:
			v.SetString("s" + strings.Repeat("x", n))
		case reflect.Int, reflect.Int64:
			v.SetInt(int64(n))
		case reflect.Float64:
			v.SetFloat(float64(n) + 0.5)
		case reflect.Bool:
			v.SetBool(true)
		case reflect.Pointer:
			v.Set(reflect.New(v.Type().Elem()))
			f(v.Elem())
		case reflect.Slice:
			v.Set(reflect.MakeSlice(v.Type(), 1, 1))
			f(v.Index(0))
		case reflect.Map:
			m := reflect.MakeMap(v.Type())
			k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
			f(k)
			f(e)
			m.SetMapIndex(k, e)
			v.Set(m)
		case reflect.Struct:
			if v.Type() == reflect.TypeOf(time.Time{}) {
				v.Set(reflect.ValueOf(time.Date(2030, 1, 1, 0, 0, n, 0, time.UTC)))
				return
			}
			if v.Type() == reflect.TypeOf(netip.Prefix{}) {
				v.Set(reflect.ValueOf(netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(n), 0, 0}), 16)))
				return
			}
			for i := 0; i < v.NumField(); i++ {
				f(v.Field(i))
			}
		default:
			panic("fill: unhandled kind " + v.Kind().String())
		}
	}
	f(reflect.ValueOf(v).Elem())
}

// The inverses of wire.go's mappings, for the round trips.

func sandboxFromWire(w apiv1.Sandbox) sandbox.Sandbox {
	s := sandbox.Sandbox{
		ID: w.ID, State: sandbox.State(w.State), Image: w.Image, ImageDigest: w.ImageDigest,
		MemoryMiB: w.MemoryMiB, PidsLimit: w.PidsLimit, CPUs: w.CPUs, Env: w.Env, Generation: w.Generation, ForkedFrom: w.ForkedFrom, Node: w.Node,
		Error: w.Error, CreatedAt: w.CreatedAt, StateChangedAt: w.StateChangedAt,
		LastHibernateAt: w.LastHibernateAt, LastResumeAt: w.LastResumeAt, ResumeMS: w.ResumeMS,
		IdleTimeoutS: w.IdleTimeoutS, PauseAfterS: w.PauseAfterS, TimeoutS: w.TimeoutS, OnTimeout: w.OnTimeout,
		Hibernation: sandbox.Hibernation(w.Hibernation), OnResume: w.OnResume, Usage: sandbox.Usage(w.Usage),
		ExpiresAt: w.ExpiresAt, Network: sandbox.Network{InternetAccess: w.InternetAccess},
	}
	for _, p := range w.AllowOut {
		s.Network.AllowOut = append(s.Network.AllowOut, netip.MustParsePrefix(p))
	}
	for _, p := range w.DenyOut {
		s.Network.DenyOut = append(s.Network.DenyOut, netip.MustParsePrefix(p))
	}
	for _, v := range w.Volumes {
		s.Volumes = append(s.Volumes, sandbox.VolumeMount(v))
	}
	if w.Snapshot != nil {
		snap := sandbox.Snapshot(*w.Snapshot)
		s.Snapshot = &snap
	}
	if r := w.LastResume; r != nil {
		s.LastResume = &sandbox.ResumeReport{Event: r.Event, Generation: r.Generation, Forked: r.Forked,
			SnapshotID: r.SnapshotID, Clock: sandbox.ResumeClock(r.Clock), Subscribers: sandbox.ResumeSubscribers(r.Subscribers),
			OK: r.OK, WindowMS: r.WindowMS, AgentMS: r.AgentMS, Error: r.Error}
		for _, st := range r.Steps {
			s.LastResume.Steps = append(s.LastResume.Steps, sandbox.ResumeStep(st))
		}
		for _, h := range r.Hooks {
			s.LastResume.Hooks = append(s.LastResume.Hooks, sandbox.ResumeHook(h))
		}
	}
	return s
}

func specToWire(s sandbox.Spec) apiv1.CreateSandboxRequest {
	w := apiv1.CreateSandboxRequest{Image: s.Image, MemoryMiB: s.MemoryMiB, PidsLimit: s.PidsLimit, CPUs: s.CPUs, Env: s.Env,
		IdleTimeoutS: s.IdleTimeoutS, PauseAfterS: s.PauseAfterS, TimeoutS: s.TimeoutS, OnTimeout: s.OnTimeout,
		HibernationMode: s.HibernationMode, OnResume: s.OnResume, ExpiresAt: s.ExpiresAt,
		InternetAccess: s.InternetAccess, AllowOut: s.AllowOut, DenyOut: s.DenyOut}
	for _, v := range s.Volumes {
		w.Volumes = append(w.Volumes, apiv1.VolumeMount(v))
	}
	return w
}

func policyUpdateToWire(u sandbox.PolicyUpdate) apiv1.UpdateSandboxRequest {
	return apiv1.UpdateSandboxRequest{IdleTimeoutS: u.IdleTimeoutS, PauseAfterS: u.PauseAfterS, TimeoutS: u.TimeoutS, OnTimeout: u.OnTimeout,
		HibernationMode: u.HibernationMode, OnResume: u.OnResume,
		ExpiresAt: apiv1.Expiry{Set: u.ExpiresAt.Set, At: u.ExpiresAt.At}}
}

func TestWireRoundTrip(t *testing.T) {
	var sb sandbox.Sandbox
	fill(&sb)
	// Fields API v1 does not carry (the E2B API's: api/e2b).
	sb.ResumeOnRequest, sb.TimeoutLeftS, sb.Metadata, sb.Network.PrivateTraffic = false, 0, nil, false
	if got := sandboxFromWire(wireSandbox(sb)); !reflect.DeepEqual(got, sb) {
		t.Errorf("sandbox round trip:\n got %+v\nwant %+v", got, sb)
	}
	var create apiv1.CreateSandboxRequest
	fill(&create)
	if got := specToWire(specFromWire(create)); !reflect.DeepEqual(got, create) {
		t.Errorf("create request round trip:\n got %+v\nwant %+v", got, create)
	}
	var update apiv1.UpdateSandboxRequest
	fill(&update)
	if got := policyUpdateToWire(policyUpdateFromWire(update)); !reflect.DeepEqual(got, update) {
		t.Errorf("update request round trip:\n got %+v\nwant %+v", got, update)
	}
	if sandboxFromWire(wireSandbox(sandbox.Sandbox{})).Snapshot != nil || wireSandbox(sandbox.Sandbox{}).LastResume != nil {
		t.Error("a sandbox without snapshot or report gained one")
	}
}

// TestWireEmptyAndNil: the JSON of a mapped value tells an empty list from an
// absent one as the manager's value did (steps [] stays [], not null).
func TestWireEmptyAndNil(t *testing.T) {
	b, err := json.Marshal(wireSandbox(sandbox.Sandbox{LastResume: &sandbox.ResumeReport{Steps: []sandbox.ResumeStep{}}}))
	if err != nil {
		t.Fatal(err)
	}
	if s := string(b); !strings.Contains(s, `"steps":[]`) || !strings.Contains(s, `"hooks":null`) {
		t.Errorf("report JSON: %s", s)
	}
	if got := wireSandboxes([]sandbox.Sandbox{}); got == nil || len(got) != 0 {
		t.Errorf("empty list mapped to %#v", got)
	}
	if got := wireSnapshots(nil); got != nil {
		t.Errorf("nil list mapped to %#v", got)
	}
}

// TestClassifyKinds: each kind of sandbox.Error answers its status, also when
// wrapped; an Internal one wrapping an image error answers the image error's.
func TestClassifyKinds(t *testing.T) {
	for kind, want := range map[sandbox.Kind]int{sandbox.NotFound: 404, sandbox.InvalidArgument: 400,
		sandbox.Conflict: 409, sandbox.SnapshotCorrupt: 422, sandbox.Unavailable: 503, sandbox.Internal: 500} {
		err := error(&sandbox.Error{Kind: kind, Op: "resume", SandboxID: "sbx-1"})
		if got, _ := classify(err); got != want {
			t.Errorf("classify(%v) = %d, want %d", kind, got, want)
		}
	}
	if got, code := classify(invalidArgument("x")); got != 400 || code != apiv1.CodeInvalidArgument {
		t.Errorf("invalid argument: %d %s", got, code)
	}
	if got, _ := classify(sandbox.Errorf(sandbox.InvalidArgument, "%w: 1 bytes at most", errBodyTooLarge)); got != 413 {
		t.Errorf("body too large: %d", got)
	}
}
