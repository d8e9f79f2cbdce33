package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/torpor/torpor/engine"
)

var _ engine.CPUMeter = (*Engine)(nil)

// CPUTime implements engine.CPUMeter from the instance's cgroup: cpuacct.usage
// (cgroup v1, ns) or cpu.stat usage_usec (cgroup v2). The cgroup holds the runsc
// sandbox process (the Sentry and, on systrap, the stub processes that run guest
// code), so this is everything the sandbox costs in CPU.
func (e *Engine) CPUTime(id string) (time.Duration, error) {
	rel := e.cgroupPath(id)
	if b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuacct", rel, "cpuacct.usage")); err == nil {
		ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("gvisor: %s: cpuacct.usage: %w", id, err)
		}
		return time.Duration(ns), nil
	}
	b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", rel, "cpu.stat"))
	if err != nil {
		return 0, fmt.Errorf("gvisor: %s: cpu usage: %w", id, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
			us, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("gvisor: %s: cpu.stat: %w", id, err)
			}
			return time.Duration(us) * time.Microsecond, nil
		}
	}
	return 0, fmt.Errorf("gvisor: %s: no usage_usec in cpu.stat", id)
}
