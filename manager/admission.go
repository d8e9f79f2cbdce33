package manager

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// LimitsConfig bounds what each sandbox, and all of them together, may take
// of the host (docs/security.md lists the limits and their defaults).
type LimitsConfig struct {
	// PidsLimit caps the pids limit of a sandbox whose spec asks for none:
	// the tasks (processes and threads) each user may have in it. Such a
	// sandbox gets DefaultPidsFor its memory, at most PidsLimit (default
	// DefaultPidsLimit; negative: no limit).
	PidsLimit int
	// MemoryOvercommit is the admission ratio: a create, resume or fork is
	// admitted while the memory limits of the sandboxes holding host memory
	// (every state but hibernated and error), with those it would start and
	// the memory the engines' prepared instances use, stay within
	// HostMemoryBytes × MemoryOvercommit (default 1.0).
	MemoryOvercommit float64
	// HostMemoryBytes is the host's memory in bytes (default: MemTotal of
	// /proc/meminfo).
	HostMemoryBytes int64
	// RetryAfter is what a refused call is told to wait before it retries
	// (default 10 s).
	RetryAfter time.Duration
	// Restores bounds the resumes of hibernated sandboxes that restore at
	// once; the others wait their turn, hibernated, admitted (their memory
	// counted) but not yet restoring (default runtime.NumCPU(); negative:
	// no bound). A restore is CPU-bound, so ten at once on two cores take
	// as long in all as one after the other: a bound answers the first ones
	// sooner and the last no later (docs/benchmarks/2026-12-06-restore-turns.md).
	// A fork's clones and a warm pool's refill restore under bounds of their
	// own.
	Restores int
}

// Limits of a sandbox's pids (sandbox.Spec.PidsLimit).
const (
	DefaultPidsLimit = 1024
	MinPidsLimit     = 16
	MaxPidsLimit     = 65536
	// MiBPerPid is the memory a default pids limit budgets per task: a
	// sandbox without a pids_limit may have one task per MiBPerPid MiB of its
	// memory limit, so that a fork bomb meets the pids limit before the
	// memory limit and the sandbox survives. Measured with bash's fork bomb
	// (docs/security.md): survived at 16 and 32 tasks in 64 MiB, 64 in 128,
	// 256 in 256, 512 in 512, 1024 in 1024; killed for its memory at 64 in
	// 64 MiB, 128 in 128, 384 and 512 in 256, 768 in 512. Two MiB per task
	// keeps twice the margin of the smallest survivors at 256 MiB and up.
	MiBPerPid = 2
)

// DefaultPidsFor is the pids limit of a sandbox of memoryMiB that asks for
// none, before the server's cap (LimitsConfig.PidsLimit): memoryMiB /
// MiBPerPid, at least MinPidsLimit. 512 MiB (the default memory) gives 256.
func DefaultPidsFor(memoryMiB int) int { return max(memoryMiB/MiBPerPid, MinPidsLimit) }

// withDefaults fills the zero fields of c; HostMemoryBytes from
// /proc/meminfo (an error when it cannot be read and none is given).
func (c LimitsConfig) withDefaults() (LimitsConfig, error) {
	if c.PidsLimit == 0 {
		c.PidsLimit = DefaultPidsLimit
	}
	if c.MemoryOvercommit <= 0 {
		c.MemoryOvercommit = 1
	}
	if c.RetryAfter <= 0 {
		c.RetryAfter = 10 * time.Second
	}
	if c.Restores == 0 {
		c.Restores = runtime.NumCPU()
	}
	if c.HostMemoryBytes <= 0 {
		n, err := hostMemTotal()
		if err != nil {
			return c, fmt.Errorf("manager: host memory for admission control: %w", err)
		}
		c.HostMemoryBytes = n
	}
	return c, nil
}

// hostMemTotal returns MemTotal of /proc/meminfo in bytes.
func hostMemTotal() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/meminfo: MemTotal %q: %w", v, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("/proc/meminfo: no MemTotal")
}

// pidsLimit returns the pids limit a new sandbox of memoryMiB asking for
// want gets (0 = the default: DefaultPidsFor(memoryMiB), capped by the
// configured LimitsConfig.PidsLimit; the record keeps 0 for no limit).
// Errors: sandbox.ErrInvalidArgument outside MinPidsLimit..MaxPidsLimit.
func (m *Manager) pidsLimit(want, memoryMiB int) (int, error) {
	if want == 0 {
		if m.cfg.Limits.PidsLimit < 0 {
			return 0, nil
		}
		return min(m.cfg.Limits.PidsLimit, DefaultPidsFor(memoryMiB)), nil
	}
	if want < MinPidsLimit || want > MaxPidsLimit {
		return 0, invalid("pids_limit %d: must be between %d and %d", want, MinPidsLimit, MaxPidsLimit)
	}
	return want, nil
}

// WritableMiB, tmpMiB and shmMiB are the bounds of a sandbox's writable
// layer, of its /tmp and of its /dev/shm (engine.Spec), all in sandbox
// memory: half, a quarter and an eighth of its memory limit, so that
// filling all three still leaves an eighth for its processes, and a runaway
// write fails with ENOSPC rather than the sandbox being killed for its
// memory. (gVisor keeps memory a deleted file freed for reuse inside the
// sandbox, so the bounds must hold together, not one at a time.) An eighth
// is 64 MiB at the default 512 MiB, Docker's default /dev/shm.
func WritableMiB(memoryMiB int) int { return memoryMiB / 2 }
func tmpMiB(memoryMiB int) int      { return memoryMiB / 4 }
func shmMiB(memoryMiB int) int      { return memoryMiB / 8 }

// admission is the manager's admission control: the host memory reserved by
// creates, resumes and forks in progress, on top of what the sandbox records
// say (admit).
type admission struct {
	mu       sync.Mutex
	reserved map[*reservation]struct{}
}

// reservation is one admitted call's memory, for the sandboxes ids, until
// release.
type reservation struct {
	mib int
	ids []string
}

// AdmissionError is a call refused because the host's memory would be
// exceeded. It is wrapped in a *sandbox.Error of kind Unavailable; an API
// surface tells the caller to retry after RetryAfter (HTTP 503 with
// Retry-After).
type AdmissionError struct {
	// NeedMiB is what the call would add; UsedMiB what the sandboxes holding
	// memory (and calls admitted before) have; CapMiB the host's memory ×
	// the overcommit ratio.
	NeedMiB, UsedMiB, CapMiB int64
	Overcommit               float64
	Retry                    time.Duration
	// Placement says that placement refused the call on a shared database:
	// none of the Nodes active nodes (heartbeating, not draining) has room
	// for NeedMiB (node.HasRoom on their records); UsedMiB and CapMiB are
	// then those of the node with the most room (0 without nodes).
	Placement bool
	Nodes     int
	// Volume, when set, is the named volume the sandbox mounts, which lives
	// on node VolumeNode alone: placement refused the call because that node
	// is VolumeNodeState ("lost", "draining", "unknown" or "full").
	Volume, VolumeNode, VolumeNodeState string
}

func (e *AdmissionError) Error() string {
	if e.Volume != "" {
		return fmt.Sprintf("volume %s is on node %s, which is %s: a sandbox that mounts it runs only on that node (%d MiB needed)",
			e.Volume, e.VolumeNode, e.VolumeNodeState, e.NeedMiB)
	}
	if e.Placement {
		return fmt.Sprintf("host memory full on every node: %d MiB more fit none of the %d active nodes (each admits its memory × its overcommit ratio; the one with the most room has %d of %d MiB committed)",
			e.NeedMiB, e.Nodes, e.UsedMiB, e.CapMiB)
	}
	return fmt.Sprintf("host memory full: %d MiB more would exceed the %d MiB admitted (host memory × overcommit %.3g); sandboxes holding memory have %d MiB of limits",
		e.NeedMiB, e.CapMiB, e.Overcommit, e.UsedMiB)
}

// RetryAfter is how long the caller should wait before retrying.
func (e *AdmissionError) RetryAfter() time.Duration { return e.Retry }

// DurableRetryAfter is the Retry-After of a call that failed because the
// durable tier (S3) did not answer: about one upload retry round.
const DurableRetryAfter = 5 * time.Second

// RetryAfterSeconds returns the whole seconds (at least 1) an API surface
// tells the caller to wait before retrying (HTTP Retry-After) when err has
// a retryable refusal in its chain (a RetryAfter method: an
// *AdmissionError, a snapshot still in another node's upload outbox
// (*UploadPendingError), a hibernate whose commit waits (*StrandedError)),
// or a durable tier that did not answer (snapshot.ErrUnavailable:
// DurableRetryAfter), else 0.
func RetryAfterSeconds(err error) int {
	var r interface{ RetryAfter() time.Duration }
	if !errors.As(err, &r) {
		if errors.Is(err, snapshot.ErrUnavailable) {
			return int(DurableRetryAfter / time.Second)
		}
		return 0
	}
	return max(1, int(math.Ceil(r.RetryAfter().Seconds())))
}

// holdsMemory says whether a sandbox in state st holds host memory: every
// state but hibernated and error (a paused sandbox keeps its memory).
func holdsMemory(st sandbox.State) bool {
	return st != sandbox.StateHibernated && st != sandbox.StateError
}

// admit reserves mib MiB of host memory for op ("create", "resume", "fork")
// on sandbox id ("" for a create) that will start the sandboxes ids, and
// returns release, which the caller calls once those sandboxes' records say
// what they hold. Records of ids do not count while reserved (their memory
// is the reservation's). Errors: a *sandbox.Error of kind Unavailable
// wrapping an *AdmissionError when the host's memory would be exceeded; the
// database's.
func (m *Manager) admit(ctx context.Context, op, id string, mib int, ids ...string) (release func(), err error) {
	r, err := m.reserve(ctx, op, id, mib, ids...)
	if err != nil {
		return nil, err
	}
	return func() { m.adm.drop(r) }, nil
}

// reserve is admit returning the reservation itself, which the caller ends
// with adm.drop (and may hand to other sandboxes with adm.cover): a warm
// pool's ready clone holds one until a sandbox takes it (pool.go).
func (m *Manager) reserve(ctx context.Context, op, id string, mib int, ids ...string) (*reservation, error) {
	a := &m.adm
	a.mu.Lock()
	defer a.mu.Unlock()
	used, err := m.committedLocked(ctx)
	if err != nil {
		return nil, err
	}
	lim := m.cfg.Limits
	memMiB := lim.HostMemoryBytes >> 20
	if !node.HasRoom(used, int64(mib), memMiB, lim.MemoryOvercommit) {
		m.cfg.Metrics.refused.Inc()
		ae := &AdmissionError{NeedMiB: int64(mib), UsedMiB: used, CapMiB: node.AdmittedMiB(memMiB, lim.MemoryOvercommit),
			Overcommit: lim.MemoryOvercommit, Retry: lim.RetryAfter}
		return nil, (&sandbox.Error{Kind: sandbox.Unavailable, Op: op, SandboxID: id, Err: ae}).
			WithHint("retry later, or hibernate or delete sandboxes to free memory; the operator can raise the memory overcommit ratio")
	}
	r := &reservation{mib: mib, ids: ids}
	if a.reserved == nil {
		a.reserved = map[*reservation]struct{}{}
	}
	a.reserved[r] = struct{}{}
	return r, nil
}

// committedLocked is the memory this host has committed, in MiB: the memory
// limits of the sandboxes this node holds memory for (records in every state
// but hibernated and error, not another node's), the reservations of calls
// admitted and not yet recorded, and the prepared instances' memory. The
// caller holds m.adm.mu. Errors: the database's.
func (m *Manager) committedLocked(ctx context.Context) (int64, error) {
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return 0, err
	}
	var used int64
	covered := map[string]bool{}
	for r := range m.adm.reserved {
		used += int64(r.mib)
		for _, c := range r.ids {
			covered[c] = true
		}
	}
	for _, s := range all {
		if holdsMemory(s.State) && !covered[s.ID] && !m.foreign(s) {
			used += int64(s.MemoryMiB)
		}
	}
	// Prepared instances hold their processes' memory (prepared.go).
	return used + m.preparedMiB(), nil
}

// CommittedMiB is the memory this host has committed as admission control
// counts it (MiB; node.HasRoom's committed), what the node heartbeats as its
// load's memory so that placement applies the same rule. Errors: the
// database's.
func (m *Manager) CommittedMiB(ctx context.Context) (int64, error) {
	m.adm.mu.Lock()
	defer m.adm.mu.Unlock()
	return m.committedLocked(ctx)
}

// Limits is the manager's LimitsConfig with its defaults filled: admission
// control admits HostMemoryBytes>>20 MiB × MemoryOvercommit, what the node
// registers for placement (node.HasRoom).
func (m *Manager) Limits() LimitsConfig { return m.cfg.Limits }

// drop ends reservation r (nil: nothing).
func (a *admission) drop(r *reservation) {
	if r == nil {
		return
	}
	a.mu.Lock()
	delete(a.reserved, r)
	a.mu.Unlock()
}

// cover makes reservation r the memory of the sandboxes ids instead of the
// ones it was made for (their records then do not count while r lasts).
func (a *admission) cover(r *reservation, ids ...string) {
	a.mu.Lock()
	r.ids = ids
	a.mu.Unlock()
}

// restoreTurn waits for a place among the resumes restoring at once
// (LimitsConfig.Restores) and returns the function that gives it back. The
// wait is counted in torpor_resumes_waiting. Errors: ctx's, when it ends
// first.
func (m *Manager) restoreTurn(ctx context.Context) (leave func(), err error) {
	if m.restoreGate == nil {
		return func() {}, nil
	}
	select {
	case m.restoreGate <- struct{}{}:
	default:
		m.cfg.Metrics.resumesWaiting.Inc()
		defer m.cfg.Metrics.resumesWaiting.Dec()
		select {
		case m.restoreGate <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return func() { <-m.restoreGate }, nil
}

// Restores returns the bound on resumes restoring at once in effect
// (LimitsConfig.Restores after its default; negative: none).
func (m *Manager) Restores() int { return m.cfg.Limits.Restores }
