package manager

import (
	"errors"
	"fmt"
	"strings"
	"syscall"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// A full data directory disk (docs/operations.md#a-full-disk).
//
// A hibernate, pause or fork writes a snapshot: the engine's checkpoint into
// the store's staging directory (about the sandbox's memory in use), then the
// store's commit of it (its new chunks, at most as much again). A checkpoint
// that fails leaves the instance running, but a commit that fails after the
// instance exited loses the sandbox's memory, so the room is checked before
// the checkpoint: with less free than snapshotRoomFactor times the memory in
// use plus snapshotHeadroom, the call is refused (sandbox.InsufficientStorage,
// 507) and nothing is touched. Writes that still find the disk full (another
// writer filled it meanwhile) are reported the same way.

// snapshotRoomFactor and snapshotHeadroom make the free space a snapshot
// needs: factor × the sandbox's memory in use (the engine's cgroup figure,
// else its memory limit) + headroom bytes.
const (
	snapshotRoomFactor = 2
	snapshotHeadroom   = 64 << 20
)

// NoSpace reports whether err is a write that found its disk full: ENOSPC or
// EDQUOT in its chain, or, from a part whose errors arrive as text (runsc,
// SQLite), their messages.
func NoSpace(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return true
	}
	// SQLite's SQLITE_FULL reads "database or disk is full (13)".
	msg := err.Error()
	return strings.Contains(msg, "no space left on device") || strings.Contains(msg, "disk quota exceeded") ||
		strings.Contains(msg, "database or disk is full")
}

// diskFull wraps err (a NoSpace error of op on sandbox id) as
// sandbox.InsufficientStorage; other errors are returned as they are.
func diskFull(op, id string, err error) error {
	var se *sandbox.Error
	if !NoSpace(err) || (errors.As(err, &se) && se.Kind == sandbox.InsufficientStorage) {
		return err
	}
	return &sandbox.Error{Kind: sandbox.InsufficientStorage, Op: op, SandboxID: id,
		Err:  fmt.Errorf("the data directory's disk is full: %w", err),
		Hint: "free space on that disk and try again"}
}

// snapshotRoom returns sandbox.InsufficientStorage, naming dir and the
// figures, when dir's filesystem has less free space (for an unprivileged
// writer: statfs f_bavail) than a snapshot of s needs (snapshotRoomFactor,
// snapshotHeadroom); op names the call. A filesystem it cannot read is not
// refused (the writes will tell).
func (m *Manager) snapshotRoom(op string, s *metadata.Sandbox, dir string) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return nil
	}
	free := int64(st.Bavail) * int64(st.Bsize)
	used := int64(s.MemoryMiB) << 20
	if mm, ok := m.eng(s).Engine.(engine.MemoryMeter); ok && s.Instance != "" {
		if u, _, err := mm.Memory(s.Instance); err == nil && u > 0 {
			used = u
		}
	}
	need := snapshotRoomFactor*used + snapshotHeadroom
	if free >= need {
		return nil
	}
	return &sandbox.Error{Kind: sandbox.InsufficientStorage, Op: op, SandboxID: s.ID,
		Err: fmt.Errorf("the data directory's disk is full: %s has %d MiB free; the snapshot needs about %d MiB (%d × the sandbox's %d MiB of memory in use, and %d MiB to spare); the sandbox is unchanged",
			dir, free>>20, need>>20, snapshotRoomFactor, used>>20, snapshotHeadroom>>20),
		Hint: "free space on that disk and try again"}
}

// ErrSandboxFull is in the chain of a file write into a sandbox that found
// the sandbox's own file system full (ENOSPC inside it): its writable layer,
// its /tmp or its /dev/shm, each bounded in sandbox memory (WritableMiB,
// tmpMiB, shmMiB), not the host's disk. It comes as sandbox.InsufficientStorage naming the bound.
var ErrSandboxFull = errors.New("no space left in the sandbox")

// sandboxFull returns the error of a write of path into sandbox s that the
// guest answered with ENOSPC (or EDQUOT) from its own file system: the
// writable layer of its root file system, its /tmp or its /dev/shm, each
// with its bound.
// A write into a volume (a host directory) or any other error gives nil.
func sandboxFull(s *metadata.Sandbox, path string, err error) error {
	var ae *agentclient.Error
	if !errors.As(err, &ae) || !NoSpace(errors.New(ae.Message)) {
		return nil
	}
	for _, v := range s.Volumes {
		if path == v.Path || strings.HasPrefix(path, strings.TrimSuffix(v.Path, "/")+"/") {
			return nil // a host directory: the host's disk
		}
	}
	where, mib, share := "the writable layer of its root file system", WritableMiB(s.MemoryMiB), "half"
	switch {
	case path == "/tmp" || strings.HasPrefix(path, "/tmp/"):
		where, mib, share = "its /tmp", tmpMiB(s.MemoryMiB), "a quarter"
	case path == "/dev/shm" || strings.HasPrefix(path, "/dev/shm/"):
		where, mib, share = "its /dev/shm", shmMiB(s.MemoryMiB), "an eighth"
	}
	return &sandbox.Error{Kind: sandbox.InsufficientStorage, Op: "write " + path, SandboxID: s.ID,
		Err: fmt.Errorf("%w: %s is full (bounded at %d MiB, %s of the sandbox's memory limit of %d MiB, which it lives in; the host's disk is not full): %s",
			ErrSandboxFull, where, mib, share, s.MemoryMiB, ae.Message),
		Hint: "free space in the sandbox, create it with more memory, or write to a volume"}
}
