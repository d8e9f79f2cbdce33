package gvisor

import (
	"context"
	"os"
	"strings"

	"github.com/torpor/torpor/engine"
)

// RunscCheckpoints returns how many checkpoints e made by starting runsc
// checkpoint instead of calling the sandbox directly.
func RunscCheckpoints(e *Engine) int64 { return e.runscCheckpoints.Load() }

// RunscPauses returns how many pauses and unpauses e made by starting runsc.
func RunscPauses(e *Engine) int64 { return e.runscPauses.Load() }

// FreezerState returns instance id's cgroup freezer state: cgroup v1
// freezer.state (THAWED, FREEZING, FROZEN), or cgroup v2 cgroup.freeze (0, 1).
func FreezerState(e *Engine, id string) (string, error) {
	file, _, _ := e.freezer(id)
	b, err := os.ReadFile(file)
	return strings.TrimSpace(string(b)), err
}

// ShapeKey returns the prepared-container shape of spec (prepared.go).
func ShapeKey(e *Engine, spec engine.Spec) string { return e.shapeKey(spec) }

// SandboxPid returns the host pid of instance id's sandbox process, as runsc
// recorded it.
func SandboxPid(e *Engine, id string) (int, error) {
	st, err := e.state(context.Background(), e.rid(id))
	return st.Pid, err
}

// TakeNetwork gives instance id its network pair as a start would.
func TakeNetwork(e *Engine, id string) error { return e.networkFor(context.Background(), id) }
