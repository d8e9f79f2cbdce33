package gvisor

import (
	"os"
	"path/filepath"
	"strings"
)

// RunscCheckpoints returns how many checkpoints e made by starting runsc
// checkpoint instead of calling the sandbox directly.
func RunscCheckpoints(e *Engine) int64 { return e.runscCheckpoints.Load() }

// FreezerState returns instance id's cgroup freezer state: cgroup v1
// freezer.state (THAWED, FREEZING, FROZEN), or cgroup v2 cgroup.freeze (0, 1).
func FreezerState(e *Engine, id string) (string, error) {
	rel := e.cgroupPath(id)
	p := filepath.Join("/sys/fs/cgroup", rel, "cgroup.freeze")
	if st, err := os.Stat("/sys/fs/cgroup/freezer"); err == nil && st.IsDir() {
		p = filepath.Join("/sys/fs/cgroup/freezer", rel, "freezer.state")
	}
	b, err := os.ReadFile(p)
	return strings.TrimSpace(string(b)), err
}
