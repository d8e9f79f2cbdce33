package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/server/servertest"
)

// TestServeAdvertiseUnreachable: `torpor serve --database postgres://…
// --advertise URL` where nothing listens at URL (a trial's: it started and
// heartbeat, and every call forwarded to it got 502) exits 1 once its check
// that URL reaches itself gives up, naming the URL and what it reached
// (connection refused), and leaves nothing running: its watchdog exits, and
// a server under the node's name then starts (the node's lock given up).
func TestServeAdvertiseUnreachable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx, cancel := context.WithTimeout(ctxFor(t, 5*time.Minute), 3*time.Minute)
	defer cancel()
	dbURL := pgtest.Start(t).NewDatabase(t)
	bin := buildTorpor(t)
	nobody := "http://" + freeAddr(t)
	dir := filepath.Join(t.TempDir(), "data")
	defer removeDataDir(dir)
	args := []string{"--database", dbURL, "--node", "adv", "--data-dir", dir, "--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t)}
	cmd := exec.CommandContext(ctx, bin, append([]string{"serve", "--listen", freeAddr(t), "--auth", "none", "--advertise", nobody}, args...)...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || ctx.Err() != nil {
		t.Fatalf("torpor serve --advertise %s (nothing listens there): %v, want exit status 1\n%s", nobody, err, out)
	}
	if !strings.Contains(string(out), "--advertise "+nobody+" does not reach this server (node adv") ||
		!strings.Contains(string(out), "connection refused") {
		t.Errorf("the refusal does not name the URL and what it reached:\n%s", out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	t.Logf("refused: %s", lines[len(lines)-1])
	m := regexp.MustCompile(`watchdog_pid=(\d+)`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("the server's log names no watchdog:\n%s", out)
	}
	pid, _ := strconv.Atoi(m[1])
	running := func() bool { // not a zombie: nobody may reap the orphan
		b, err := os.ReadFile("/proc/" + m[1] + "/stat")
		_, rest, _ := strings.Cut(string(b), ") ")
		return err == nil && syscall.Kill(pid, 0) == nil && !strings.HasPrefix(rest, "Z")
	}
	for deadline := time.Now().Add(10 * time.Second); running(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the refused server's watchdog %d still runs", pid)
		}
	}
	// The node is free: a server of its own URL starts as it.
	srv := serve(t, bin, filepath.Join(t.TempDir(), "serve.log"), args...)
	srv.stop(t)
}
