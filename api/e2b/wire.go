// Package e2b holds the wire types of torpor's E2B-compatible control plane: the JSON
// bodies, answers and query parameters that E2B's published SDKs (the npm package
// `e2b`, whose 2.45.0 and 2.51.0 the tests drive from e2e/e2bsdk) send to and expect
// from E2B_API_URL. The in-sandbox daemon's API (envd, Connect protocol) is in
// api/e2b/envd. docs/e2b.md is the design: what the SDKs send, and how E2B's lifecycle
// maps onto torpor's.
//
// The JSON names are E2B's, including their inconsistencies (allow_internet_access is
// snake_case, the rest lowerCamelCase; ids end in "ID"). Optional request fields are
// pointers so that "left out" and "false/0" stay apart: each type's docstring says
// which SDK versions send what, and its methods apply the defaults the server must use
// when a field is left out.
package e2b

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/torpor/torpor/manager"
	"go4.org/netipx"
)

// Defaults the server applies when a request leaves a field out.
const (
	// DefaultTimeout is a sandbox's time to live when create, connect or fork names
	// none. The SDKs' own default is 300 s: 2.45 always sends it, 2.51 leaves the
	// field out and relies on the server (E2B's spec says 15 s; the SDKs' users expect
	// 300 s).
	DefaultTimeout = 300 * time.Second
	// DefaultTemplate is the template the SDKs name when the caller names none; it is
	// always sent, never left out.
	DefaultTemplate = "base"
	// MaxTimeout is the longest time to live create, connect, setTimeout and fork
	// accept: torpor's bound on a run timeout (E2B's is its plan's, 1 or 24 hours).
	MaxTimeout = manager.MaxTimeoutS * time.Second
	// DefaultForkCount is how many sandboxes a fork starts when count is left out.
	DefaultForkCount = 1
	// MaxForkCount is the largest count a fork accepts: the manager's limit on
	// the clones of one snapshot (E2B's API allows 100).
	MaxForkCount = manager.MaxForkCount
	// DefaultListLimit and MaxListLimit bound a list page (limit).
	DefaultListLimit = 100
	MaxListLimit     = 100
)

// In-sandbox facts the SDKs build on.
const (
	// EnvdPort is the port of envd inside the sandbox: the SDKs send it as
	// E2b-Sandbox-Port (with E2B_SANDBOX_URL) or as the host's first label
	// ("49983-<sandboxID>.<domain>").
	EnvdPort = 49983
	// EnvdVersion is the envd version torpor reports as envdVersion. The SDKs gate
	// features on it: < 0.1.0 is refused; 0.3.0 the Start stdin flag; 0.4.0 no
	// default user sent (the server picks "user"); 0.5.2 CloseStdin; 0.5.7
	// application/octet-stream uploads to /files; 0.6.2 file metadata (X-Metadata-*
	// headers, EntryInfo.metadata); 0.6.3 WatchDir include_entry; 0.6.4 watching
	// network mounts. torpor reports the highest version whose features it serves;
	// docs/e2b.md says which those are.
	EnvdVersion = "0.6.2"
	// DefaultUser is the sandbox user that commands and files run as when the caller
	// names none (its home is /home/user).
	DefaultUser = "user"
)

// Headers of the E2B surface.
const (
	// HeaderAPIKey carries the caller's key, "e2b_<hex>", on every control-plane call.
	HeaderAPIKey = "X-API-KEY"
	// HeaderAccessToken carries the sandbox's envdAccessToken on every envd call.
	HeaderAccessToken = "X-Access-Token"
	// HeaderTrafficToken carries the sandbox's trafficAccessToken on a request to
	// one of its other ports, when it was created with network.allowPublicTraffic
	// false ("e2b-traffic-access-token", as E2B's docs spell it; header names are
	// matched without regard to case). The SDKs never send it themselves: the
	// caller adds it to its own requests to getHost(port).
	HeaderTrafficToken = "E2b-Traffic-Access-Token"
	// HeaderSandboxID and HeaderSandboxPort route an in-sandbox request when the SDK
	// talks to one E2B_SANDBOX_URL instead of "<port>-<id>.<domain>".
	HeaderSandboxID   = "E2b-Sandbox-Id"
	HeaderSandboxPort = "E2b-Sandbox-Port"
	// HeaderNextToken is the list answers' cursor to the next page; absent on the
	// last page.
	HeaderNextToken = "X-Next-Token"
)

// NewSandbox is the create request: POST /v2/sandboxes (SDK 2.51) or POST /sandboxes
// (SDK ≤ 2.50; the same body). Answer: 201 with a Sandbox.
//
//   - TemplateID names the template (or a snapshot id, SnapshotInfo.SnapshotID);
//     always sent (DefaultTemplate when the caller names none).
//   - Timeout is the time to live in seconds: 2.45 always sends it (300 unless the
//     caller chose), 2.51 only when the caller chose; see TTL.
//   - AutoPause: what happens at the timeout: true = pause (torpor: hibernate), false
//     or left out = kill (torpor: delete). Sent only when the caller set onTimeout.
//   - AutoPauseMemory (2.51, only with AutoPause): false = keep the filesystem only;
//     left out = true. See KeepsMemoryOnPause.
//   - AutoResume{enabled}: a paused sandbox wakes on the next request to it; left out
//     = false. The SDKs refuse it without AutoPause.
//   - Secure: ≤ 2.50 always send true, 2.51 leaves it out; torpor secures every
//     sandbox (an envdAccessToken, checked on every envd call) whatever it says.
//   - AllowInternetAccess (allow_internet_access): ≤ 2.50 always send it (true
//     unless the caller chose), 2.51 only when chosen; left out = true.
//   - Network: allowOut and denyOut map onto torpor's egress rules (Egress),
//     allowPublicTraffic false makes the sandbox's ports need its traffic
//     access token (PublicTraffic); the rest of it, IAM, VolumeMounts, MCP
//     (workload identity, volumes, the MCP gateway) are not supported by
//     torpor yet (docs/e2b.md).
type NewSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int32            `json:"timeout,omitempty"`
	AutoPause           *bool             `json:"autoPause,omitempty"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory,omitempty"`
	AutoResume          *AutoResume       `json:"autoResume,omitempty"`
	Secure              *bool             `json:"secure,omitempty"`
	AllowInternetAccess *bool             `json:"allow_internet_access,omitempty"`
	Network             *Network          `json:"network,omitempty"`
	Metadata            map[string]string `json:"metadata,omitempty"`
	EnvVars             map[string]string `json:"envVars,omitempty"`
	MCP                 json.RawMessage   `json:"mcp,omitempty"`
	IAM                 json.RawMessage   `json:"iam,omitempty"`
	VolumeMounts        []VolumeMount     `json:"volumeMounts,omitempty"`
}

// TTL is the sandbox's time to live: Timeout seconds, DefaultTimeout when left out.
// Errors: Timeout under 1 (E2B's API refuses 0 too: "Timeout must be greater than
// 0") or over MaxTimeout.
func (r NewSandbox) TTL() (time.Duration, error) { return ttl(r.Timeout, 1) }

// PausesOnTimeout says whether the sandbox pauses (torpor: hibernates) rather than
// being killed (deleted) when its time to live runs out.
func (r NewSandbox) PausesOnTimeout() bool { return r.AutoPause != nil && *r.AutoPause }

// KeepsMemoryOnPause says whether a pause at the timeout keeps memory (torpor's
// hibernation mode memory) or only the filesystem (mode filesystem): true unless
// AutoPauseMemory is false.
func (r NewSandbox) KeepsMemoryOnPause() bool {
	return r.AutoPauseMemory == nil || *r.AutoPauseMemory
}

// ResumesOnRequest says whether a paused sandbox wakes on the next request to it.
func (r NewSandbox) ResumesOnRequest() bool { return r.AutoResume != nil && r.AutoResume.Enabled }

// InternetAccess says whether the sandbox may reach the internet: true unless
// allow_internet_access is false.
func (r NewSandbox) InternetAccess() bool {
	return r.AllowInternetAccess == nil || *r.AllowInternetAccess
}

// PublicTraffic says whether anyone who routes a request to one of the sandbox's
// ports other than envd's reaches it (true, E2B's default), or only a request
// with the sandbox's trafficAccessToken in HeaderTrafficToken (false: the
// create set network.allowPublicTraffic false).
func (r NewSandbox) PublicTraffic() bool {
	return r.Network == nil || r.Network.AllowPublicTraffic == nil || *r.Network.AllowPublicTraffic
}

// Egress maps E2B's egress fields onto torpor's (sandbox.Spec): internet is
// false when allow_internet_access is false or denyOut holds 0.0.0.0/0, else
// nil (the server's default: the SDKs ≤ 2.50 always send true); allowOut is
// allow_out as given; E2B's allow wins over its deny, and torpor's deny_out
// wins over allow_out, so deny_out is denyOut less allowOut (as prefixes).
// Errors: an entry that is not an IP address or CIDR prefix (allowOut's domain
// names are not served).
func (r NewSandbox) Egress() (internet *bool, allowOut, denyOut []string, err error) {
	if r.AllowInternetAccess != nil && !*r.AllowInternetAccess {
		internet = new(bool)
	}
	if r.Network == nil {
		return internet, nil, nil, nil
	}
	var deny, allow netipx.IPSetBuilder
	for _, x := range r.Network.AllowOut {
		p, err := egressPrefix(x)
		if err != nil {
			return nil, nil, nil, err
		}
		allow.AddPrefix(p)
		allowOut = append(allowOut, p.String())
	}
	for _, x := range r.Network.DenyOut {
		p, err := egressPrefix(x)
		if err != nil {
			return nil, nil, nil, err
		}
		if p.Bits() == 0 {
			internet = new(bool) // all traffic denied: only allowOut is reached
			continue
		}
		deny.AddPrefix(p)
	}
	as, _ := allow.IPSet()
	deny.RemoveSet(as)
	ds, _ := deny.IPSet()
	for _, p := range ds.Prefixes() {
		denyOut = append(denyOut, p.String())
	}
	return internet, allowOut, denyOut, nil
}

func egressPrefix(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	return netip.Prefix{}, fmt.Errorf("network: %q is not an IP address or CIDR prefix (domain names are not supported)", s)
}

// Unsupported names the fields set in r that torpor does not serve yet, in a fixed
// order ("network", "iam", "volumeMounts", "mcp"); empty when there are none. The
// server answers 400 naming them rather than ignoring a caller's egress rules.
func (r NewSandbox) Unsupported() []string {
	var out []string
	if n := r.Network; n != nil {
		// network.allowOut and denyOut (Egress) and allowPublicTraffic
		// (PublicTraffic) are served; the rest is not.
		rest := *n
		rest.AllowOut, rest.DenyOut, rest.AllowPublicTraffic = nil, nil, nil
		if !rest.empty() {
			out = append(out, "network")
		}
	}
	if isSet(r.IAM) {
		out = append(out, "iam")
	}
	if len(r.VolumeMounts) > 0 {
		out = append(out, "volumeMounts")
	}
	if isSet(r.MCP) {
		out = append(out, "mcp")
	}
	return out
}

// isSet says whether a raw JSON field carries a value (not left out, not null).
func isSet(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null"
}

// AutoResume is NewSandbox.autoResume.
type AutoResume struct {
	Enabled bool `json:"enabled"`
}

// Network is a sandbox's egress and ingress configuration (NewSandbox.network,
// SandboxDetail.network). AllowOut entries are CIDRs, IPs or domain names ("*.x.com");
// DenyOut CIDRs or IPs; an allow wins over a deny. AllowPublicTraffic false requires
// the traffic token on sandbox URLs (left out = true); info reports it. Rules and
// EgressProxy are kept raw: torpor does not interpret them yet.
type Network struct {
	AllowOut           []string        `json:"allowOut,omitempty"`
	DenyOut            []string        `json:"denyOut,omitempty"`
	AllowPublicTraffic *bool           `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    string          `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int           `json:"httpsPorts,omitempty"`
	EgressProxy        json.RawMessage `json:"egressProxy,omitempty"`
	Rules              json.RawMessage `json:"rules,omitempty"`
}

func (n Network) empty() bool {
	return len(n.AllowOut) == 0 && len(n.DenyOut) == 0 && n.AllowPublicTraffic == nil &&
		n.MaskRequestHost == "" && len(n.HTTPSPorts) == 0 && !isSet(n.EgressProxy) && !isSet(n.Rules)
}

// VolumeMount is one volume mounted into the sandbox: the volume's name and the
// absolute mount path.
type VolumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// Sandbox is the answer to create (201), connect (200 running, 201 resumed) and each
// fork that started. The SDKs read sandboxID, envdVersion (refusing < 0.1.0),
// envdAccessToken (sent back as X-Access-Token: 2.51 treats every sandbox as secured,
// so it must always be set), domain (null or left out = the SDK's E2B_DOMAIN) and
// trafficAccessToken (sandbox.trafficAccessToken: set only for a sandbox whose
// traffic is not public, left out otherwise, which the SDKs read as none). ClientID
// is deprecated but required by E2B's spec: torpor sends a fixed value.
type Sandbox struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken,omitempty"`
	Domain             *string `json:"domain,omitempty"`
}

// ClientID is the value torpor sends as the deprecated clientID.
const ClientID = "torpor"

// State is a sandbox's state as E2B names it: running, or paused (torpor: paused or
// hibernated; both resume on connect).
type State string

const (
	StateRunning State = "running"
	StatePaused  State = "paused"
)

// OnTimeout is Lifecycle.onTimeout: what happens when the time to live runs out.
type OnTimeout string

const (
	OnTimeoutKill  OnTimeout = "kill"
	OnTimeoutPause OnTimeout = "pause"
)

// Lifecycle is SandboxDetail.lifecycle, the policy a create set.
type Lifecycle struct {
	AutoResume bool      `json:"autoResume"`
	OnTimeout  OnTimeout `json:"onTimeout"`
}

// ListedSandbox is one entry of the list answer (GET /v2/sandboxes, and the running-
// only GET /sandboxes of old SDKs): a JSON array of these, the next page's cursor in
// the X-Next-Token header. StartedAt is when the sandbox was created, EndAt when its
// time to live runs out (RFC 3339). CPUCount is in cores, MemoryMB and DiskSizeMB in
// MiB. The SDKs read every field.
type ListedSandbox struct {
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	SandboxID    string            `json:"sandboxID"`
	ClientID     string            `json:"clientID"`
	StartedAt    time.Time         `json:"startedAt"`
	EndAt        time.Time         `json:"endAt"`
	CPUCount     int32             `json:"cpuCount"`
	MemoryMB     int32             `json:"memoryMB"`
	DiskSizeMB   int32             `json:"diskSizeMB"`
	Metadata     map[string]string `json:"metadata,omitempty"`
	State        State             `json:"state"`
	EnvdVersion  string            `json:"envdVersion"`
	VolumeMounts []VolumeMount     `json:"volumeMounts,omitempty"`
}

// SandboxDetail is the answer to GET /sandboxes/{sandboxID} (getInfo, every SDK
// version): a ListedSandbox's fields (flattened into one JSON object) and the ones
// below. AllowInternetAccess is null unless the create set it; Domain as in Sandbox;
// Lifecycle the timeout policy. 404 → SandboxNotFoundError.
type SandboxDetail struct {
	ListedSandbox
	EnvdAccessToken     string     `json:"envdAccessToken,omitempty"`
	AllowInternetAccess *bool      `json:"allowInternetAccess"`
	Domain              *string    `json:"domain,omitempty"`
	Network             *Network   `json:"network,omitempty"`
	Lifecycle           *Lifecycle `json:"lifecycle,omitempty"`
}

// ListQuery is the list request's query (GET /v2/sandboxes, every SDK version):
//
//   - metadata: "k=v&k2=v2", each key and value URL-encoded inside the (itself
//     URL-encoded) parameter; a sandbox matches when it has every pair.
//   - state: "running", "paused" or "running,paused"; left out = both.
//   - limit: page size, 1 to MaxListLimit, left out = DefaultListLimit.
//   - nextToken: the previous answer's X-Next-Token.
//   - order (asc|desc by start time, left out = desc), startedAfter (RFC 3339),
//     template (a template id or alias): sent by 2.51 when the caller sets them.
type ListQuery struct {
	Metadata     map[string]string
	States       []State
	Limit        int
	NextToken    string
	Order        string
	StartedAfter time.Time
	Template     string
}

// ParseListQuery reads a ListQuery from a request's query parameters, applying the
// defaults (both states, DefaultListLimit, order desc). Errors name the parameter.
func ParseListQuery(q url.Values) (ListQuery, error) {
	lq := ListQuery{Limit: DefaultListLimit, Order: "desc", NextToken: q.Get("nextToken"), Template: q.Get("template")}
	if m := q.Get("metadata"); m != "" {
		md, err := parseMetadataQuery(m)
		if err != nil {
			return ListQuery{}, fmt.Errorf("metadata %q: %w", m, err)
		}
		lq.Metadata = md
	}
	for _, v := range q["state"] {
		for _, s := range strings.Split(v, ",") {
			switch st := State(strings.TrimSpace(s)); st {
			case StateRunning, StatePaused:
				lq.States = append(lq.States, st)
			default:
				return ListQuery{}, fmt.Errorf("state %q: want running or paused", s)
			}
		}
	}
	if len(lq.States) == 0 {
		lq.States = []State{StateRunning, StatePaused}
	}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxListLimit {
			return ListQuery{}, fmt.Errorf("limit %q: want 1 to %d", v, MaxListLimit)
		}
		lq.Limit = n
	}
	if v := q.Get("order"); v != "" {
		if v != "asc" && v != "desc" {
			return ListQuery{}, fmt.Errorf("order %q: want asc or desc", v)
		}
		lq.Order = v
	}
	if v := q.Get("startedAfter"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return ListQuery{}, fmt.Errorf("startedAfter %q: %w", v, err)
		}
		lq.StartedAfter = t
	}
	return lq, nil
}

// parseMetadataQuery decodes the metadata parameter's value as the query parser gives
// it. The SDKs encode each key and value (encodeURIComponent), join the pairs
// (URLSearchParams, which encodes again) and send that as one parameter (encoded a
// third time): "my key"="a&b" arrives here as "my%2520key=a%2526b". So the value is
// unescaped once, split on & and =, and each key and value unescaped once more.
func parseMetadataQuery(s string) (map[string]string, error) {
	s, err := url.QueryUnescape(s)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, pair := range strings.Split(s, "&") {
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return nil, fmt.Errorf("pair %q has no '='", pair)
		}
		if k, err = url.QueryUnescape(k); err != nil {
			return nil, err
		}
		if v, err = url.QueryUnescape(v); err != nil {
			return nil, err
		}
		if k == "" {
			return nil, errors.New("empty key")
		}
		out[k] = v
	}
	return out, nil
}

// ConnectRequest is the connect body: POST /v2/sandboxes/{sandboxID}/connect (2.51),
// POST /sandboxes/{sandboxID}/connect (2.6 to 2.50; they always send timeout, 300 unless
// the caller chose). Connect resumes a paused sandbox and extends a running one's time
// to live: the end becomes the later of the current end and now + TTL. Memory false
// (2.51's onResume "reboot") resumes from the filesystem only, processes restarting;
// left out = true. Answer: 200 with a Sandbox if it was running, 201 if it was resumed;
// 404 if there is no such sandbox.
type ConnectRequest struct {
	Timeout *int32 `json:"timeout,omitempty"`
	Memory  *bool  `json:"memory,omitempty"`
}

// TTL is Timeout seconds, DefaultTimeout when left out. 0 is valid (E2B's spec:
// minimum 0): the end stays where it is. Errors: negative, over MaxTimeout.
func (r ConnectRequest) TTL() (time.Duration, error) { return ttl(r.Timeout, 0) }

// KeepsMemory says whether a resume restores memory (true unless Memory is false).
func (r ConnectRequest) KeepsMemory() bool { return r.Memory == nil || *r.Memory }

// TimeoutRequest is POST /sandboxes/{sandboxID}/timeout (every SDK version): the
// sandbox now ends Timeout seconds from now (it may shorten the time to live).
// Timeout is required. Answer: 204; 404 if there is no such sandbox.
type TimeoutRequest struct {
	Timeout *int32 `json:"timeout"`
}

// TTL is the new time to live. 0 ends the sandbox at once, as in E2B (killed, or
// paused when it pauses on timeout). Errors: Timeout missing, negative or over
// MaxTimeout.
func (r TimeoutRequest) TTL() (time.Duration, error) {
	if r.Timeout == nil {
		return 0, errors.New("timeout is required (seconds from now)")
	}
	return ttl(r.Timeout, 0)
}

// PauseRequest is POST /sandboxes/{sandboxID}/pause. 2.45 always sends memory (true
// unless the caller chose), 2.51 only when chosen, so the body may be {}. Memory false
// keeps only the filesystem (torpor: hibernation mode filesystem). Answer: 204; 409
// when it is already paused (the SDKs' pause() then returns false); 404 if there is no
// such sandbox.
type PauseRequest struct {
	Memory *bool `json:"memory,omitempty"`
}

// KeepsMemory says whether the pause keeps memory (true unless Memory is false).
func (r PauseRequest) KeepsMemory() bool { return r.Memory == nil || *r.Memory }

// SnapshotRequest is POST /sandboxes/{sandboxID}/snapshots: {} or {"name": "..."}.
// The sandbox is paused while the snapshot is taken and then goes on. Answer: 201
// with a SnapshotInfo; its SnapshotID can be passed as NewSandbox.TemplateID.
type SnapshotRequest struct {
	Name string `json:"name,omitempty"`
}

// SnapshotInfo is the snapshot answer and one entry of GET /snapshots (query
// sandboxID, name, limit, nextToken; the next page's cursor in X-Next-Token). Names
// holds the snapshot's names, empty when it has none. DELETE /templates/{snapshotID}
// deletes one: 204, or 404 (deleteSnapshot then returns false).
type SnapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// ForkRequest is POST /sandboxes/{sandboxID}/fork: start Count sandboxes from one
// snapshot of the source, which keeps running. 2.45 always sends both fields
// (timeout 300, count 1 unless chosen); 2.51 only what the caller chose. Answer: 201
// with one ForkResult per requested sandbox, in order; 404 if there is no source.
type ForkRequest struct {
	Timeout *int32 `json:"timeout,omitempty"`
	Count   *int32 `json:"count,omitempty"`
}

// TTL is each fork's time to live: Timeout seconds, DefaultTimeout when left out.
// Errors as NewSandbox.TTL's.
func (r ForkRequest) TTL() (time.Duration, error) { return ttl(r.Timeout, 1) }

// N is how many sandboxes to start: Count, DefaultForkCount when left out; an error
// outside 1 to MaxForkCount.
func (r ForkRequest) N() (int, error) {
	if r.Count == nil {
		return DefaultForkCount, nil
	}
	if *r.Count < 1 || *r.Count > MaxForkCount {
		return 0, fmt.Errorf("count %d: want 1 to %d (this server forks at most %d sandboxes at once)", *r.Count, MaxForkCount, MaxForkCount)
	}
	return int(*r.Count), nil
}

// ForkResult is one entry of the fork answer: exactly one of Sandbox (it started)
// and Error (it did not; the SDKs turn Error.Code into their error classes) is set.
type ForkResult struct {
	Sandbox *Sandbox `json:"sandbox,omitempty"`
	Error   *Error   `json:"error,omitempty"`
}

// Metric is one entry of GET /sandboxes/{sandboxID}/metrics?start=&end= (unix
// seconds, both optional): a JSON array of samples, oldest first. Timestamp is RFC 3339
// (deprecated by E2B, still read by the SDKs), TimestampUnix the same in unix seconds;
// CPUUsedPct is in percent of CPUCount cores; the memory and disk fields are bytes.
type Metric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int32     `json:"cpuCount"`
	CPUUsedPct    float32   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}

// MetricsWindow is the metrics query: start and end in unix seconds, both
// optional (zero = unbounded), start not after end.
type MetricsWindow struct {
	Start, End int64
}

// ParseMetricsWindow reads a MetricsWindow from the metrics call's query
// parameters. Errors name the parameter.
func ParseMetricsWindow(q url.Values) (MetricsWindow, error) {
	var w MetricsWindow
	for _, p := range []struct {
		name string
		to   *int64
	}{{"start", &w.Start}, {"end", &w.End}} {
		v := q.Get(p.name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return MetricsWindow{}, fmt.Errorf("%s %q: want a unix time in seconds", p.name, v)
		}
		*p.to = n
	}
	if w.Start > 0 && w.End > 0 && w.Start > w.End {
		return MetricsWindow{}, fmt.Errorf("start %d is after end %d", w.Start, w.End)
	}
	return w, nil
}

// Holds says whether t lies in the window (bounds included).
func (w MetricsWindow) Holds(t time.Time) bool {
	u := t.Unix()
	return (w.Start == 0 || u >= w.Start) && (w.End == 0 || u <= w.End)
}

// TrafficRefusal is the body of the 403 answered to a request for a port of a sandbox
// whose traffic is not public, without its traffic token or with a wrong one (E2B's
// proxy answers this shape, with the sandbox's id). Code repeats the status.
type TrafficRefusal struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Code      int    `json:"code"`
}

// Error is the body of every control-plane error answer. Code repeats the HTTP
// status: the SDKs test it (DELETE 404 → kill() returns false; pause 409 → false;
// other 404 → NotFoundError; 401 → AuthenticationError; 429 → RateLimitError, retried
// after Retry-After by 2.51; 503 → ServiceBusyError in 2.51, SandboxError before;
// anything else → SandboxError "<code>: <message>"), and show Message.
type Error struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// ttl turns an optional seconds field into a duration, DefaultTimeout when nil.
// Errors (naming E2B's field, timeout): under least seconds, over MaxTimeout.
func ttl(seconds *int32, least int32) (time.Duration, error) {
	if seconds == nil {
		return DefaultTimeout, nil
	}
	n := *seconds
	switch {
	case n < least && least > 0:
		return 0, fmt.Errorf("timeout %d: must be at least %d second (leave it out for %d)", n, least, int(DefaultTimeout/time.Second))
	case n < 0:
		return 0, fmt.Errorf("timeout %d: must not be negative", n)
	case time.Duration(n)*time.Second > MaxTimeout:
		return 0, fmt.Errorf("timeout %d: at most %d seconds (%d days)", n, int64(MaxTimeout/time.Second), int64(MaxTimeout/(24*time.Hour)))
	}
	return time.Duration(n) * time.Second, nil
}

// APIKeyPrefix starts every key: SDKs 2.27 to 2.45 check E2B_API_KEY client-side
// against ^e2b_[0-9a-f]+$ before sending anything, so torpor issues keys of that form.
const APIKeyPrefix = "e2b_"

// ValidAPIKey says whether key has the form the SDKs accept: "e2b_" and one or more
// lower-case hex digits.
func ValidAPIKey(key string) bool {
	hex, ok := strings.CutPrefix(key, APIKeyPrefix)
	if !ok || hex == "" {
		return false
	}
	for _, c := range hex {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
