package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/engine/gvisor"
)

// TestServeStopReleasesHost: `torpor serve` stopped with SIGTERM while its
// only sandbox is hibernated (a prepared container of its shape made, so
// an engine instance runs) removes the prepared container, then runsc's
// null-netns mount and the engine's empty cgroups, and logs "shutting
// down" and, last, "stopped". A new-user trial found the mount and cgroups left:
// the engine was closed only when it listed no instance, before the
// prepared containers were removed.
func TestServeStopReleasesHost(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log")}
	p.start()
	defer p.restartAndDeleteAll()
	c := p.client()
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	if _, err := c.Hibernate(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	readyPrepared(t)
	null := filepath.Join(dataDir, "gvisor", "root", "null-netns")
	if !mounted(null) {
		t.Fatalf("%s is not mounted while the server runs: the test would not see it released", null)
	}
	p.stop()
	if mounted(null) {
		t.Errorf("%s still mounted after the server stopped", null)
	}
	if left := preparedLeft(); len(left) > 0 {
		t.Errorf("prepared containers left after the server stopped: %v", left)
	}
	scope := gvisor.Scope(filepath.Join(dataDir, "gvisor"))
	if dirs, _ := filepath.Glob("/sys/fs/cgroup/*/torpor-" + scope); len(dirs) > 0 {
		t.Errorf("engine cgroups left after the server stopped: %v", dirs)
	}
	log := p.logText()
	if !strings.Contains(log, "shutting down") {
		t.Errorf("server log has no \"shutting down\":\n%s", log)
	}
	// "stopped" is the last word: the store, the database and the data
	// directory are released before it.
	lines := strings.Split(strings.TrimSpace(log), "\n")
	if last := lines[len(lines)-1]; !strings.Contains(last, "msg=stopped") || !strings.Contains(last, "shutdown_ms=") {
		t.Errorf("server log ends with %q, want the stopped line:\n%s", last, log)
	}
	p.start()
	if got := get(t, p.client(), sb.ID); got.State != apiv1.StateHibernated {
		t.Errorf("after the restart %s is %s, want hibernated", sb.ID, got.State)
	}
}

// mounted reports whether path is a mount point in this process's mount
// namespace.
func mounted(path string) bool {
	for _, m := range mountPoints() {
		if m == path {
			return true
		}
	}
	return false
}

// mountPoints lists the mount points of this process's mount namespace
// (/proc/self/mountinfo's fifth field).
func mountPoints() []string {
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, l := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(l); len(f) > 4 {
			out = append(out, f[4])
		}
	}
	return out
}
