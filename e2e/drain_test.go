package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestRequestsRacingHibernate: execs, proxied requests and file writes fired at
// a sandbox while another caller hibernates and resumes it over and over all
// succeed. A request that arrives during a hibernate waits and resumes the
// sandbox; one in flight when a hibernate begins is drained first. Every exec
// that reports success ran exactly once (one line each in a log), and the
// workload's counter never repeats a value.
func TestRequestsRacingHibernate(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id := sb.ID
	if err := workload.Start(ctx, c, id, 8); err != nil {
		t.Fatal(err)
	}

	const cycles, workers, perWorker = 6, 3, 15
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var execOK, hibs atomic.Int64
	var mu sync.Mutex
	var failures []string
	var counts []int64
	failf := func(format string, args ...any) {
		mu.Lock()
		failures = append(failures, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	for w := 0; w < workers; w++ {
		wg.Add(3)
		go func() { // execs that append a line
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				_, errb, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{
					Cmd: []string{"sh", "-c", "echo " + strconv.Itoa(w) + "-" + strconv.Itoa(i) + " >> /root/drain.log"}})
				if err != nil || code != 0 {
					failf("exec %d-%d: exit %d, err %v, stderr %q", w, i, code, err, errb)
					continue
				}
				execOK.Add(1)
			}
		}()
		go func() { // proxied requests
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				st, err := workload.Get(ctx, c, id, "/count")
				if err != nil {
					failf("proxied GET /count: %v", err)
					continue
				}
				mu.Lock()
				counts = append(counts, st.Count)
				mu.Unlock()
			}
		}()
		go func() { // file writes
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				p := "/root/drain-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				if err := c.WriteFile(ctx, id, p, strings.NewReader("x")); err != nil {
					failf("PUT %s: %v", p, err)
				}
			}
		}()
	}
	hibDone := make(chan struct{})
	go func() {
		defer close(hibDone)
		for k := 0; k < cycles; k++ {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := c.Hibernate(ctx, id); err != nil {
				failf("hibernate %d: %v", k, err)
				continue
			}
			hibs.Add(1)
			time.Sleep(50 * time.Millisecond)
			if _, err := c.Resume(ctx, id); err != nil {
				failf("resume %d: %v", k, err)
			}
		}
	}()
	wg.Wait()
	close(stop)
	<-hibDone
	for _, f := range failures {
		t.Error(f)
	}
	if hibs.Load() < 2 {
		t.Errorf("only %d hibernates ran during the requests", hibs.Load())
	}
	lines := strings.Count(sh(t, c, id, "cat /root/drain.log"), "\n")
	if int64(lines) != execOK.Load() {
		t.Errorf("%d lines in the log, %d execs reported success: a command ran without its success being reported, or twice", lines, execOK.Load())
	}
	seen := map[int64]bool{}
	for _, n := range counts {
		if seen[n] {
			t.Errorf("counter value %d answered twice", n)
		}
		seen[n] = true
	}
	t.Logf("%d hibernates; %d execs, %d proxied requests, %d file writes, all answered", hibs.Load(), execOK.Load(), len(counts), workers*perWorker)
}

// TestStalledUploadDoesNotFreezeSandbox: a client that starts a file upload and
// then sends nothing holds no lock on the sandbox: an exec meanwhile is
// answered, and a hibernate drains the upload, cuts it after the drain and
// goes on; the cut upload is answered 409 and writes nothing.
func TestStalledUploadDoesNotFreezeSandbox(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})

	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "PUT /v1/sandboxes/%s/files?path=/root/stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n", sb.ID)
	conn.Write(make([]byte, 1000))
	answer := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(conn)
		answer <- string(b)
	}()
	time.Sleep(500 * time.Millisecond) // the upload has reached the agent

	// Liveness, not speed: with the upload holding the sandbox these would wait
	// for the client, which never sends the rest.
	ectx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if out, _, code, err := c.ExecCollect(ectx, sb.ID, apiv1.ExecRequest{Cmd: []string{"echo", "alive"}}); err != nil || code != 0 || string(out) != "alive\n" {
		t.Fatalf("exec during a stalled upload: %q exit %d err %v", out, code, err)
	}
	if _, err := c.Hibernate(ectx, sb.ID); err != nil {
		t.Fatalf("hibernate during a stalled upload: %v", err)
	}
	select {
	case a := <-answer:
		if !strings.Contains(a, " 409 ") || !strings.Contains(a, "nothing was written") {
			t.Errorf("the cut upload's answer: %q, want 409 saying nothing was written", a)
		}
	case <-ectx.Done():
		t.Fatal("the cut upload got no answer")
	}
	if _, err := c.ReadFile(ectx, sb.ID, "/root/stalled"); err == nil {
		t.Error("/root/stalled exists after its upload was cut")
	}
}

// An exec still streaming when a hibernate's 10 s drain ends is cut: exit 255,
// with a message that says a hibernate cut it (not a bare network error).
func TestExecCutByHibernateSaysSo(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 2*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		_, _, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"sleep", "60"}})
		done <- result{code, err}
	}()
	time.Sleep(time.Second)
	hibernate(t, c, sb.ID)
	r := <-done
	if r.code != 255 || r.err == nil || !strings.Contains(r.err.Error(), "cut by a hibernate") {
		t.Fatalf("exec cut by the hibernate's drain: exit %d, err %v; want 255 and a message naming the hibernate", r.code, r.err)
	}
	t.Logf("cut exec: exit %d, %v", r.code, r.err)
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}
