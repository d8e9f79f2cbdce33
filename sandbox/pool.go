package sandbox

import "time"

// Pool is a template's warm pool as the API shows it: Size restored-and-paused
// clones kept ready, of which Ready are ready now. A create of the image, or a
// fork of a hibernated sandbox whose snapshot is the template, takes one
// (docs/lifecycle.md#warm-pools).
type Pool struct {
	// Template is "image" or "snapshot"; Name the image's name or the
	// snapshot's id.
	Template string
	Name     string
	Size     int
	Ready    int
	// SnapshotID is the snapshot the clones are restored from ("" until an
	// image pool's first is made); MemoryMiB each clone's memory limit (0
	// until known).
	SnapshotID string
	MemoryMiB  int
	// Error is the last refill's failure ("" after a refill succeeds).
	Error     string
	UpdatedAt time.Time
}
