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

var (
	_ engine.CPUMeter    = (*Engine)(nil)
	_ engine.MemoryMeter = (*Engine)(nil)
)

// CPUTime implements engine.CPUMeter from the instance's cgroup: cpuacct.usage
// (cgroup v1, ns) or cpu.stat usage_usec (cgroup v2). The cgroup holds the runsc
// sandbox process (the Sentry and, on systrap, the stub processes that run guest
// code), so this is everything the sandbox costs in CPU.
func (e *Engine) CPUTime(id string) (time.Duration, error) {
	rel := e.cgroupPath(e.rid(id))
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

// Memory implements engine.MemoryMeter from the instance's cgroup:
// memory.usage_in_bytes and memory.limit_in_bytes (cgroup v1) or
// memory.current and memory.max (cgroup v2). A limit of "max" (v2) or above
// 2^62 (v1's "none") is reported as 0.
func (e *Engine) Memory(id string) (used, limit int64, err error) {
	rel := e.cgroupPath(e.rid(id))
	read := func(path string) (int64, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return 0, err
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			return 0, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("gvisor: %s: %s: %w", id, filepath.Base(path), err)
		}
		if n > 1<<62 {
			n = 0
		}
		return n, nil
	}
	v1 := filepath.Join("/sys/fs/cgroup/memory", rel)
	if used, err = read(filepath.Join(v1, "memory.usage_in_bytes")); err == nil {
		limit, err = read(filepath.Join(v1, "memory.limit_in_bytes"))
		return used, limit, err
	}
	v2 := filepath.Join("/sys/fs/cgroup", rel)
	if used, err = read(filepath.Join(v2, "memory.current")); err != nil {
		return 0, 0, fmt.Errorf("gvisor: %s: memory usage: %w", id, err)
	}
	limit, err = read(filepath.Join(v2, "memory.max"))
	return used, limit, err
}
