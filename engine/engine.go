// Package engine defines the interface between torpor's sandbox manager and a
// sandboxing technology (gVisor today, a microVM later). Everything above this
// interface is engine-neutral.
//
// # Lifecycle
//
// An instance is one running incarnation of a sandbox. The manager names it (ID) and
// gives the engine a Spec:
//
//	Start(spec)                 -> instance running, guest agent listening on AgentPort
//	Checkpoint(id, dir, false)  -> memory, processes and writable layer written to dir;
//	                               the instance is gone afterwards (hibernate)
//	Checkpoint(id, dir, true)   -> the same, and the instance keeps running (fork source)
//	Restore(spec, dir)          -> a new instance continues from dir; one dir may be
//	                               restored many times (forks), each restore is a clone
//	Stop(id)                    -> the instance and everything the engine made for it
//	                               (processes, network namespaces) is gone; idempotent
//	Wait(id)                    -> returns once the instance has exited, whoever ended
//	                               it (Stop, a checkpoint, the host's OOM killer)
//
// The writable layer lives inside the instance's memory, so a checkpoint directory is
// the whole sandbox: nothing else on the host has to be kept for a Restore except the
// image and the guest directory named in the Spec.
//
// # Engines by name, optional capabilities
//
// A host may have several engines (Registry, keyed by Name); new sandboxes start
// on its default, and a snapshot is restored only by the engine its manifest
// names, at a Version that engine accepts (Registry.CheckRestore,
// CompatibilityChecker). What only some engines can do is an optional interface
// the caller type-asserts: ExitCheckpointer, Pauser, RestorePreparer, CPUMeter, MemoryMeter, HostScoper,
// EgressProvider, io.Closer (host resources to release once no instance runs).
//
// # Names
//
// ID is the engine-level instance id, unique per host and per incarnation (the manager
// uses "<sandbox id>-<n>" with n zero-padded). No id may be a prefix of another
// live id: runsc resolves container ids by prefix. Dir is an absolute directory the engine owns while it
// writes; the snapshot store owns it afterwards.
package engine

import (
	"context"
	"errors"
	"net"
	"net/netip"
)

// Spec is what an instance runs.
type Spec struct {
	// ID names the instance: [a-z0-9-]{1,60}.
	ID string
	// RootFS is the absolute path of the read-only image file (EROFS) the sandbox
	// boots from.
	RootFS string
	// GuestDir is an absolute host directory mounted read-only at /.torpor in the
	// sandbox; it holds the guest agent binary (/.torpor/torpor-agent), which is the
	// sandbox's first process.
	GuestDir string
	// MemoryMiB is the memory limit in MiB; CPUs the CPU limit in cores.
	MemoryMiB int
	CPUs      float64
	// Env is the guest agent's environment, which it passes to every process it starts.
	Env map[string]string
	// Mounts are host directories (named volumes) bind-mounted read-write unless
	// ReadOnly; a Restore must get the same Destinations.
	Mounts []Mount
	// PidsLimit bounds the tasks (processes and threads) each user may have
	// in the sandbox: beyond it fork and clone fail with EAGAIN inside the
	// sandbox; 0 = no limit.
	PidsLimit int
	// AgentPidsExempt leaves the guest agent's own forks and threads out of
	// PidsLimit (the commands it starts stay bound, and their tasks still
	// count): a root fork bomb then cannot keep the agent from making the
	// OS thread its runtime needs, which it cannot survive, nor from
	// starting a command that ends the bomb. gVisor: CAP_SYS_RESOURCE in the
	// agent's effective set but not in its bounding set, which no program
	// it executes keeps.
	AgentPidsExempt bool
	// WritableMiB bounds, in MiB, what the sandbox's writable layer (its root
	// file system's changes) may hold when it lives in sandbox memory, and
	// TmpMiB what /tmp may hold when it is a memory file system: beyond them
	// writes fail with ENOSPC inside the sandbox instead of the sandbox being
	// killed for its memory; 0 = no bound but the memory limit.
	//
	// ShmMiB bounds /dev/shm the same way (a memory file system of mode
	// 1777); 0 = no bound but the memory limit.
	//
	// On Restore an engine restores the limits the snapshot was taken with,
	// whatever PidsLimit, AgentPidsExempt, WritableMiB, TmpMiB and ShmMiB
	// say (a checkpoint carries them).
	WritableMiB int
	TmpMiB      int
	ShmMiB      int
	// Egress, when set, gives the instance a way out to other networks under
	// these rules, through the host's uplink (engines that have one:
	// EgressProvider); nil = none. An Egress that reaches nothing refuses the
	// guest's packets at once. Every Start and Restore applies it anew.
	Egress *Egress
}

// Egress is an instance's egress rules; docs/security.md ("Network egress")
// gives their order and the addresses no rule opens.
type Egress struct {
	// InternetAccess: public addresses are reachable; without it only AllowOut.
	InternetAccess bool
	// AllowOut opens these prefixes (private ranges included); DenyOut refuses
	// these and wins over AllowOut.
	AllowOut, DenyOut []netip.Prefix
}

// EgressProvider is an Engine that can give instances a way out (Spec.Egress).
type EgressProvider interface {
	// Resolver returns the DNS resolver that instances with an Egress reach
	// on port 53 (zero when none is known), or an error saying why the engine
	// gives no instance a way out (no uplink configured); Spec.Egress is then
	// ignored.
	Resolver() (netip.Addr, error)
}

// AgentPort is the TCP port the guest agent listens on inside every sandbox.
const AgentPort = 49983

// Info describes an instance the engine knows about.
type Info struct {
	ID      string
	Running bool
	// Pid is the host pid of the instance's outermost process (0 if none or
	// not a host process), for logs only.
	Pid int
	// Paused says a running instance is paused (Pauser): its processes are
	// stopped and its memory is kept. A paused instance is Running.
	Paused bool
}

// Engine runs sandboxes. Implementations must be safe for concurrent use on
// different instance ids; the manager never runs two calls on one id at once
// (Wait excepted, which runs beside the others). Every call must return soon
// after its ctx ends: the manager bounds each call it makes with a deadline.
type Engine interface {
	// Name and Version identify the engine in snapshot manifests ("gvisor",
	// "runsc <version>"). A snapshot is restored only by an engine of the same
	// Name whose CheckRestore accepts its Version.
	Name() string
	Version() string

	// Start boots a new instance and returns once the engine has started it (the
	// caller waits for the guest agent itself).
	Start(ctx context.Context, spec Spec) error
	// Checkpoint writes the instance's full state into dir (which must exist and be
	// empty). Without leaveRunning the instance is stopped and removed afterwards.
	Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error
	// Restore starts a new instance named spec.ID from a checkpoint directory.
	// The caller checks the checkpoint's engine and version first (CheckRestore).
	Restore(ctx context.Context, spec Spec, dir string) error
	// Stop kills the instance and removes everything made for it. Stopping an
	// unknown or already stopped instance returns nil.
	Stop(ctx context.Context, id string) error

	// Dial opens a TCP connection to port inside the instance (the guest agent or a
	// user's server). Errors wrap ErrNotRunning when there is no such instance.
	Dial(ctx context.Context, id string, port int) (net.Conn, error)
	// List returns every instance this engine has on the host, including ones a
	// previous server process left behind (for reconciliation on start-up).
	List(ctx context.Context) ([]Info, error)
	// Wait blocks until instance id has exited, for whatever reason (Stop, a
	// checkpoint without leaveRunning, a kill from outside), or ctx ends (then
	// ctx's error). It returns at once with an error wrapping ErrNotRunning
	// when the engine has no running instance id to follow.
	Wait(ctx context.Context, id string) (ExitStatus, error)
}

// ExitCheckpointer is an Engine whose hibernating checkpoint can hand back
// control as soon as the image is complete, before the exited instance is torn
// down. The manager then removes the instance (Stop) while the snapshot store
// commits the image: for gVisor the teardown (runsc delete, waiting for the
// sandbox process, removing the network namespaces and bundle) measured
// 115–145 ms per hibernate on the benchmark host, 2026-11-30, n=47, a third of
// a 512 MiB diff hibernate.
type ExitCheckpointer interface {
	// CheckpointExit writes the instance's full state into dir like
	// Checkpoint(ctx, id, dir, false). When it returns nil the image in dir is
	// complete and the instance runs no more guest code, but what is left of it
	// (host processes on their way out, namespaces, state) is only removed by
	// Stop, which the caller must call. On error the instance may still run;
	// nothing is removed.
	CheckpointExit(ctx context.Context, id, dir string) error
}

// Pauser is an Engine that can stop every process of a running instance and
// let them continue later, the instance's memory kept on the host (the
// fastest standby tier: no CPU is used while paused, and Unpause is one
// engine call, not a restore).
//
//	Pause(id)    -> every task of the instance stopped; its memory, its
//	                connections and its network namespace stay; Info.Paused
//	Unpause(id)  -> the tasks continue where they stopped; the guest's
//	                clocks have jumped by the paused time
//
// While paused the instance may still accept TCP connections (gVisor's
// netstack answers the handshake) but nothing reads them: a caller must
// Unpause before it sends a request. Checkpoint(id, dir, true) of a paused
// instance writes the paused state and leaves it paused; a Restore of that
// checkpoint runs. Stop removes a paused instance like a running one.
type Pauser interface {
	// Pause stops instance id's processes. Pausing a paused instance returns
	// nil. Errors wrap ErrNotRunning when there is no such running instance.
	Pause(ctx context.Context, id string) error
	// Unpause lets a paused instance's processes continue. Unpausing an
	// instance that is not paused returns nil; errors wrap ErrNotRunning when
	// there is no such instance.
	Unpause(ctx context.Context, id string) error
}

// ExitStatus says how an instance ended (Engine.Wait).
type ExitStatus struct {
	// What names what exited, for the sandbox's error message: "the sandbox's
	// process (host pid 1234)".
	What string
	// Counted reports whether the engine read the instance's kill counters
	// after it exited; only then do OOMKills and PidsMax say anything.
	Counted bool
	// OOMKills is how many times the host's kernel killed a process of the
	// instance for its memory limit (its cgroup's oom_kill count); PidsMax
	// how many times a fork was refused at the instance's host task limit
	// (the cgroup's pids.events max).
	OOMKills, PidsMax int
}

// ErrNotRunning is returned (wrapped) for calls on an instance that does not run.
var ErrNotRunning = errors.New("instance not running")

// RestorePreparer is an Engine that keeps instances created ahead of time so
// that a Restore skips creating its own (for gVisor: runsc create, the
// sandbox and gofer processes, the network namespaces). Which and how many it
// keeps is the engine's configuration; a Restore uses one when one of the
// right shape is ready and works without one otherwise.
//
//	Restore(spec, dir)      -> restored into a prepared instance if one fits;
//	                           the engine prepares the next in the background
//	Prepared()              -> how many are ready or being made, and the host
//	                           memory they hold (for admission control)
//	DiscardPrepared()       -> every prepared instance is gone (server
//	                           shutdown); none is prepared afterwards
//
// Prepared instances a crashed server left are listed by List under ids no
// sandbox owns, so reconciliation stops them like any orphaned instance.
type RestorePreparer interface {
	// Prepared returns the number of prepared instances (ready or being
	// made) and the host memory in bytes the ready ones use now.
	Prepared() (n int, memoryBytes int64)
	// DiscardPrepared stops every prepared instance and ends preparations
	// under way. Errors: the engine's, stopping one.
	DiscardPrepared(ctx context.Context) error
}
