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
