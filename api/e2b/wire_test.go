package e2b

import (
	"encoding/json"
	"net/url"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"
)

// The request bodies below are what the SDKs' index.mjs builds (JSON.stringify drops
// the fields left undefined); sdk_test.go checks the same against the running SDKs.
func TestNewSandboxDefaults(t *testing.T) {
	for _, tc := range []struct {
		name, body                      string
		ttl                             time.Duration
		pause, memory, resume, internet bool
		unsupported                     []string
	}{
		{"2.51 default", `{"templateID":"base"}`, DefaultTimeout, false, true, false, true, nil},
		{"2.45 default", `{"templateID":"base","timeout":300,"secure":true,"allow_internet_access":true}`,
			300 * time.Second, false, true, false, true, nil},
		{"onTimeout pause, autoResume", `{"templateID":"base","metadata":{"user":"abc"},"envVars":{"A":"1"},"timeout":60,"autoPause":true,"autoResume":{"enabled":true}}`,
			time.Minute, true, true, true, true, nil},
		{"pause without memory, no internet", `{"templateID":"base","allow_internet_access":false,"autoPause":true,"autoPauseMemory":false}`,
			DefaultTimeout, true, false, false, false, nil},
		{"onTimeout kill", `{"templateID":"base","autoPause":false,"timeout":60}`, time.Minute, false, true, false, true, nil},
		{"unsupported", `{"templateID":"base","network":{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"],"allowPublicTraffic":false,"maskRequestHost":"${PORT}-x.example.com"},"volumeMounts":[{"name":"v","path":"/data"}],"mcp":{"github":{}},"iam":{"tokens":{"t":{"audience":"a","tokenType":"jwt"}}}}`,
			DefaultTimeout, false, true, false, true, []string{"network", "iam", "volumeMounts", "mcp"}},
		{"empty network and null mcp", `{"templateID":"base","network":{},"mcp":null}`, DefaultTimeout, false, true, false, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r NewSandbox
			if err := strictDecode([]byte(tc.body), &r); err != nil {
				t.Fatal(err)
			}
			ttl, err := r.TTL()
			if err != nil || ttl != tc.ttl {
				t.Errorf("TTL = %v, %v; want %v", ttl, err, tc.ttl)
			}
			if r.PausesOnTimeout() != tc.pause || r.KeepsMemoryOnPause() != tc.memory ||
				r.ResumesOnRequest() != tc.resume || r.InternetAccess() != tc.internet {
				t.Errorf("pause %v memory %v resume %v internet %v; want %v %v %v %v",
					r.PausesOnTimeout(), r.KeepsMemoryOnPause(), r.ResumesOnRequest(), r.InternetAccess(),
					tc.pause, tc.memory, tc.resume, tc.internet)
			}
			if got := r.Unsupported(); !reflect.DeepEqual(got, tc.unsupported) {
				t.Errorf("Unsupported() = %q, want %q", got, tc.unsupported)
			}
		})
	}
}

// TestNewSandboxPublicTraffic: network.allowPublicTraffic false (what the SDKs send
// for network: {allowPublicTraffic: false}) is served, alone or with egress rules;
// left out or true is public, E2B's default.
func TestNewSandboxPublicTraffic(t *testing.T) {
	for _, tc := range []struct {
		body   string
		public bool
	}{
		{`{"templateID":"base"}`, true},
		{`{"templateID":"base","network":{}}`, true},
		{`{"templateID":"base","network":{"allowPublicTraffic":true}}`, true},
		{`{"templateID":"base","network":{"allowPublicTraffic":false}}`, false},
		{`{"templateID":"base","network":{"allowPublicTraffic":false,"denyOut":["0.0.0.0/0"]}}`, false},
	} {
		var r NewSandbox
		if err := strictDecode([]byte(tc.body), &r); err != nil {
			t.Fatal(err)
		}
		if r.PublicTraffic() != tc.public || r.Unsupported() != nil {
			t.Errorf("%s: PublicTraffic %v, Unsupported %q; want %v and none", tc.body, r.PublicTraffic(), r.Unsupported(), tc.public)
		}
	}
}

// TestTimeoutBounds: E2B's bounds on timeout, in E2B's field name: create and
// fork refuse 0 (as E2B's API does), connect and setTimeout take it; none
// takes a negative one or one over MaxTimeout.
func TestTimeoutBounds(t *testing.T) {
	huge := int32(MaxTimeout/time.Second) + 1
	for _, c := range []struct {
		what string
		ttl  func(n int32) (time.Duration, error)
		zero bool
	}{
		{"create", func(n int32) (time.Duration, error) { return NewSandbox{Timeout: &n}.TTL() }, false},
		{"fork", func(n int32) (time.Duration, error) { return ForkRequest{Timeout: &n}.TTL() }, false},
		{"connect", func(n int32) (time.Duration, error) { return ConnectRequest{Timeout: &n}.TTL() }, true},
		{"setTimeout", func(n int32) (time.Duration, error) { return TimeoutRequest{Timeout: &n}.TTL() }, true},
	} {
		if d, err := c.ttl(0); c.zero != (err == nil) || d != 0 {
			t.Errorf("%s timeout 0: %v, %v; want accepted %v", c.what, d, err, c.zero)
		} else if err != nil && !strings.Contains(err.Error(), "at least 1 second") {
			t.Errorf("%s timeout 0: %v", c.what, err)
		}
		for _, n := range []int32{-1, huge} {
			_, err := c.ttl(n)
			if err == nil || !strings.HasPrefix(err.Error(), "timeout ") || strings.Contains(err.Error(), "timeout_s") || strings.Contains(err.Error(), "none") {
				t.Errorf("%s timeout %d: %v, want an error naming timeout", c.what, n, err)
			}
		}
		if d, err := c.ttl(huge - 1); err != nil || d != MaxTimeout {
			t.Errorf("%s timeout %d: %v, %v", c.what, huge-1, d, err)
		}
	}
	if _, err := (TimeoutRequest{}).TTL(); err == nil {
		t.Error("timeout request without timeout: no error")
	}
	for _, n := range []int32{0, -1, MaxForkCount + 1} {
		if _, err := (ForkRequest{Count: &n}).N(); err == nil {
			t.Errorf("fork count %d: no error", n)
		}
	}
}

func TestSmallRequestDefaults(t *testing.T) {
	decode := func(body string, v any) {
		t.Helper()
		if err := strictDecode([]byte(body), v); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
	}
	var c ConnectRequest
	decode(`{"memory":false}`, &c) // 2.51 onResume: 'reboot', no timeout
	if d, _ := c.TTL(); d != DefaultTimeout || c.KeepsMemory() {
		t.Errorf("connect {memory:false}: TTL %v memory %v", d, c.KeepsMemory())
	}
	var p PauseRequest
	decode(`{}`, &p) // 2.51 pause()
	if !p.KeepsMemory() {
		t.Error("pause {}: memory false, want true")
	}
	var f ForkRequest
	decode(`{}`, &f) // 2.51 fork() with no options
	if n, err := f.N(); n != 1 || err != nil {
		t.Errorf("fork {}: count %d, %v", n, err)
	}
	var tr TimeoutRequest
	decode(`{"timeout":30}`, &tr)
	if d, err := tr.TTL(); d != 30*time.Second || err != nil {
		t.Errorf("timeout {timeout:30}: %v, %v", d, err)
	}
}

// jsonKeys answers the top-level keys v marshals to, sorted.
func jsonKeys(t *testing.T, v any) []string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// TestAnswerNames checks the JSON names of fully set answers against the names the
// SDKs read (index.mjs: res.data.<name>).
func TestAnswerNames(t *testing.T) {
	s, yes := "x", true
	at := time.Unix(1700000000, 0).UTC()
	listed := ListedSandbox{TemplateID: s, Alias: s, SandboxID: s, ClientID: s, StartedAt: at, EndAt: at, CPUCount: 1, MemoryMB: 1,
		DiskSizeMB: 1, Metadata: map[string]string{"a": "b"}, State: StatePaused, EnvdVersion: s, VolumeMounts: []VolumeMount{{}}}
	for _, tc := range []struct {
		name string
		v    any
		want string
	}{
		{"Sandbox", Sandbox{TemplateID: s, SandboxID: s, Alias: s, ClientID: s, EnvdVersion: s, EnvdAccessToken: s, TrafficAccessToken: &s, Domain: &s},
			"alias clientID domain envdAccessToken envdVersion sandboxID templateID trafficAccessToken"},
		{"SandboxDetail", SandboxDetail{ListedSandbox: listed, EnvdAccessToken: s, AllowInternetAccess: &yes, Domain: &s,
			Network: &Network{}, Lifecycle: &Lifecycle{}},
			"alias allowInternetAccess clientID cpuCount diskSizeMB domain endAt envdAccessToken envdVersion lifecycle memoryMB metadata network sandboxID startedAt state templateID volumeMounts"},
		{"ListedSandbox", listed,
			"alias clientID cpuCount diskSizeMB endAt envdVersion memoryMB metadata sandboxID startedAt state templateID volumeMounts"},
		{"Lifecycle", Lifecycle{}, "autoResume onTimeout"},
		{"SnapshotInfo", SnapshotInfo{}, "names snapshotID"},
		{"ForkResult", ForkResult{Sandbox: &Sandbox{}, Error: &Error{}}, "error sandbox"},
		{"Metric", Metric{}, "cpuCount cpuUsedPct diskTotal diskUsed memCache memTotal memUsed timestamp timestampUnix"},
		{"Error", Error{}, "code message"},
	} {
		if got := strings.Join(jsonKeys(t, tc.v), " "); got != tc.want {
			t.Errorf("%s marshals to keys %q, want %q", tc.name, got, tc.want)
		}
	}
	// A minimal Sandbox leaves the optional fields out rather than sending "" or null:
	// the SDK takes a missing domain for its own E2B_DOMAIN.
	if got := strings.Join(jsonKeys(t, Sandbox{}), " "); got != "clientID envdVersion sandboxID templateID" {
		t.Errorf("empty Sandbox marshals to keys %q", got)
	}
	// allowInternetAccess is null, not left out, when the create did not set it.
	b, _ := json.Marshal(SandboxDetail{})
	if !strings.Contains(string(b), `"allowInternetAccess":null`) {
		t.Errorf("SandboxDetail without allowInternetAccess: %s", b)
	}
}

func TestParseListQuery(t *testing.T) {
	for _, tc := range []struct {
		query string
		want  ListQuery
	}{
		{"", ListQuery{States: []State{StateRunning, StatePaused}, Limit: DefaultListLimit, Order: "desc"}},
		// What 2.51 sends for metadata {"my key":"a&b=c", user:"abc"}, state [running], limit 2.
		{"metadata=my%252520key%3Da%252526b%25253Dc%26user%3Dabc&state=running&limit=2&nextToken=tok&order=asc&startedAfter=2026-01-02T03:04:05.000Z&template=base",
			ListQuery{Metadata: map[string]string{"my key": "a&b=c", "user": "abc"}, States: []State{StateRunning}, Limit: 2,
				NextToken: "tok", Order: "asc", StartedAfter: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Template: "base"}},
		{"state=paused,running", ListQuery{States: []State{StatePaused, StateRunning}, Limit: DefaultListLimit, Order: "desc"}},
	} {
		q, err := url.ParseQuery(tc.query)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseListQuery(q)
		if err != nil {
			t.Errorf("%q: %v", tc.query, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%q:\n got %+v\nwant %+v", tc.query, got, tc.want)
		}
	}
	for _, bad := range []string{"state=stopped", "limit=0", "limit=101", "limit=x", "order=up", "startedAfter=yesterday", "metadata=novalue", "metadata=%3Dv"} {
		q, _ := url.ParseQuery(bad)
		if _, err := ParseListQuery(q); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestValidAPIKey(t *testing.T) {
	for key, want := range map[string]bool{
		"e2b_0123456789abcdef": true, "e2b_a": true,
		"e2b_": false, "e2b_ABC": false, "e2b_xyz": false, "E2B_abc": false, "abc": false, "": false, "e2b_12 3": false,
	} {
		if got := ValidAPIKey(key); got != want {
			t.Errorf("ValidAPIKey(%q) = %v, want %v", key, got, want)
		}
	}
}

// TestNewSandboxEgress: E2B's allow_internet_access and network.allowOut and
// denyOut map onto torpor's rules, E2B's allow winning over its deny.
func TestNewSandboxEgress(t *testing.T) {
	cases := []struct {
		name, body  string
		internet    *bool
		allow, deny []string
		err         bool
	}{
		{"left out", `{}`, nil, nil, nil, false},
		{"true is the default", `{"allow_internet_access":true}`, nil, nil, nil, false},
		{"off", `{"allow_internet_access":false}`, new(bool), nil, nil, false},
		{"deny all but one", `{"network":{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"]}}`, new(bool), []string{"1.1.1.1/32"}, nil, false},
		{"allow carved out of deny", `{"network":{"allowOut":["10.1.0.0/17"],"denyOut":["10.1.0.0/16","8.8.8.8"]}}`, nil,
			[]string{"10.1.0.0/17"}, []string{"8.8.8.8/32", "10.1.128.0/17"}, false},
		{"domain", `{"network":{"allowOut":["*.example.com"]}}`, nil, nil, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var r NewSandbox
			if err := json.Unmarshal([]byte(tc.body), &r); err != nil {
				t.Fatal(err)
			}
			if un := r.Unsupported(); len(un) != 0 {
				t.Errorf("Unsupported() = %q", un)
			}
			internet, allow, deny, err := r.Egress()
			if (err != nil) != tc.err {
				t.Fatalf("err %v, want error %v", err, tc.err)
			}
			if !reflect.DeepEqual(internet, tc.internet) || !reflect.DeepEqual(allow, tc.allow) || !reflect.DeepEqual(deny, tc.deny) {
				t.Errorf("got internet %v allow %q deny %q, want %v %q %q", internet, allow, deny, tc.internet, tc.allow, tc.deny)
			}
		})
	}
}
