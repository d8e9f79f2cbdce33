// Package apiv1 holds the wire types of torpor's REST API v1: the JSON bodies the
// server sends and accepts, the error codes, and the OpenAPI 3 document that
// describes them (served at /v1/openapi.json). The server, the Go client and the
// CLI all use these types, so a field renamed here is renamed everywhere.
package apiv1

import (
	"encoding/json"
	"fmt"
	"time"
)

// State is a sandbox's lifecycle state. Transitions (docs/lifecycle.md):
//
//	creating -> running -> hibernating -> hibernated -> resuming -> running
//	running -> paused -> running (unpause); paused -> hibernated (demotion)
//	any -> error (the engine failed; the record says why)
//
// A deleted sandbox has no state: it is gone from the API (404).
type State string

const (
	StateCreating    State = "creating"
	StateRunning     State = "running"
	StatePaused      State = "paused"
	StateHibernating State = "hibernating"
	StateHibernated  State = "hibernated"
	StateResuming    State = "resuming"
	StateError       State = "error"
)

// IdempotencyKeyHeader is the request header that makes POST /v1/sandboxes
// and POST /v1/sandboxes/{id}/fork idempotent: a retry with the same key
// gets the first call's sandboxes (docs/api.md).
const IdempotencyKeyHeader = "Idempotency-Key"

// CreateSandboxRequest is the body of POST /v1/sandboxes.
type CreateSandboxRequest struct {
	// Image is an image name ("base") or digest ("sha256:…"). Default "base".
	Image string `json:"image,omitempty"`
	// MemoryMiB is the memory limit in MiB (64..65536; absent: 512; 0 given is
	// refused, 400).
	MemoryMiB int `json:"memory_mib,omitempty"`
	// PidsLimit bounds the tasks (processes and threads) each user may have
	// in the sandbox (16..65536; absent: one per 2 MiB of MemoryMiB, at least
	// 16, at most the server's cap, 1024 unless its operator chose another; 0
	// given is refused, 400: no "unlimited").
	PidsLimit int `json:"pids_limit,omitempty"`
	// CPUs is the CPU limit in cores (0.1..64; absent: 1; 0 given is refused, 400).
	CPUs float64 `json:"cpus,omitempty"`
	// Env is set for every process the guest agent starts.
	Env map[string]string `json:"env,omitempty"`
	// IdleTimeoutS: after this many idle seconds the sandbox is hibernated (mode
	// none: deleted). Absent = 15; 0 = never. See docs of Sandbox.IdleTimeoutS.
	IdleTimeoutS *int `json:"idle_timeout_s,omitempty"`
	// PauseAfterS: after this many idle seconds a sandbox of mode memory is
	// paused (processes stopped, memory kept, resumed in milliseconds by the
	// next request), and hibernated at idle_timeout_s. Absent = 5 when the
	// idle timeout is longer, else 0; 0 = never.
	PauseAfterS *int `json:"pause_after_s,omitempty"`
	// TimeoutS is the longest the sandbox may run, in seconds of running time
	// (nothing counts while hibernated); 0 or absent = no limit.
	TimeoutS int `json:"timeout_s,omitempty"`
	// OnTimeout is what happens when TimeoutS runs out: "hibernate" (default) or "delete".
	OnTimeout string `json:"on_timeout,omitempty"`
	// HibernationMode is "memory" (default), "filesystem" or "none".
	HibernationMode string `json:"hibernation_mode,omitempty"`
	// OnResume is started (detached) after a filesystem-mode resume.
	OnResume []string `json:"on_resume,omitempty"`
	// Volumes are named volumes mounted read-write at their paths.
	Volumes []VolumeMount `json:"volumes,omitempty"`
	// ExpiresAt (retention): once this time has passed and the sandbox is
	// hibernated, the sandbox and its snapshots are deleted. Absent or null =
	// never (perpetual standby); a time not in the future is refused (400).
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
	// InternetAccess: egress to public addresses through the server's uplink.
	// Absent = true when the server has an uplink, false when it has none;
	// true on a server without one is refused. AllowOut opens CIDR prefixes
	// or addresses (private ranges included) even without internet access;
	// DenyOut refuses them and wins over AllowOut; neither opens the
	// always-refused set (docs/security.md, "Network egress"). All three are
	// fixed for the sandbox's life and its fork clones'.
	InternetAccess *bool    `json:"internet_access,omitempty"`
	AllowOut       []string `json:"allow_out,omitempty"`
	DenyOut        []string `json:"deny_out,omitempty"`
}

// Expiry is the expires_at field of PATCH /v1/sandboxes/{id}: absent = unchanged
// (Set false), null = never expire, an RFC 3339 time = expire then.
type Expiry struct {
	Set bool
	At  *time.Time
}

// ExpireAt is an Expiry that sets expires_at to t.
func ExpireAt(t time.Time) Expiry { return Expiry{Set: true, At: &t} }

// ExpireNever is an Expiry that clears expires_at (never expire).
var ExpireNever = Expiry{Set: true}

// IsZero reports an absent field (omitzero).
func (e Expiry) IsZero() bool { return !e.Set }

// MarshalJSON writes null or the time.
func (e Expiry) MarshalJSON() ([]byte, error) {
	if e.At == nil {
		return []byte("null"), nil
	}
	return json.Marshal(e.At)
}

// UnmarshalJSON reads null or an RFC 3339 time.
func (e *Expiry) UnmarshalJSON(b []byte) error {
	e.Set = true
	e.At = nil
	if string(b) == "null" {
		return nil
	}
	var t time.Time
	if err := json.Unmarshal(b, &t); err != nil {
		return fmt.Errorf("expires_at: want an RFC 3339 time or null: %v", err)
	}
	e.At = &t
	return nil
}

// UpdateSandboxRequest is the body of PATCH /v1/sandboxes/{id}: only the fields
// present change.
type UpdateSandboxRequest struct {
	IdleTimeoutS    *int      `json:"idle_timeout_s,omitempty"`
	PauseAfterS     *int      `json:"pause_after_s,omitempty"`
	TimeoutS        *int      `json:"timeout_s,omitempty"`
	OnTimeout       *string   `json:"on_timeout,omitempty"`
	HibernationMode *string   `json:"hibernation_mode,omitempty"`
	OnResume        *[]string `json:"on_resume,omitempty"`
	// ExpiresAt: an RFC 3339 time, or null to never expire; absent = unchanged.
	ExpiresAt Expiry `json:"expires_at,omitzero"`
}

// Hibernation modes.
const (
	ModeMemory     = "memory"
	ModeFilesystem = "filesystem"
	ModeNone       = "none"
)

// VolumeMount attaches volume Name at Path (absolute) inside a sandbox.
type VolumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// Hibernation states a sandbox's hibernation mode and what it keeps.
type Hibernation struct {
	Mode  string `json:"mode"`
	Keeps string `json:"keeps"`
}

// Usage is what a sandbox has used so far.
type Usage struct {
	// RunningS is seconds spent running (not while hibernated).
	RunningS float64 `json:"running_s"`
	// SnapshotByteS is byte-seconds of snapshot storage held.
	SnapshotByteS float64 `json:"snapshot_byte_s"`
}

// Volume is a named volume: a host directory mounted into sandboxes.
type Volume struct {
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"created_at"`
	// CopiedFrom names the volume this one was copied from (fork with volumes "copy").
	CopiedFrom string `json:"copied_from,omitempty"`
	// Node is the node whose data directory holds it (the node that created
	// it), where every sandbox that mounts it runs; absent on volumes from
	// before nodes were recorded.
	Node string `json:"node,omitempty"`
	// UsedBy lists the sandboxes (running or hibernated) that mount it.
	UsedBy []string `json:"used_by,omitempty"`
}

// CreateVolumeRequest is the body of POST /v1/volumes.
type CreateVolumeRequest struct {
	Name string `json:"name"`
}

// Node is a host whose torpor server uses the same metadata database (a
// node), as GET /v1/nodes reports it.
type Node struct {
	Name string `json:"name"`
	// Advertise is the base URL of the node's API.
	Advertise string `json:"advertise"`
	// State is active, draining (takes no new sandboxes) or lost (no
	// heartbeat for the lease time).
	State    string        `json:"state"`
	Capacity NodeResources `json:"capacity"`
	Load     NodeResources `json:"load"`
	// MemoryOvercommit is the ratio of its memory the node's admission
	// control admits; the load's memory is what it has committed (a node
	// has room for M MiB while load + M ≤ capacity × this ratio).
	MemoryOvercommit float64   `json:"memory_overcommit"`
	StartedAt        time.Time `json:"started_at"`
	HeartbeatAt      time.Time `json:"heartbeat_at"`
	// Self: the node that answers.
	Self bool `json:"self"`
}

// NodeResources are a node's capacity or load: memory in MiB, CPUs
// (cores), sandboxes (a count; in the load, those that have an instance:
// not hibernated, not in error).
type NodeResources struct {
	MemoryMiB int64   `json:"memory_mib"`
	CPUs      float64 `json:"cpus"`
	Sandboxes int     `json:"sandboxes"`
}

// ListNodesResponse is the body of GET /v1/nodes.
type ListNodesResponse struct {
	Nodes []Node `json:"nodes"`
}

// ListVolumesResponse is the body of GET /v1/volumes.
type ListVolumesResponse struct {
	Volumes []Volume `json:"volumes"`
}

// Sandbox is a sandbox as the API reports it.
type Sandbox struct {
	ID          string `json:"id"`
	State       State  `json:"state"`
	Image       string `json:"image"`        // the name asked for
	ImageDigest string `json:"image_digest"` // sha256:… of the image used
	MemoryMiB   int    `json:"memory_mib"`
	// PidsLimit bounds the tasks each user may have in the sandbox; 0 = none
	// (a sandbox made before pids limits).
	PidsLimit int               `json:"pids_limit"`
	CPUs      float64           `json:"cpus"`
	Env       map[string]string `json:"env,omitempty"`
	// Generation changes on every resume and fork; it is kept outside the snapshot.
	Generation int64 `json:"generation"`
	// ForkedFrom is the id of the sandbox whose snapshot this one was cloned from.
	ForkedFrom string `json:"forked_from,omitempty"`
	// Node is the node that owns the sandbox's instance; absent for none (a
	// hibernated sandbox, or one whose node was lost).
	Node string `json:"node,omitempty"`
	// Snapshot is the latest committed snapshot, if any.
	Snapshot *Snapshot `json:"snapshot,omitempty"`
	// Error says why the sandbox is in state "error".
	Error string `json:"error,omitempty"`

	CreatedAt       time.Time  `json:"created_at"`
	StateChangedAt  time.Time  `json:"state_changed_at"`
	LastHibernateAt *time.Time `json:"last_hibernate_at,omitempty"`
	LastResumeAt    *time.Time `json:"last_resume_at,omitempty"`
	// ResumeMS is the duration of the last resume in milliseconds.
	ResumeMS int64 `json:"resume_ms,omitempty"`

	// IdleTimeoutS: seconds of idleness after which the sandbox is hibernated (mode
	// none: deleted); 0 = never. Idle = no exec, files, proxy or resume call, no
	// open proxied connection or exec stream, and every 1 s CPU sample below the
	// server's threshold, for the whole window.
	IdleTimeoutS int `json:"idle_timeout_s"`
	// PauseAfterS: seconds of idleness after which the sandbox is paused
	// (mode memory; only when below idle_timeout_s or with idle_timeout_s 0);
	// 0 = never. While paused only calls and open connections count as
	// activity.
	PauseAfterS int `json:"pause_after_s"`
	// TimeoutS (0 = none) and OnTimeout: see CreateSandboxRequest.
	TimeoutS  int    `json:"timeout_s"`
	OnTimeout string `json:"on_timeout"`
	// Hibernation is the hibernation mode and what it keeps.
	Hibernation Hibernation   `json:"hibernation"`
	OnResume    []string      `json:"on_resume,omitempty"`
	Volumes     []VolumeMount `json:"volumes,omitempty"`
	// Usage is metered running time and snapshot storage.
	Usage Usage `json:"usage"`
	// LastResume is the guest agent's report of the resume contract it ran on the
	// last start, resume or fork of this sandbox.
	LastResume *ResumeReport `json:"last_resume,omitempty"`
	// ExpiresAt (retention): once passed, the sandbox is deleted with its
	// snapshots when it is hibernated (a running sandbox is not deleted; it is
	// checked again once hibernated). null = never (perpetual standby).
	ExpiresAt *time.Time `json:"expires_at"`
	// InternetAccess, AllowOut and DenyOut are the sandbox's egress policy (see
	// CreateSandboxRequest), the prefixes normalized (an address is a /32).
	InternetAccess bool     `json:"internet_access"`
	AllowOut       []string `json:"allow_out,omitempty"`
	DenyOut        []string `json:"deny_out,omitempty"`
}

// ResumeRequest is what the host hands the guest agent (POST /resume of the agent)
// on every start, resume and fork, before any user request is forwarded.
type ResumeRequest struct {
	// Generation is the sandbox's new generation (kept outside the snapshot).
	Generation int64 `json:"generation"`
	// Forked says this incarnation is a clone of another sandbox's snapshot.
	Forked bool `json:"forked"`
	// SnapshotID is the snapshot restored ("" at first start).
	SnapshotID string `json:"snapshot_id"`
	// HostTime is the host's wall clock when the request was sent.
	HostTime time.Time `json:"host_time"`
	// HookDeadlineS bounds each user hook (default 10 s).
	HookDeadlineS float64 `json:"hook_deadline_s,omitempty"`
	// AckDeadlineS bounds the wait for subscribed processes' acks (default 5 s).
	AckDeadlineS float64 `json:"ack_deadline_s,omitempty"`
	// Start marks the first boot of a sandbox (event "start", no hooks run).
	Start bool `json:"start,omitempty"`
}

// ResumeReport is the result of the resume contract run by the guest agent, plus
// what the host measured. OK is false if any step failed, a subscribed process did
// not acknowledge in time, a hook failed or overran, or the agent could not be
// reached (Error); the resume completes in every case.
type ResumeReport struct {
	// Event is "start" (first boot) or "resume" (resume or fork).
	Event      string `json:"event"`
	Generation int64  `json:"generation"`
	Forked     bool   `json:"forked"`
	// SnapshotID is the snapshot the sandbox was restored from ("" at start).
	SnapshotID string `json:"snapshot_id,omitempty"`
	// Steps are the built-in steps in the order run: generation, reseed, clock,
	// notify, hooks.
	Steps       []ResumeStep      `json:"steps"`
	Clock       ResumeClock       `json:"clock"`
	Subscribers ResumeSubscribers `json:"subscribers"`
	Hooks       []ResumeHook      `json:"hooks"`
	OK          bool              `json:"ok"`
	// WindowMS (host-measured) is the time user processes ran un-notified: from the
	// engine's start or restore returning until the agent's notify step completed.
	WindowMS float64 `json:"window_ms,omitempty"`
	// AgentMS (host-measured) is the duration of the host's call to the agent.
	AgentMS float64 `json:"agent_ms,omitempty"`
	// Error says why the agent could not run the contract (then Steps is empty).
	Error string `json:"error,omitempty"`
}

// ResumeStep is one timed built-in step of the resume contract.
type ResumeStep struct {
	Name   string  `json:"name"`
	MS     float64 `json:"ms"`
	OK     bool    `json:"ok"`
	Detail string  `json:"detail,omitempty"`
}

// ResumeClock is the clock step's result. SkewMS is the sandbox's wall clock minus
// the host's (as sent); Corrected is "none" or "offset-file" (gVisor forbids
// clock_settime, so an offset is written to /run/torpor/clock_offset_ns instead).
type ResumeClock struct {
	SkewMS    float64 `json:"skew_ms"`
	Corrected string  `json:"corrected"`
}

// ResumeSubscribers counts the processes subscribed to resume events and names
// those that did not acknowledge before the deadline.
type ResumeSubscribers struct {
	Total    int      `json:"total"`
	Acked    int      `json:"acked"`
	TimedOut []string `json:"timed_out"`
}

// ResumeHook is the result of one user hook of /etc/torpor/resume.d/.
type ResumeHook struct {
	Name     string  `json:"name"`
	ExitCode int     `json:"exit_code"`
	MS       float64 `json:"ms"`
	TimedOut bool    `json:"timed_out"`
	// Output is the hook's combined stdout and stderr, truncated at 64 KiB.
	Output string `json:"output"`
}

// Snapshot describes one committed snapshot.
type Snapshot struct {
	ID string `json:"id"`
	// SandboxID is the sandbox that was hibernated into it.
	SandboxID string `json:"sandbox_id"`
	// Bytes is the total size in bytes of the snapshot's files.
	Bytes int64 `json:"bytes"`
	// HibernateMS is how long the hibernate took, in milliseconds.
	HibernateMS int64 `json:"hibernate_ms"`
	// Parent is the snapshot this one follows (its sandbox's previous
	// snapshot, or the one a fork resumed from); null for a sandbox's first.
	// It is lineage, not a reference: the parent may have been collected
	// since (GET of it then answers 404).
	Parent    *string   `json:"parent"`
	Engine    string    `json:"engine"`
	CreatedAt time.Time `json:"created_at"`
	// LogicalBytes is the snapshot's size as the engine wrote it; StoredBytes the
	// stored (compressed, deduplicated) size of the chunks it references;
	// NewBytes the stored bytes this snapshot added. A plain-file store reports
	// all three equal to Bytes.
	LogicalBytes int64 `json:"logical_bytes"`
	StoredBytes  int64 `json:"stored_bytes"`
	NewBytes     int64 `json:"new_bytes"`
	// DedupRatio is LogicalBytes / StoredBytes (0 when unknown).
	DedupRatio float64 `json:"dedup_ratio"`
	// Durable is true once every byte is in the durable tier. A hibernate
	// commits synchronously unless asked for an asynchronous upload
	// (HibernateRequest.AsyncUpload or serve --async-upload); then it is false
	// until the background upload has put every chunk and the manifest there.
	Durable bool `json:"durable"`
	// ExpiresAt is the owning sandbox's expires_at (null = never): the snapshot is
	// deleted with that sandbox unless another sandbox (a fork) resumes from it.
	ExpiresAt *time.Time `json:"expires_at"`
	// UsedBy lists the sandboxes that resume from this snapshot (DELETE is
	// refused while any does).
	UsedBy []string `json:"used_by,omitempty"`
}

// ListSnapshotsResponse is the body of GET /v1/snapshots.
type ListSnapshotsResponse struct {
	Snapshots []Snapshot `json:"snapshots"`
}

// StoreUsage is the body of GET /v1/store: the snapshot store's footprint, in
// bytes. The durable tier's figures come from the store's own index (no
// request to S3), the local ones from a walk of the data directory.
type StoreUsage struct {
	// Kind is the store: "chunked" (local filesystem backend), "s3" or "plain".
	Kind string `json:"kind"`
	// Snapshots counts the committed snapshots; LogicalBytes sums their sizes
	// as the engine wrote them (what plain files would take).
	Snapshots    int   `json:"snapshots"`
	LogicalBytes int64 `json:"logical_bytes"`
	// StoredBytes is what the durable tier holds: compressed chunks in packs
	// (including chunks no snapshot uses any more until garbage collection
	// removes or repacks them) and loose chunks; a plain store's files.
	StoredBytes int64 `json:"stored_bytes"`
	// DedupRatio is LogicalBytes / StoredBytes (0 when nothing is stored).
	DedupRatio float64 `json:"dedup_ratio"`
	// ChunkBytes is the compressed size of the distinct chunks in the durable
	// tier; Chunks and Packs count them and their pack objects (0 for plain).
	ChunkBytes int64 `json:"chunk_bytes"`
	Chunks     int   `json:"chunks"`
	Packs      int   `json:"packs"`
	// PendingUploadBytes waits in the local outbox for an asynchronous upload.
	PendingUploadBytes int64 `json:"pending_upload_bytes"`
	// LocalBytes is what this host keeps besides the durable tier: opened
	// copies of snapshots (uncompressed: the files the next resume reads),
	// the chunk cache, the outbox and staging.
	LocalBytes int64 `json:"local_bytes"`
}

// VerifySnapshotResponse is the body of a successful POST /v1/snapshots/{id}/verify.
type VerifySnapshotResponse struct {
	OK    bool  `json:"ok"`
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
}

// ListSandboxesResponse is the body of GET /v1/sandboxes.
type ListSandboxesResponse struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec.
type ExecRequest struct {
	Cmd   []string          `json:"cmd"`
	Env   map[string]string `json:"env,omitempty"`
	Cwd   string            `json:"cwd,omitempty"`
	Stdin string            `json:"stdin,omitempty"` // bytes given to the process's stdin, then EOF
	// TimeoutS bounds the call, in seconds from the guest agent's receipt of
	// it, the wait to start the command included: then the process and its
	// process group are killed and the exit code is 124 (docs/api.md); 0 = none.
	TimeoutS float64 `json:"timeout_s,omitempty"`
	// Background starts the process detached: the call returns at once with its pid,
	// and the process outlives the call. Its output goes to /tmp/torpor-bg-<pid>.log.
	Background bool `json:"background,omitempty"`
}

// ExecEvent is one line of the application/x-ndjson exec response. Output lines carry
// Stream and Data (base64 in JSON, as []byte marshals); the last line carries ExitCode
// (and Pid for background starts), or Error if the process could not be started.
type ExecEvent struct {
	Stream   string `json:"stream,omitempty"` // "stdout" or "stderr"
	Data     []byte `json:"data,omitempty"`
	ExitCode *int   `json:"exit_code,omitempty"`
	Pid      int    `json:"pid,omitempty"`
	Error    string `json:"error,omitempty"`
}

// HibernateRequest is the optional body of POST /v1/sandboxes/{id}/hibernate.
type HibernateRequest struct {
	// AsyncUpload answers once the snapshot is committed on this host's disk and
	// uploads it to the durable tier in the background (snapshot "durable": false
	// until done; retried with backoff from the local copy). Needs the chunked
	// or s3 store. Absent: the server's --async-upload setting (default false).
	AsyncUpload *bool `json:"async_upload,omitempty"`
}

// HibernateResponse is the body of POST /v1/sandboxes/{id}/hibernate.
type HibernateResponse struct {
	Sandbox
	// Unchanged is true when the sandbox was already hibernated and this call
	// did nothing (the snapshot shown is the existing one).
	Unchanged bool `json:"unchanged,omitempty"`
}

// PauseResponse is the body of POST /v1/sandboxes/{id}/pause.
type PauseResponse struct {
	Sandbox
	// Unchanged is true when the sandbox was already paused and this call did
	// nothing.
	Unchanged bool `json:"unchanged,omitempty"`
}

// SandboxMetrics is the body of GET /v1/sandboxes/{id}/metrics: what a running
// or paused sandbox's instance uses now, read from its cgroup (the guest's
// processes and gVisor's kernel for it). A hibernated sandbox has no instance
// and answers 409.
type SandboxMetrics struct {
	At    time.Time `json:"at"`
	State string    `json:"state"`
	// CPUTimeS is the CPU time, in seconds, used since the instance started
	// (it restarts at 0 after a resume: a resumed sandbox is a new instance).
	CPUTimeS float64 `json:"cpu_time_s"`
	// MemoryBytes is what the instance's cgroup charges now (guest memory,
	// gVisor's own and page cache); MemoryLimitBytes its limit, in bytes.
	MemoryBytes      int64 `json:"memory_bytes"`
	MemoryLimitBytes int64 `json:"memory_limit_bytes"`
}

// ResumeResponse is the body of POST /v1/sandboxes/{id}/resume.
type ResumeResponse struct {
	Sandbox
	// Unchanged is true when the sandbox was already running and this call did
	// nothing (resume_ms and generation are those of the earlier resume).
	Unchanged bool `json:"unchanged,omitempty"`
}

// ForkRequest is the body of POST /v1/sandboxes/{id}/fork.
type ForkRequest struct {
	Count int `json:"count"` // 1..16, default 1
	// Volumes says what clones of a sandbox with volumes get: "copy" gives each clone
	// a copy of every volume (named <volume>-<clone id suffix>). Without it, forking
	// a sandbox that has volumes is a conflict: clones never share a read-write volume.
	Volumes string `json:"volumes,omitempty"`
	// Wait says when the call answers: "all" (the default) once every clone
	// has started, with an error naming the clones if one failed; "first"
	// once the first clone runs (if it fails, the next that runs), the others
	// in state creating behind it, an error only if every clone failed. A
	// call about a clone that is still starting waits until it has started.
	Wait string `json:"wait,omitempty"`
}

// The fork call's Wait values.
const (
	ForkWaitAll   = "all"
	ForkWaitFirst = "first"
)

// ForkResponse is the body of the fork call's 201 answer.
type ForkResponse struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// Image is a stored, read-only, content-addressed image.
type Image struct {
	Name      string    `json:"name"`
	Digest    string    `json:"digest"` // sha256:… of the root filesystem image file
	Bytes     int64     `json:"bytes"`
	Source    string    `json:"source"` // "mmdebstrap:python3,git", "import:file.tar"
	CreatedAt time.Time `json:"created_at"`
}

// ListImagesResponse is the body of GET /v1/images.
type ListImagesResponse struct {
	Images []Image `json:"images"`
}

// BuildImageRequest is the body of POST /v1/images/build (build with mmdebstrap).
type BuildImageRequest struct {
	Name     string   `json:"name"`
	Packages []string `json:"packages"`
}

// BuildEvent is one line of the application/x-ndjson answer of POST
// /v1/images/build: progress lines carry Log; the last line carries Image or Error.
type BuildEvent struct {
	Log   string       `json:"log,omitempty"`
	Image *Image       `json:"image,omitempty"`
	Error *ErrorDetail `json:"error,omitempty"`
}

// Error codes, each with its HTTP status.
const (
	CodeNotFound            = "not_found"              // 404
	CodeUnauthenticated     = "unauthenticated"        // 401: the server requires an API key; the request had none or a wrong one (WWW-Authenticate)
	CodeRateLimited         = "rate_limited"           // 429: a wrong or missing key after too many refused keys from the client's address (Retry-After)
	CodeInvalidArgument     = "invalid_argument"       // 400; 413 for a body over the limit
	CodeMethodNotAllowed    = "method_not_allowed"     // 405: the path exists for other methods (Allow header)
	CodeConflict            = "conflict"               // 409: the sandbox's state does not allow the call
	CodeSnapshotCorrupt     = "snapshot_corrupt"       // 422: a snapshot file failed its checksum
	CodeIdempotencyReuse    = "idempotency_key_reused" // 422: an Idempotency-Key sent again with another call
	CodeUnavailable         = "unavailable"            // 503
	CodeInsufficientStorage = "insufficient_storage"   // 507: the data directory's disk is full; the message names it
	CodeBadGateway          = "bad_gateway"            // 502: nothing answers on the proxied port
	CodeInternal            = "internal"               // 500
)

// ErrorBody is the body of every error answer: {"error":{"code":…,"message":…}}.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail names what failed.
type ErrorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Pool is a template's warm pool: Size restored-and-paused clones kept ready
// (Ready of them now) for creates of the image or forks of sandboxes
// hibernated on the snapshot (docs/lifecycle.md#warm-pools). Answer of PUT
// /v1/images/{name}/pool and PUT /v1/snapshots/{id}/pool; GET /v1/pools lists
// them.
type Pool struct {
	// Template is "image" or "snapshot"; Name the image's name or the
	// snapshot's id.
	Template string `json:"template"`
	Name     string `json:"name"`
	Size     int    `json:"size"`
	Ready    int    `json:"ready"`
	// SnapshotID is the snapshot the clones are restored from (for an image,
	// the one torpor took of a fresh sandbox of it; "" until it exists).
	SnapshotID string `json:"snapshot_id,omitempty"`
	// MemoryMiB is each clone's memory limit (0 until the first is ready).
	MemoryMiB int `json:"memory_mib,omitempty"`
	// Error is the last refill's failure, cleared by the next success.
	Error     string    `json:"error,omitempty"`
	UpdatedAt time.Time `json:"updated_at"`
}

// SetPoolRequest is the body of PUT /v1/images/{name}/pool and PUT
// /v1/snapshots/{id}/pool: size 0 to 16 (0 ends the pool; for a snapshot it
// is no longer a template).
type SetPoolRequest struct {
	Size *int `json:"size"`
}

// ListPoolsResponse is the body of GET /v1/pools.
type ListPoolsResponse struct {
	Pools []Pool `json:"pools"`
}
