package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
)

// TestExec checks exec through the API: stdout, stderr and exit codes, stdin,
// the environment (the sandbox's from create and the request's, the request
// winning), the working directory, timeouts (exit 124), a command that cannot
// start (127), and a background process that outlives the call and a
// hibernate/resume.
func TestExec(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256,
		Env: map[string]string{"SBX_VAR": "from-create", "OVERRIDE": "create"}})
	id := sb.ID
	if sb.Env["SBX_VAR"] != "from-create" {
		t.Errorf("create answered env %v", sb.Env)
	}

	t.Run("stdout stderr exit code", func(t *testing.T) {
		out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "echo out; echo err >&2; echo out2; exit 3"}})
		if out != "out\nout2\n" || errb != "err\n" || code != 3 {
			t.Errorf("got stdout %q stderr %q exit %d; want \"out\\nout2\\n\" \"err\\n\" 3", out, errb, code)
		}
		if _, _, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"true"}}); code != 0 {
			t.Errorf("true: exit %d", code)
		}
		if _, _, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "kill -9 $$"}}); code != 137 {
			t.Errorf("killed by SIGKILL: exit %d, want 137", code)
		}
		// A megabyte of output arrives whole.
		out, _, code = run(t, c, id, apiv1.ExecRequest{Cmd: []string{"python3", "-c", "import sys; sys.stdout.write('x' * 1000000)"}})
		if code != 0 || len(out) != 1000000 || strings.Trim(out, "x") != "" {
			t.Errorf("1 MB of output: got %d bytes, exit %d", len(out), code)
		}
	})

	t.Run("not found", func(t *testing.T) {
		_, _, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"/no/such/program"}})
		var ee *client.ExecError
		if !errors.As(err, &ee) || code != 127 || ee.Message == "" {
			t.Errorf("missing program: exit %d err %v, want 127 and an ExecError", code, err)
		}
	})

	t.Run("stdin", func(t *testing.T) {
		out, _, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"cat"}, Stdin: "hello\nworld"})
		if out != "hello\nworld" || code != 0 {
			t.Errorf("cat with stdin: %q exit %d", out, code)
		}
		big := bytes.Repeat([]byte("0123456789abcdef"), 32<<10) // 512 KiB
		out, _, code = run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sha256sum"}, Stdin: string(big)})
		if code != 0 || !strings.HasPrefix(out, sha(big)) {
			t.Errorf("sha256sum of 512 KiB stdin: %q exit %d, want %s", out, code, sha(big))
		}
		// No stdin: EOF at once.
		out, _, code = run(t, c, id, apiv1.ExecRequest{Cmd: []string{"wc", "-c"}})
		if strings.TrimSpace(out) != "0" || code != 0 {
			t.Errorf("wc -c without stdin: %q exit %d", out, code)
		}
	})

	t.Run("env", func(t *testing.T) {
		out, _, _ := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", `echo "$SBX_VAR|$REQ_VAR|$OVERRIDE|$HOME|$PATH"`},
			Env: map[string]string{"REQ_VAR": "from-request", "OVERRIDE": "request"}})
		want := "from-create|from-request|request|/root|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
		if out != want {
			t.Errorf("env: %q, want %q", out, want)
		}
		out, _, _ = run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", `echo "$SBX_VAR|$REQ_VAR|$OVERRIDE"`}})
		if out != "from-create||create\n" {
			t.Errorf("env without request env: %q (a request's env must not stick)", out)
		}
	})

	t.Run("cwd", func(t *testing.T) {
		if out, _, _ := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"pwd"}}); out != "/\n" {
			t.Errorf("default cwd %q, want /", out)
		}
		sh(t, c, id, "mkdir -p /root/wd")
		if out, _, _ := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"pwd"}, Cwd: "/root/wd"}); out != "/root/wd\n" {
			t.Errorf("cwd /root/wd: %q", out)
		}
		_, _, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"pwd"}, Cwd: "/no/such/dir"})
		if err == nil || code == 0 {
			t.Errorf("missing cwd: exit %d err %v, want a failure", code, err)
		}
	})

	t.Run("timeout", func(t *testing.T) {
		t0 := time.Now()
		_, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "sleep 30 & sleep 30"}, TimeoutS: 1})
		el := time.Since(t0)
		if code != 124 {
			t.Errorf("timeout: exit %d, want 124", code)
		}
		if !strings.Contains(errb, "timeout") {
			t.Errorf("timeout: stderr %q does not say so", errb)
		}
		if el < time.Second || el > 10*time.Second {
			t.Errorf("timeout of 1 s returned after %v", el)
		}
		// The whole process group is gone: no "sleep 30" is left (the count works:
		// it sees a background "sleep 31").
		bg, err := c.ExecBackground(ctx, id, apiv1.ExecRequest{Cmd: []string{"sleep", "31"}})
		if err != nil {
			t.Fatal(err)
		}
		if n := countProcs(t, c, id, "sleep\\x0031\\x00"); n != 1 {
			t.Errorf("counted %d background sleep processes, want 1", n)
		}
		sh(t, c, id, fmt.Sprintf("kill %d", bg))
		if n := countProcs(t, c, id, "sleep\\x0030\\x00"); n != 0 {
			t.Errorf("%d sleep processes left after the timeout", n)
		}
	})

	t.Run("background survives the call and hibernate", func(t *testing.T) {
		pid, err := c.ExecBackground(ctx, id, apiv1.ExecRequest{Cmd: []string{"sh", "-c",
			"i=0; while true; do i=$((i+1)); echo $i > /tmp/bg.tmp; mv /tmp/bg.tmp /tmp/bg-counter; echo tick $i; sleep 0.1; done"}})
		if err != nil || pid <= 0 {
			t.Fatalf("background start: pid %d err %v", pid, err)
		}
		counter := func() int {
			t.Helper()
			out := sh(t, c, id, fmt.Sprintf("kill -0 %d && cat /tmp/bg-counter", pid))
			n, err := strconv.Atoi(strings.TrimSpace(out))
			if err != nil {
				t.Fatalf("counter %q: %v", out, err)
			}
			return n
		}
		time.Sleep(500 * time.Millisecond)
		n1 := counter()
		time.Sleep(500 * time.Millisecond)
		n2 := counter()
		if n2 <= n1 {
			t.Fatalf("background process stalled: counter %d then %d", n1, n2)
		}
		hibernate(t, c, id)
		if _, err := c.Resume(ctx, id); err != nil {
			t.Fatalf("resume: %v", err)
		}
		n3 := counter()
		if n3 < n2 {
			t.Errorf("counter went back from %d to %d over hibernate/resume", n2, n3)
		}
		time.Sleep(500 * time.Millisecond)
		n4 := counter()
		if n4 <= n3 {
			t.Errorf("background process did not continue after resume: counter %d then %d", n3, n4)
		}
		log := string(readFile(t, c, id, fmt.Sprintf("/tmp/torpor-bg-%d.log", pid)))
		if !strings.Contains(log, "tick 1\n") || !strings.Contains(log, fmt.Sprintf("tick %d\n", n4)) {
			t.Errorf("background log lacks ticks 1..%d: %d bytes", n4, len(log))
		}
		sh(t, c, id, fmt.Sprintf("kill %d", pid))
	})
}

// countProcs counts the processes in sandbox id whose /proc/PID/cmdline equals
// cmdline (NUL-separated, as a Python bytes literal body).
func countProcs(t *testing.T, c *client.Client, id, cmdline string) int {
	t.Helper()
	script := `import os
n = 0
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            n += open("/proc/%s/cmdline" % p, "rb").read() == b"` + cmdline + `"
        except OSError:
            pass
print(n)`
	out, errb, code := run(t, c, id, apiv1.ExecRequest{Cmd: []string{"python3", "-c", script}})
	if code != 0 {
		t.Fatalf("counting processes: exit %d: %s", code, errb)
	}
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("process count %q: %v", out, err)
	}
	return n
}

// TestExecCutSaysWhy: an exec stream cut by a delete of its sandbox, or by the
// death of the sandbox's process (killed by a signal from the host), says
// which, exit 255, rather than the raw "read tcp …: use of closed network
// connection" a new-user trial got; the death is not blamed on its memory, as
// its cgroup counted no OOM kill.
func TestExecCutSaysWhy(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 3*time.Minute)
	cut := func(id string, act func()) (int, error) {
		t.Helper()
		type result struct {
			code int
			err  error
		}
		done := make(chan result, 1)
		go func() {
			_, _, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"sleep", "60"}})
			done <- result{code, err}
		}()
		time.Sleep(time.Second)
		act()
		r := <-done
		t.Logf("cut exec: exit %d, %v", r.code, r.err)
		return r.code, r.err
	}

	deleted := create(t, c, apiv1.CreateSandboxRequest{})
	code, err := cut(deleted.ID, func() {
		if err := c.DeleteSandbox(ctx, deleted.ID); err != nil {
			t.Error(err)
		}
	})
	if code != 255 || err == nil || !strings.Contains(err.Error(), "the sandbox was deleted while the command ran") {
		t.Errorf("exec cut by a delete: exit %d, %v; want 255 saying the sandbox was deleted", code, err)
	}

	died := create(t, c, apiv1.CreateSandboxRequest{})
	code, err = cut(died.ID, func() {
		_, _, pids := instancesOf(t, srv, died.ID)
		if len(pids) != 1 {
			t.Fatalf("engine pids of %s: %v, want one", died.ID, pids)
		}
		if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	if code != 255 || err == nil || !strings.Contains(err.Error(), "the sandbox stopped while the command ran and is in state error") ||
		!strings.Contains(err.Error(), "not killed for its memory") || strings.Contains(err.Error(), "closed network connection") {
		t.Errorf("exec cut by the sandbox's death: exit %d, %v; want 255 naming state error and its reason", code, err)
	}
	if err := c.DeleteSandbox(ctx, died.ID); err != nil {
		t.Error(err)
	}
}
