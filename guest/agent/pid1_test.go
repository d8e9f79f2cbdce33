package agent_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/guest/agent"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// pid1Env makes the test binary act as the agent, serving on its fd 3 (see TestMain).
const pid1Env = "TORPOR_AGENT_TEST_SERVE_FD3"

func TestMain(m *testing.M) {
	if os.Getenv(pid1Env) == "1" {
		ln, err := net.FileListener(os.NewFile(3, "listener"))
		if err != nil {
			os.Exit(2)
		}
		agent.Serve(context.Background(), ln, agent.Options{})
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestPID1Reaper runs the agent as PID 1 of a new PID namespace (needs root and
// unshare(1)) and checks that orphans are reaped while the agent's own commands still
// get their exit status.
func TestPID1Reaper(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a PID namespace")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("no unshare(1)")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.Command(unshare, "--pid", "--fork", "--mount-proc", "--kill-child", os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), pid1Env+"=1")
	cmd.ExtraFiles = []*os.File{lf}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	t.Cleanup(func() {
		// Kill the agent (unshare's child, PID 1 of the namespace, so everything in
		// it dies too) and let unshare reap it; then unshare itself exits.
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		for _, f := range strings.Fields(string(kids)) {
			if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill() // --kill-child takes the agent along
			<-done
		}
	})
	c := agentclient.New(agentclient.TCPDialer(addr))
	defer c.CloseIdleConnections()
	ctx := context.Background()
	if err := c.WaitReady(ctx, 10*time.Second); err != nil {
		t.Skipf("agent in a PID namespace did not come up (unshare not permitted here?): %v", err)
	}
	h, err := c.Info(ctx)
	if err != nil || h.Pid != 1 {
		t.Fatalf("info %+v err %v", h, err)
	}

	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, _, code, err := c.Run(ctx, proto.ExecRequest{
				Cmd: []string{"sh", "-c", "(sleep 0.1 &); echo $0; exit $(($0 % 7))", fmt.Sprint(i)}})
			if err != nil || code != i%7 || string(out) != fmt.Sprintf("%d\n", i) {
				errs <- fmt.Errorf("exec %d: out %q code %d err %v", i, out, code, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	deadline := time.Now().Add(3 * time.Second)
	for {
		out, _, _, err := c.Run(ctx, proto.ExecRequest{Cmd: []string{"sh", "-c",
			`for f in /proc/[0-9]*/stat; do read -r l < "$f" && echo "$l"; done 2>/dev/null`}})
		if err != nil {
			t.Fatal(err)
		}
		var zombies []string
		for _, l := range strings.Split(string(out), "\n") {
			if i := strings.LastIndexByte(l, ')'); i > 0 && i+2 < len(l) && l[i+2] == 'Z' {
				zombies = append(zombies, l)
			}
		}
		if len(zombies) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("zombies left in the namespace:\n%s", strings.Join(zombies, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
