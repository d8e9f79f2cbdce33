package proto

import "time"

// Protocol versions (see the package doc for what each one added).
const (
	// Version1 is the protocol of the first agents, which report no version.
	Version1 = 1
	// Version2 adds the protocol version and agent build to the health answer.
	Version2 = 2
	// Version3 adds E2B's envd services (EnvdMinVersion): the Connect services
	// process.Process and filesystem.Filesystem and the plain HTTP routes under
	// EnvdPrefix.
	Version3 = 3
	// Version4 adds POST /hibernate/prepare (PathPrepareHibernate): the agent
	// ends its open envd streams before a checkpoint; and envd's file metadata.
	Version4 = 4

	// Version is the protocol this tree's agent speaks and the newest this
	// tree's host knows.
	Version = Version4
	// MinVersion is the oldest protocol the host still speaks. It is never
	// raised while snapshots taken with an agent of an older version may exist.
	MinVersion = Version1
)

// Port is the TCP port the agent listens on inside the sandbox.
const Port = 49983

// Endpoint paths (plain HTTP/1.1; the host name is not used).
const (
	PathHealth = "/health" // GET: Health
	PathExec   = "/exec"   // POST ExecRequest: application/x-ndjson ExecEvent lines
	PathFiles  = "/files"  // GET ?path=: the file's bytes; PUT ?path=[&mode=]: replace it
	PathResume = "/resume" // POST ResumeRequest: ResumeReport
	// PathPrepareHibernate is POST (no body): PrepareHibernateReport (since
	// Version4). The host calls it before a hibernate's drain.
	PathPrepareHibernate = "/hibernate/prepare"
)

// PrepareHibernateReport is the answer of POST /hibernate/prepare. The agent
// has ended every open envd stream (a command's output followed by Start or
// Connect, a watch): such streams never end on their own and would hold the
// hibernate's drain until its end. Their processes and watches go on; a
// client re-attaches after the resume (envd's Connect by pid). Calls that
// end by themselves (an upload, a command without a stream) are not touched:
// the drain waits for them.
type PrepareHibernateReport struct {
	// Streams is how many streams were ended.
	Streams int `json:"streams"`
}

// Query parameters and content types of the file endpoints.
const (
	// QueryPath is the absolute path of the file in the sandbox.
	QueryPath = "path"
	// QueryMode is the file's permission bits in octal ("0644", the default) on PUT.
	QueryMode = "mode"
	// ContentTypeFile is the content type of a file's bytes, both ways.
	ContentTypeFile = "application/octet-stream"
	// ContentTypeJSON is the content type of the JSON request bodies and answers.
	ContentTypeJSON = "application/json"
	// ContentTypeExec is the content type of the exec answer: one ExecEvent per line.
	ContentTypeExec = "application/x-ndjson"
)

// Health is the answer of GET /health.
type Health struct {
	OK bool `json:"ok"`
	// Pid is the agent's pid (1 inside a sandbox).
	Pid int `json:"pid"`
	// StartedAt is when the agent process started (RFC 3339, nanoseconds, UTC).
	StartedAt time.Time `json:"started_at"`
	// ProtocolVersion is the protocol the agent speaks (since version 2; absent,
	// 0, from a version 1 agent: use VersionOf).
	ProtocolVersion int `json:"protocol_version,omitempty"`
	// Agent names the agent's build, e.g. "torpor-agent vcs.revision=b89f061…"
	// (since version 2; free text, for logs).
	Agent string `json:"agent,omitempty"`
}

// VersionOf returns the protocol version h reports: ProtocolVersion, or Version1
// when it is absent (a version 1 agent).
func VersionOf(h Health) int {
	if h.ProtocolVersion == 0 {
		return Version1
	}
	return h.ProtocolVersion
}

// ExecRequest is the body of POST /exec.
type ExecRequest struct {
	// Cmd is the program and its arguments; Cmd[0] is looked up in the command's
	// PATH. Empty: 400 invalid_argument.
	Cmd []string `json:"cmd"`
	// Env is set over the sandbox env.
	Env map[string]string `json:"env,omitempty"`
	// Cwd is the absolute working directory ("" = "/").
	Cwd string `json:"cwd,omitempty"`
	// Stdin is given to the process's stdin, then EOF.
	Stdin string `json:"stdin,omitempty"`
	// TimeoutS bounds the call, in seconds from the agent's receipt of it,
	// the wait to start the command included: then the process group is
	// killed and the exit code is 124 (agents before this counted from the
	// command's start); 0 = none.
	TimeoutS float64 `json:"timeout_s,omitempty"`
	// Background starts the process detached: the answer is at once its pid, and
	// its output goes to /tmp/torpor-bg-<pid>.log in the sandbox.
	Background bool `json:"background,omitempty"`
}

// ExecEvent is one line of the exec answer. Output lines carry Stream and Data
// (base64 in JSON); the last line carries ExitCode (foreground), Pid (background
// start) or Error with ExitCode 127 (the command could not be started).
type ExecEvent struct {
	Stream   string `json:"stream,omitempty"` // "stdout" or "stderr"
	Data     []byte `json:"data,omitempty"`
	ExitCode *int   `json:"exit_code,omitempty"`
	Pid      int    `json:"pid,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Last reports whether ev is the last event of its exec.
func (ev ExecEvent) Last() bool { return ev.ExitCode != nil || ev.Pid != 0 || ev.Error != "" }

// ResumeRequest is the body of POST /resume: what the host hands the agent on
// every start, resume and fork, before any user request is forwarded.
type ResumeRequest struct {
	// Generation is the sandbox's new generation (kept outside the snapshot).
	Generation int64 `json:"generation"`
	// Forked says this incarnation is a clone of another sandbox's snapshot.
	Forked bool `json:"forked"`
	// SnapshotID is the snapshot restored ("" at first start).
	SnapshotID string `json:"snapshot_id"`
	// HostTime is the host's wall clock when the request was sent.
	HostTime time.Time `json:"host_time"`
	// HookDeadlineS bounds each user hook in seconds (0: the agent's 10 s).
	HookDeadlineS float64 `json:"hook_deadline_s,omitempty"`
	// AckDeadlineS bounds the wait for subscribed processes' acks in seconds (0: 5 s).
	AckDeadlineS float64 `json:"ack_deadline_s,omitempty"`
	// Start marks the first boot of a sandbox (event "start", no hooks run).
	Start bool `json:"start,omitempty"`
	// Unpaused marks a sandbox continued from the paused tier: the same
	// incarnation and generation, its clocks jumped by the paused time; the
	// event is "resume" with kind "unpaused" and the host's connections to
	// the agent's streams survived (an agent before this field treats it as a
	// resume).
	Unpaused bool `json:"unpaused,omitempty"`
}

// ResumeReport is the agent's answer to POST /resume: the resume contract's result.
// OK is false if a step failed, a subscribed process did not acknowledge in time
// or a hook failed or overran; the answer is 200 in every case.
type ResumeReport struct {
	// Event is "start" (first boot), "resume" (resume or fork) or "unpaused"
	// (ResumeRequest.Unpaused).
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
}

// ResumeStep is one timed built-in step of the resume contract.
type ResumeStep struct {
	Name   string  `json:"name"`
	MS     float64 `json:"ms"`
	OK     bool    `json:"ok"`
	Detail string  `json:"detail,omitempty"`
}

// ResumeClock is the clock step's result. SkewMS is the sandbox's wall clock minus
// the host's (as sent), in milliseconds; Corrected is "none" or "offset-file" (the
// correction is written to /run/torpor/clock_offset_ns).
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

// Error codes of ErrorDetail.
const (
	CodeNotFound        = "not_found"        // 404: no such file or endpoint
	CodeInvalidArgument = "invalid_argument" // 400 (405 for a wrong method)
	CodeInternal        = "internal"         // 500
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
