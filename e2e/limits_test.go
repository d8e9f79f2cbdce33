package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/server/servertest"
)

// pidsCgroup returns the pids cgroup directory of sandbox id's running
// instance.
func pidsCgroup(t *testing.T, srv *servertest.Server, id string) string {
	t.Helper()
	running, _, _ := instancesOf(t, srv, id)
	if len(running) != 1 {
		t.Fatalf("running instances of %s: %v, want one", id, running)
	}
	m, _ := filepath.Glob("/sys/fs/cgroup/pids/torpor-*/" + running[0])
	if len(m) == 0 {
		m, _ = filepath.Glob("/sys/fs/cgroup/torpor-*/" + running[0])
	}
	if len(m) != 1 {
		t.Fatalf("pids cgroup of %s: %v", running[0], m)
	}
	return m[0]
}

func readInt(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("%s: %q", path, b)
	}
	return n
}

// maxProcesses is the "Max processes" soft limit a new process in sandbox id
// has.
func maxProcesses(t *testing.T, c *client.Client, id string) string {
	t.Helper()
	out := sh(t, c, id, "grep 'Max processes' /proc/self/limits")
	f := strings.Fields(out)
	if len(f) < 4 {
		t.Fatalf("limits line %q", out)
	}
	return f[2]
}

// TestForkBombContained: a sandbox with pids_limit 64 runs a fork bomb; its
// tasks stay under the limit (the host cgroup's count stays under its
// backstop), the host, the API and another sandbox keep answering, and the
// sandbox is then deleted with nothing left. The limit survives a hibernate
// and resume (restored from the checkpoint), and a sandbox without a
// pids_limit gets the server's default.
func TestForkBombContained(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	bomb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, PidsLimit: 64})
	other := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if bomb.PidsLimit != 64 || other.PidsLimit != manager.DefaultPidsFor(256) {
		t.Errorf("pids_limit %d and %d, want 64 and the default %d", bomb.PidsLimit, other.PidsLimit, manager.DefaultPidsFor(256))
	}
	if got := maxProcesses(t, c, other.ID); got != strconv.Itoa(manager.DefaultPidsFor(256)) {
		t.Errorf("default sandbox's Max processes %s, want %d", got, manager.DefaultPidsFor(256))
	}
	hibernate(t, c, bomb.ID)
	if _, err := c.Resume(ctx, bomb.ID); err != nil {
		t.Fatal(err)
	}
	if got := maxProcesses(t, c, bomb.ID); got != "64" {
		t.Errorf("Max processes after hibernate and resume: %s, want 64", got)
	}
	cg := pidsCgroup(t, srv, bomb.ID)
	backstop := readInt(t, filepath.Join(cg, "pids.max"))
	if backstop != 4*64+512 {
		t.Errorf("host pids.max %d, want %d", backstop, 4*64+512)
	}

	if _, err := c.ExecBackground(ctx, bomb.ID, apiv1.ExecRequest{Cmd: []string{"bash", "-c", ":(){ :|:& };:"}}); err != nil {
		t.Fatal(err)
	}
	peak := 0
	for range 10 {
		time.Sleep(500 * time.Millisecond)
		peak = max(peak, readInt(t, filepath.Join(cg, "pids.current")))
	}
	t.Logf("fork bomb under pids_limit 64: host tasks of the sandbox peaked at %d (pids.max %d)", peak, backstop)
	if peak >= backstop {
		t.Errorf("the sandbox's host tasks reached the backstop %d: the in-sandbox limit did not hold", backstop)
	}
	if peak < 64 {
		t.Errorf("host tasks peaked at %d: the bomb did not run", peak)
	}
	// The rest of the host answers: the API, the other sandbox.
	t0 := time.Now()
	if err := c.Health(ctx); err != nil {
		t.Errorf("health during the bomb: %v", err)
	}
	if got := sh(t, c, other.ID, "echo alive"); got != "alive\n" {
		t.Errorf("other sandbox during the bomb: %q", got)
	}
	t.Logf("health and another sandbox's exec during the bomb: %v", time.Since(t0).Round(time.Millisecond))
	// The bombed sandbox refuses new processes with the kernel's error.
	_, errb, code, err := c.ExecCollect(ctx, bomb.ID, apiv1.ExecRequest{Cmd: []string{"true"}})
	t.Logf("exec in the bombed sandbox: code %d err %v stderr %q", code, err, errb)
	if st := get(t, c, bomb.ID); st.State != apiv1.StateRunning {
		t.Errorf("bombed sandbox in state %s (%s), want running", st.State, st.Error)
	}

	t0 = time.Now()
	if err := c.DeleteSandbox(ctx, bomb.ID); err != nil {
		t.Fatalf("delete the bombed sandbox: %v", err)
	}
	t.Logf("deleted the bombed sandbox in %v", time.Since(t0).Round(time.Millisecond))
	assertGone(t, srv, bomb.ID)
	if got := sh(t, c, other.ID, "echo still"); got != "still\n" {
		t.Errorf("other sandbox after the delete: %q", got)
	}
}

// TestForkBombDefaultLimit: a fork bomb in a 256 MiB sandbox without a
// pids_limit meets its default pids limit (one task per 2 MiB: 128) before
// its memory limit: the sandbox is not killed for its memory and stays
// running for the 15 s watched (issue 18, D5: with the flat default of 1024
// it was killed within seconds), and is deleted cleanly.
func TestForkBombDefaultLimit(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if sb.PidsLimit != manager.DefaultPidsFor(256) || sb.PidsLimit >= manager.DefaultPidsLimit {
		t.Errorf("default pids_limit of a 256 MiB sandbox: %d, want %d", sb.PidsLimit, manager.DefaultPidsFor(256))
	}
	if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"bash", "-c", ":(){ :|:& };:"}}); err != nil {
		t.Fatal(err)
	}
	for range 30 {
		time.Sleep(500 * time.Millisecond)
		if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
			t.Fatalf("bombed sandbox in state %s (%s), want running", st.State, st.Error)
		}
	}
	if err := c.Health(ctx); err != nil {
		t.Errorf("health during the bomb: %v", err)
	}
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatalf("delete the bombed sandbox: %v", err)
	}
	assertGone(t, srv, sb.ID)
}

// TestRootForkBombAgentSurvives: a root fork bomb, with root processes
// that keep every task of the default pids limit (128 in 256 MiB) taken,
// does not end the sandbox while the host keeps calling its guest agent for
// 60 s: a steady exec loop, and 16 file reads of a FIFO, each of which holds
// one of the agent's OS threads in open(2) so that its Go runtime must make
// new ones (the API answers one file read of a sandbox at a time until the
// agent answers, so they go to the agent directly). The agent is uid 0 like the bomb; a runtime that cannot make a
// thread exits ("failed to create new OS thread"), and the sandbox with it,
// which is what happened before the agent was exempt from the limit. The
// commands it starts stay bound (their forks fail with EAGAIN) and do not
// have CAP_SYS_RESOURCE; once the bomb is killed, execs work again.
func TestRootForkBombAgentSurvives(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	caps := sh(t, c, sb.ID, "grep -E '^Cap(Eff|Bnd)' /proc/self/status; mkfifo /tmp/fifo")
	for _, l := range strings.Split(strings.TrimSpace(caps), "\n") {
		f := strings.Fields(l)
		if v, err := strconv.ParseUint(f[len(f)-1], 16, 64); err != nil || v&(1<<24) != 0 {
			t.Errorf("a command's %q: want no CAP_SYS_RESOURCE (bit 24)", l)
		}
	}
	for _, script := range []string{":(){ :|:& };:", "while :; do sleep 600 & done"} {
		if _, err := c.ExecBackground(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"bash", "-c", script}}); err != nil {
			t.Fatal(err)
		}
	}
	// Straight to the agent: through the API a read holds the sandbox's
	// lock until the agent answers, so the reads would wait for each other.
	ac := agentclient.New(func(ctx context.Context) (net.Conn, error) { return srv.Manager.DialAgent(ctx, sb.ID) })
	readers, cancel := context.WithCancel(ctx)
	defer cancel()
	for range 16 {
		go func() {
			if r, _, err := ac.ReadFile(readers, "/tmp/fifo"); err == nil {
				io.Copy(io.Discard, r)
				r.Close()
			}
		}()
	}
	ok, eagain := 0, 0
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end); {
		out, errb, code, err := c.ExecCollect(ctxFor(t, time.Minute), sb.ID, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "echo start; echo end"}, TimeoutS: 10})
		switch {
		case err == nil && code == 0 && string(out) == "start\nend\n":
			ok++
		case err == nil && strings.Contains(strings.ToLower(string(errb)), "resource temporarily unavailable"):
			eagain++
		default:
			st := get(t, c, sb.ID)
			t.Fatalf("exec during the bomb (%d answered, %d EAGAIN before): code %d err %v stdout %q stderr %q; sandbox %s (%s)",
				ok, eagain, code, err, out, errb, st.State, st.Error)
		}
		if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
			t.Fatalf("bombed sandbox in state %s (%s), want running", st.State, st.Error)
		}
	}
	t.Logf("60 s of execs during a root fork bomb: %d answered, %d EAGAIN", ok, eagain)
	if ok == 0 {
		t.Error("no exec answered during the bomb: the agent could not start a command")
	}
	// The commands the agent starts stay bound: their forks fail.
	out, errb, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"sh", "-c",
		"n=0; for i in 1 2 3 4 5 6 7 8; do /bin/true 2>/dev/null || n=$((n+1)); done; echo $n"}})
	t.Logf("8 forks inside a command during the bomb: %q failed (code %d, err %v, stderr %q)", out, code, err, errb)
	if n, _ := strconv.Atoi(strings.TrimSpace(string(out))); err == nil && code == 0 && n == 0 {
		t.Error("every fork of a command during the bomb worked: commands must stay bound by the pids limit")
	}

	// Kill every process but the agent, release the readers: execs work again.
	for i := 0; ; i++ {
		_, _, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"kill", "-9", "-1"}})
		if err == nil && code == 0 {
			break
		}
		if i == 100 {
			t.Fatalf("kill -9 -1: code %d err %v", code, err)
		}
	}
	deadline := time.Now().Add(time.Minute)
	for {
		out, _, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"sh", "-c", "exec 3<>/tmp/fifo; /bin/echo works again"}})
		if err == nil && code == 0 && string(out) == "works again\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("exec after the bomb was killed: %q code %d err %v", out, code, err)
		}
		time.Sleep(time.Second)
	}
	if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
		t.Errorf("sandbox in state %s (%s) after the bomb, want running", st.State, st.Error)
	}
}

// TestWritableLayerBound: a 256 MiB sandbox's root file system takes 128
// MiB (half its memory) of writes, its /tmp 64 MiB (a quarter) and its
// /dev/shm 32 MiB (an eighth); beyond them a write fails with ENOSPC in the
// sandbox, which keeps running, also with all three full at once, and the
// bounds hold after a hibernate and resume. /dev/shm stays mode 1777, and a
// user's write past its bound is ENOSPC too (it had ended the sandbox: an
// unbounded directory of the /dev tmpfs).
func TestWritableLayerBound(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	check := func(when string) {
		for _, d := range []struct {
			dir string
			mib int
		}{{"/root", 128}, {"/tmp", 64}, {"/dev/shm", 32}} {
			out := sh(t, c, sb.ID, "dd if=/dev/zero of="+d.dir+"/big bs=1M count=400 2>&1 | grep -c 'No space left on device'; stat -c %s "+d.dir+"/big; df -m "+d.dir+" | tail -1")
			t.Logf("%s: 400 MiB into %s: %s", when, d.dir, strings.ReplaceAll(out, "\n", " | "))
			f := strings.Fields(out)
			if len(f) < 4 || f[0] != "1" {
				t.Errorf("%s: 400 MiB into %s: %q, want ENOSPC", when, d.dir, out)
				continue
			}
			if size, _ := strconv.Atoi(f[1]); size > d.mib<<20 || size < (d.mib-16)<<20 {
				t.Errorf("%s: %s/big took %d bytes, want up to the %d MiB bound", when, d.dir, size, d.mib)
			}
			if f[3] != strconv.Itoa(d.mib) {
				t.Errorf("%s: df of %s: %q, want a %d MiB file system", when, d.dir, out, d.mib)
			}
		}
		// All full at once: the sandbox keeps running.
		sh(t, c, sb.ID, "echo all full; rm /root/big /tmp/big /dev/shm/big")
		if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
			t.Errorf("%s: sandbox in state %s (%s) after the writes, want running", when, st.State, st.Error)
		}
		out := sh(t, c, sb.ID, "stat -c %a /dev/shm; su nobody -s /bin/sh -c 'dd if=/dev/zero of=/dev/shm/f bs=1M count=120' 2>&1 | grep -c 'No space left on device'; rm /dev/shm/f")
		if out != "1777\n1\n" {
			t.Errorf("%s: /dev/shm's mode and nobody's 120 MiB write into it: %q, want 1777 and ENOSPC", when, out)
		}
		if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
			t.Errorf("%s: sandbox in state %s (%s) after nobody's write into /dev/shm, want running", when, st.State, st.Error)
		}
	}
	check("created")
	hibernate(t, c, sb.ID)
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	check("resumed")
}

// TestFileWriteIntoFullSandbox: a file write through the API beyond a 256
// MiB sandbox's writable layer (128 MiB), its /tmp (64 MiB) or its /dev/shm
// (32 MiB) is 507
// insufficient_storage naming that bound and saying the host's disk is not
// full, not naming the data directory (issue 18, D6: it had read "the data
// directory's disk is full"); the sandbox keeps running and the next write
// that fits works.
func TestFileWriteIntoFullSandbox(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	for _, d := range []struct {
		path, names string
		mib         int
	}{{"/root/big", "writable layer of its root file system", 128}, {"/tmp/big", "its /tmp", 64}, {"/dev/shm/big", "its /dev/shm", 32}} {
		body := bytes.NewReader(make([]byte, (d.mib+32)<<20))
		res := rawCall(t, http.MethodPut, srv.URL+"/v1/sandboxes/"+sb.ID+"/files?path="+d.path, "application/octet-stream", mustRead(t, body))
		t.Logf("PUT %s of %d MiB: %d %s", d.path, d.mib+32, res.Status, res.Err.Message)
		if res.Status != http.StatusInsufficientStorage || res.Err.Code != apiv1.CodeInsufficientStorage ||
			!strings.Contains(res.Err.Message, d.names) || !strings.Contains(res.Err.Message, fmt.Sprintf("%d MiB", d.mib)) ||
			strings.Contains(res.Err.Message, srv.DataDir) || strings.Contains(res.Err.Message, "data directory") {
			t.Errorf("PUT %s beyond its bound: %d %s %q, want 507 insufficient_storage naming %q and %d MiB, not the data directory", d.path, res.Status, res.Err.Code, res.Err.Message, d.names, d.mib)
		}
		sh(t, c, sb.ID, "rm -f "+d.path)
	}
	// Through the Go client (torpor cp), streaming: the 507 reaches it, not a
	// connection reset while it still sends.
	for i := range 3 {
		err := c.WriteFile(ctxFor(t, 2*time.Minute), sb.ID, "/root/big", io.LimitReader(zeros{}, 200<<20))
		var ae *client.APIError
		if !errors.As(err, &ae) || ae.Status != http.StatusInsufficientStorage {
			t.Errorf("client upload %d of 200 MiB into a full sandbox: %v, want the API's 507", i, err)
		}
		sh(t, c, sb.ID, "rm -f /root/big")
	}
	writeFile(t, c, sb.ID, "/root/small", []byte("fits"))
	if st := get(t, c, sb.ID); st.State != apiv1.StateRunning {
		t.Errorf("sandbox in state %s (%s) after the writes, want running", st.State, st.Error)
	}
}

func mustRead(t *testing.T, r io.Reader) []byte {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// hostMemBytes is MemTotal of /proc/meminfo.
func hostMemBytes(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var kb int64
		if _, err := fmt.Sscanf(sc.Text(), "MemTotal: %d kB", &kb); err == nil {
			return kb << 10
		}
	}
	t.Fatal("no MemTotal in /proc/meminfo")
	return 0
}

// TestAdmissionOnHost: with an overcommit ratio that leaves room for one
// 256 MiB sandbox of the host's memory, the next create is 503 with
// Retry-After and the reason; a hibernated sandbox frees its share (another
// create fits), and its resume is then refused.
func TestAdmissionOnHost(t *testing.T) {
	ratio := float64(384<<20) / float64(hostMemBytes(t))
	srv := start(t, servertest.Options{Limits: manager.LimitsConfig{MemoryOvercommit: ratio}})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	first := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	res := rawCall(t, http.MethodPost, srv.URL+"/v1/sandboxes", "application/json", []byte(`{"memory_mib":256}`))
	if res.Status != http.StatusServiceUnavailable || res.Header.Get("Retry-After") == "" || !strings.Contains(string(res.Body), "host memory full") {
		t.Fatalf("second create: %d Retry-After %q %s, want 503 with Retry-After and the reason", res.Status, res.Header.Get("Retry-After"), res.Body)
	}
	t.Logf("refused: %s", res.Body)
	hibernate(t, c, first.ID)
	second := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	_, err := c.Resume(ctx, first.ID)
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.Status != http.StatusServiceUnavailable {
		t.Errorf("resume with the host full: %v, want 503", err)
	}
	if err := c.DeleteSandbox(ctx, second.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(ctx, first.ID); err != nil {
		t.Errorf("resume once memory is free: %v", err)
	}
}

// zeros reads as an endless run of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
