package engine

import "time"

// Mount is a host directory bind-mounted into an instance (a named volume). The
// engine must mount it at the same Destination on Start and Restore; its contents
// live on the host and are not part of a checkpoint.
type Mount struct {
	// Source is the absolute host directory; Destination the absolute path in the
	// sandbox.
	Source      string
	Destination string
	ReadOnly    bool
}

// CPUMeter is implemented by engines that can report the CPU time an instance has
// used so far (all its processes, the engine's own in-sandbox kernel included).
// The sandbox manager samples it to tell an idle sandbox from a busy one.
type CPUMeter interface {
	CPUTime(id string) (time.Duration, error)
}

// MemoryMeter is implemented by engines that can report the memory an instance
// holds: used is what its cgroup charges now (guest memory, the engine's own
// in-sandbox kernel and page cache included), in bytes; limit its memory limit
// in bytes (0 when it has none). The sandbox manager reports them as a
// sandbox's metrics.
type MemoryMeter interface {
	Memory(id string) (used, limit int64, err error)
}
