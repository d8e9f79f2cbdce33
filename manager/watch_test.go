package manager

import (
	"strings"
	"testing"

	"github.com/torpor/torpor/engine"
)

// TestExitCause: a sandbox that ended by itself is blamed on its memory only
// when its cgroup counted an OOM kill (a root fork bomb that ended the guest
// agent was once reported as "the host killing it for using more than its
// memory limit", with no OOM kill anywhere).
func TestExitCause(t *testing.T) {
	for _, c := range []struct {
		st         engine.ExitStatus
		want, dont string
	}{
		{engine.ExitStatus{Counted: true, OOMKills: 1}, "more than its memory limit of 256 MiB (1 OOM kills", "not killed"},
		{engine.ExitStatus{Counted: true, PidsMax: 3}, "backstop", "memory limit"},
		{engine.ExitStatus{Counted: true}, "not killed for its memory", "more than its memory limit"},
		{engine.ExitStatus{}, "not known", "memory"},
	} {
		got := exitCause(c.st, 256)
		if !strings.Contains(got, c.want) || strings.Contains(got, c.dont) {
			t.Errorf("exitCause(%+v) = %q, want it to say %q and not %q", c.st, got, c.want, c.dont)
		}
	}
}
