package sandbox

import (
	"net/netip"
	"time"
)

// State is a sandbox's lifecycle state. Transitions:
//
//	creating -> running -> hibernating -> hibernated -> resuming -> running
//	running -> paused -> running (unpause: the same instance, no restore)
//	paused -> hibernated (demotion: its snapshot is already committed)
//	any -> error (the engine failed; Sandbox.Error says why)
//
// A deleted sandbox has no state: it is gone.
type State string

// The states of a sandbox.
const (
	StateCreating State = "creating"
	StateRunning  State = "running"
	// StatePaused: the sandbox's processes are stopped and its memory is
	// kept on the host; a committed snapshot of the paused state was taken
	// when it paused, so a host crash loses nothing.
	StatePaused      State = "paused"
	StateHibernating State = "hibernating"
	StateHibernated  State = "hibernated"
	StateResuming    State = "resuming"
	StateError       State = "error"
)

// Hibernation modes: what a hibernate keeps.
const (
	// ModeMemory keeps everything: memory, processes and the writable layer.
	ModeMemory = "memory"
	// ModeFilesystem keeps the writable layer only; processes restart on resume.
	ModeFilesystem = "filesystem"
	// ModeNone keeps nothing: an idle sandbox is deleted.
	ModeNone = "none"
)

// What happens when a sandbox's run timeout (Policy.TimeoutS) runs out.
const (
	OnTimeoutHibernate = "hibernate"
	OnTimeoutDelete    = "delete"
)

// Policy is a sandbox's lifecycle policies. It is persisted with the sandbox
// and survives any number of hibernate/resume cycles unchanged.
type Policy struct {
	// IdleTimeoutS: after this many idle seconds the sandbox is hibernated (mode
	// none: deleted); 0 = never.
	IdleTimeoutS int
	// PauseAfterS: after this many idle seconds a running sandbox of mode
	// memory is paused (the paused tier), and hibernated when IdleTimeoutS
	// is reached; 0 = never paused. Only a value below IdleTimeoutS (or any
	// value when IdleTimeoutS is 0) has an effect.
	PauseAfterS int
	// TimeoutS bounds the sandbox's running time in seconds (nothing counts
	// while hibernated); 0 = none. OnTimeout is OnTimeoutHibernate or
	// OnTimeoutDelete.
	TimeoutS  int
	OnTimeout string
	// HibernationMode is ModeMemory, ModeFilesystem or ModeNone.
	HibernationMode string
	// OnResume is started (detached) after a filesystem-mode resume.
	OnResume []string
	// Volumes are mounted read-write at their paths.
	Volumes []VolumeMount
	// ExpiresAt (retention): once passed, a hibernated sandbox is deleted with
	// its snapshots. nil = never (perpetual standby).
	ExpiresAt *time.Time
	// ResumeOnRequest: a request that uses a hibernated sandbox (exec, files, a
	// proxied connection) resumes it first. When false such a request is
	// refused (sandbox.ErrConflict) and only an explicit resume wakes it.
	ResumeOnRequest bool
	// Network is the sandbox's network policy, fixed at create; every fork
	// clone has its source's.
	Network Network
}

// Network is a sandbox's network policy: what it may reach through the host's
// uplink (egress; docs/security.md, "Network egress", gives the order of the
// rules and the addresses no rule opens) and who may reach its ports from
// outside (PrivateTraffic). The zero value reaches nothing and is reached by
// anyone who routes a request to it.
type Network struct {
	// PrivateTraffic: a request that E2B's in-sandbox routing sends to one of
	// the sandbox's ports (envd's excepted, which has its own token) must
	// carry the sandbox's traffic access token, else it is refused before it
	// touches the sandbox (E2B's network.allowPublicTraffic false). false =
	// public, E2B's default. torpor's own port proxy always needs an API key.
	PrivateTraffic bool
	// InternetAccess: public addresses are reachable; without it only AllowOut.
	InternetAccess bool
	// AllowOut opens these prefixes (private ranges included); DenyOut refuses
	// these and wins over AllowOut. IPv6 prefixes are kept and have no
	// effect: sandboxes have IPv4 only.
	AllowOut []netip.Prefix
	DenyOut  []netip.Prefix
}

// Wanted reports whether a sandbox with this policy reaches anything at all
// (internet access or something allowed).
func (n Network) Wanted() bool { return n.InternetAccess || len(n.AllowOut) > 0 }

// Spec is what a new sandbox is asked to be (the manager's Create). Zero
// values take the defaults the manager documents.
type Spec struct {
	// Image is an image name ("base") or digest ("sha256:…"); "" = "base".
	Image string
	// MemoryMiB is the memory limit (0 = default); CPUs the CPU limit in cores
	// (0 = default).
	MemoryMiB int
	CPUs      float64
	// Env is set for every process the guest agent starts.
	Env map[string]string
	// IdleTimeoutS: nil = the default; 0 = never. See Policy.
	IdleTimeoutS *int
	// PauseAfterS: nil = the default (the manager's DefaultPauseAfterS when
	// the idle timeout is above it, else 0); 0 = never. See Policy.
	PauseAfterS *int
	// TimeoutS, OnTimeout ("" = hibernate), HibernationMode ("" = memory),
	// OnResume, Volumes and ExpiresAt: see Policy.
	TimeoutS        int
	OnTimeout       string
	HibernationMode string
	OnResume        []string
	Volumes         []VolumeMount
	ExpiresAt       *time.Time
	// ResumeOnRequest: nil = true. See Policy.
	ResumeOnRequest *bool
	// Metadata is the caller's key-value pairs, kept with the sandbox and
	// returned as given (E2B's sandbox metadata); nil = none.
	Metadata map[string]string
	// PidsLimit bounds the tasks (processes and threads) each user may have
	// in the sandbox (0 = the server's default).
	PidsLimit int
	// ID, when set, is the new sandbox's id (manager.NewSandboxID makes one):
	// a caller that must know it before the sandbox exists (an idempotent
	// create) chooses it. "" = a new one.
	ID string
	// InternetAccess: nil = on when the server has an uplink, off when it has
	// none; true on a server without one is refused. AllowOut and DenyOut are
	// CIDR prefixes or single addresses (see Network); allow_out on a server
	// without an uplink is refused.
	InternetAccess *bool
	AllowOut       []string
	DenyOut        []string
	// PrivateTraffic: see Network.
	PrivateTraffic bool
}

// PolicyUpdate changes a sandbox's policies: nil fields (and an ExpiresAt
// with Set false) are left as they are.
type PolicyUpdate struct {
	IdleTimeoutS    *int
	PauseAfterS     *int
	TimeoutS        *int
	OnTimeout       *string
	HibernationMode *string
	OnResume        *[]string
	ExpiresAt       Expiry
}

// Expiry is an optional change of a sandbox's ExpiresAt: Set false = no
// change; Set with At nil = never expire; Set with At = expire then.
type Expiry struct {
	Set bool
	At  *time.Time
}

// VolumeMount attaches volume Name at Path (absolute) inside a sandbox.
type VolumeMount struct {
	Name string
	Path string
}

// Volume is a named volume: a host directory mounted into sandboxes.
type Volume struct {
	Name      string
	CreatedAt time.Time
	// CopiedFrom names the volume this one was copied from (a fork's copy).
	CopiedFrom string
	// Node is the node whose data directory holds it ("" if not recorded).
	Node string
	// UsedBy lists the sandboxes (running or hibernated) that mount it.
	UsedBy []string
}

// Hibernation states a sandbox's hibernation mode and, in words, what it keeps.
type Hibernation struct {
	Mode  string
	Keeps string
}

// Usage is what a sandbox has used so far.
type Usage struct {
	// RunningS is seconds spent running (not while paused or hibernated).
	RunningS float64
	// SnapshotByteS is byte-seconds of snapshot storage held.
	SnapshotByteS float64
}

// Sandbox is a sandbox as the manager reports it.
type Sandbox struct {
	ID          string
	State       State
	Image       string // the name asked for
	ImageDigest string // sha256:… of the image used
	MemoryMiB   int
	CPUs        float64
	Env         map[string]string
	// PidsLimit bounds the tasks each user may have in the sandbox; 0 = none
	// (a sandbox made before pids limits).
	PidsLimit int
	// Generation changes on every resume and fork; it is kept outside the snapshot.
	Generation int64
	// ForkedFrom is the id of the sandbox whose snapshot this one was cloned from.
	ForkedFrom string
	// Node is the node that owns the sandbox's instance ("" for none: a
	// hibernated sandbox, or one whose node was lost).
	Node string
	// Snapshot is the latest committed snapshot, if any.
	Snapshot *Snapshot
	// Error says why the sandbox is in state error.
	Error string

	CreatedAt       time.Time
	StateChangedAt  time.Time
	LastHibernateAt *time.Time
	LastResumeAt    *time.Time
	// ResumeMS is the duration of the last resume.
	ResumeMS int64

	// IdleTimeoutS, PauseAfterS, TimeoutS, OnTimeout, OnResume, Volumes and
	// ExpiresAt are the sandbox's Policy; Hibernation its mode with what that
	// keeps.
	IdleTimeoutS int
	PauseAfterS  int
	TimeoutS     int
	OnTimeout    string
	Hibernation  Hibernation
	OnResume     []string
	Volumes      []VolumeMount
	// Usage is metered running time and snapshot storage.
	Usage Usage
	// LastResume is the guest agent's report of the resume contract it ran on
	// the last start, resume, fork or unpause.
	LastResume *ResumeReport
	ExpiresAt  *time.Time
	// ResumeOnRequest: see Policy.
	ResumeOnRequest bool
	// TimeoutLeftS is the running time, in seconds, left before the run
	// timeout (TimeoutS) fires; 0 when TimeoutS is 0 or it has run out.
	TimeoutLeftS float64
	// Metadata: see Spec.
	Metadata map[string]string
	// Network: see Policy.
	Network Network
}

// ResourceSample is what a running or paused sandbox's instance uses at one
// moment, as its engine meters it (engine.CPUMeter, engine.MemoryMeter):
// CPUTime is the CPU time used since the instance started; MemoryBytes the
// memory it holds now and MemoryLimitBytes its limit (0 when the engine cannot
// say). State is the sandbox's state when it was taken.
type ResourceSample struct {
	At               time.Time
	State            State
	CPUTime          time.Duration
	MemoryBytes      int64
	MemoryLimitBytes int64
}

// Image is a stored, read-only, content-addressed image.
type Image struct {
	Name      string
	Digest    string // sha256:… of the root filesystem image file
	Bytes     int64
	Source    string // "mmdebstrap:python3,git", "import:file.tar"
	CreatedAt time.Time
}
