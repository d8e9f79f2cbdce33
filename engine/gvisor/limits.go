package gvisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/torpor/torpor/engine"
)

// A sandbox's limits are in its OCI spec three ways (ociSpec):
//
//   - PidsLimit as RLIMIT_NPROC of the first process, which gVisor's kernel
//     enforces per user (fork and clone fail with EAGAIN; a root command has
//     no CAP_SYS_RESOURCE to lift it), and, as a backstop, the cgroup's
//     pids.max at hostPidsLimit: on the systrap platform every process in
//     the sandbox costs host tasks (two per process, measured), so tasks
//     of several users together cannot exhaust the host's pids; reaching the
//     backstop ends the sandbox.
//   - AgentPidsExempt as CAP_SYS_RESOURCE for the first process: gVisor
//     lets a task with it clone past RLIMIT_NPROC
//     (kernel.UserCounters.incRLimitNProc, which counts the tasks of each
//     real uid, threads included, against the caller's soft limit), so the
//     agent, uid 0 like a root user's processes, still makes threads and
//     starts commands when they hold the whole limit. gVisor starts the first
//     process with an execve, which gives root the bounding set, so the
//     capability is in all its sets; the agent takes it out of its bounding
//     set before it starts anything (guest/agent's pids.go), and every
//     program it starts then runs without it.
//   - WritableMiB as the size of the root overlay's upper layer (a tmpfs in
//     sandbox memory, rootfs annotation options size=), TmpMiB and ShmMiB as
//     the sizes of /tmp and /dev/shm tmpfs mounts (which runsc would
//     otherwise leave unbounded: /tmp its own tmpfs, /dev/shm a directory of
//     the /dev tmpfs).
//
// runsc restores a checkpoint only with the process rlimits and
// capabilities, the mounts and the gVisor annotations it was taken with (runsc/specutils/restore.go), so
// the limits an instance started with are recorded in its bundle (limitsFile)
// and copied into each checkpoint; a restore takes them from there, and a
// checkpoint without the record (taken before limits) restores without them.

// limitsFile names the record of an instance's limits, in its bundle and in
// its checkpoints.
const limitsFile = "torpor-limits.json"

type limitsRecord struct {
	PidsLimit       int  `json:"pids_limit,omitempty"`
	AgentPidsExempt bool `json:"agent_pids_exempt,omitempty"`
	WritableMiB     int  `json:"writable_mib,omitempty"`
	TmpMiB          int  `json:"tmp_mib,omitempty"`
	ShmMiB          int  `json:"shm_mib,omitempty"`
}

// hostPidsLimit is the host cgroup's pids.max for a sandbox whose users may
// each have pidsLimit tasks: room for two host tasks per task, with a second
// user's share, and 512 for the sentry's and gofer's own threads. Those are
// many right after a restore: its page loaders (up to 128 at this runsc) each
// hold an OS thread while they read, and the Go runtime of a sentry that
// cannot make a thread exits; with 256 a fork bomb started right after a
// resume on a loaded host once ended the sandbox (TestForkBombContained).
func hostPidsLimit(pidsLimit int) int64 { return 4*int64(pidsLimit) + 512 }

// writeLimits records spec's limits in bundle directory b.
func writeLimits(b string, spec engine.Spec) error {
	rec, err := json.Marshal(limitsRecord{PidsLimit: spec.PidsLimit, AgentPidsExempt: spec.AgentPidsExempt,
		WritableMiB: spec.WritableMiB, TmpMiB: spec.TmpMiB, ShmMiB: spec.ShmMiB})
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(b, limitsFile), rec, 0o600)
}

// recordLimits copies instance id's limits record from its bundle into
// checkpoint directory dir; an instance started without one (by a torpor
// before limits, reattached) gets none, as its spec had no limits.
func (e *Engine) recordLimits(id, dir string) error {
	b, err := os.ReadFile(filepath.Join(e.bundle(id), limitsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: %w", id, err)
	}
	return os.WriteFile(filepath.Join(dir, limitsFile), b, 0o644)
}

// restoredLimits returns spec with the limits recorded in checkpoint
// directory dir (none when it has no record). Errors: the record is
// unreadable or not JSON.
func restoredLimits(dir string, spec engine.Spec) (engine.Spec, error) {
	b, err := os.ReadFile(filepath.Join(dir, limitsFile))
	var rec limitsRecord
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return spec, fmt.Errorf("gvisor: %w", err)
	default:
		if err := json.Unmarshal(b, &rec); err != nil {
			return spec, fmt.Errorf("gvisor: %s: %w", filepath.Join(dir, limitsFile), err)
		}
	}
	spec.PidsLimit, spec.AgentPidsExempt = rec.PidsLimit, rec.AgentPidsExempt
	spec.WritableMiB, spec.TmpMiB, spec.ShmMiB = rec.WritableMiB, rec.TmpMiB, rec.ShmMiB
	return spec, nil
}
