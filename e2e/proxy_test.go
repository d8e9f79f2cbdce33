package e2e

import (
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestProxyWaits checks the port proxy's promise: requests to a hibernated
// sandbox wake it — ten at once all succeed with a single resume — and requests
// that arrive while a hibernate is in progress are answered after it, not failed.
func TestProxyWaits(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	id := sb.ID
	if err := workload.Start(ctx, c, id, 64); err != nil {
		t.Fatal(err)
	}
	st0, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		t.Fatal(err)
	}

	// get fires n proxied GET /count at once and returns the answers.
	send := func(n int) (wait func() ([]workload.State, []error)) {
		sts := make([]workload.State, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sts[i], errs[i] = workload.Get(ctx, c, id, "/count")
			}()
		}
		return func() ([]workload.State, []error) { wg.Wait(); return sts, errs }
	}
	get := func(n int) ([]workload.State, []error) { return send(n)() }
	// checkCounts wants n successful answers from one process with the counts
	// after..after+n (each request counted once).
	checkCounts := func(what string, sts []workload.State, errs []error, after int64) int64 {
		t.Helper()
		var counts []int64
		for i, err := range errs {
			if err != nil {
				t.Errorf("%s: request %d failed: %v", what, i, err)
				continue
			}
			if sts[i].Pid != st0.Pid {
				t.Errorf("%s: answered by pid %d, want %d", what, sts[i].Pid, st0.Pid)
			}
			counts = append(counts, sts[i].Count)
		}
		sort.Slice(counts, func(a, b int) bool { return counts[a] < counts[b] })
		for i, n := range counts {
			if n != after+int64(i)+1 {
				t.Errorf("%s: counts %v, want %d..%d", what, counts, after+1, after+int64(len(errs)))
				break
			}
		}
		return after + int64(len(counts))
	}

	t.Run("ten requests to a hibernated sandbox", func(t *testing.T) {
		hibernate(t, c, id)
		resumes0 := metric(t, srv, "torpor_resume_duration_seconds_count")
		t0 := time.Now()
		sts, errs := get(10)
		t.Logf("10 concurrent proxied requests answered within %v", time.Since(t0).Round(time.Millisecond))
		st0.Count = checkCounts("wake", sts, errs, st0.Count)
		if n := metric(t, srv, "torpor_resume_duration_seconds_count") - resumes0; n != 1 {
			t.Errorf("%v resumes for 10 concurrent requests, want 1", n)
		}
		wantState(t, c, id, apiv1.StateRunning)
	})

	t.Run("requests during a hibernate", func(t *testing.T) {
		for attempt := 1; ; attempt++ {
			var hib apiv1.Sandbox
			var hibErr error
			done := make(chan struct{})
			go func() {
				defer close(done)
				hib, hibErr = c.Hibernate(ctx, id)
			}()
			// Wait until the sandbox is reported hibernating, then send requests.
			seen := false
			for !seen {
				select {
				case <-done:
				default:
					if s, err := c.GetSandbox(ctx, id); err == nil && s.State == apiv1.StateHibernating {
						seen = true
					}
					continue
				}
				break
			}
			if !seen {
				<-done
				if hibErr != nil {
					t.Fatalf("hibernate: %v", hibErr)
				}
				if attempt == 5 {
					t.Fatalf("never saw the sandbox hibernating in %d attempts", attempt)
				}
				t.Logf("attempt %d: the hibernate ended before its state was seen; again", attempt)
				if _, err := c.Resume(ctx, id); err != nil {
					t.Fatal(err)
				}
				continue
			}
			wait := send(5)
			// An exec sent during the hibernate waits for it too.
			var out []byte
			var code int
			var execErr error
			execDone := make(chan struct{})
			go func() {
				defer close(execDone)
				out, _, code, execErr = c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"echo", "after"}})
			}()
			time.Sleep(20 * time.Millisecond) // let the requests reach the server
			inProgress := true
			select {
			case <-done:
				inProgress = false
				t.Logf("attempt %d: the hibernate may have ended before the requests arrived", attempt)
			default:
				t.Logf("attempt %d: requests sent while the hibernate was in progress", attempt)
			}
			sts, errs := wait()
			<-execDone
			<-done
			if hibErr != nil || hib.State != apiv1.StateHibernated {
				t.Fatalf("hibernate: state %q err %v", hib.State, hibErr)
			}
			st0.Count = checkCounts("during hibernate", sts, errs, st0.Count)
			if execErr != nil || code != 0 || string(out) != "after\n" {
				t.Errorf("exec sent during the hibernate: %q exit %d err %v", out, code, execErr)
			}
			wantState(t, c, id, apiv1.StateRunning)
			if inProgress {
				return
			}
			if attempt == 5 {
				t.Fatalf("could not send requests during a hibernate in %d attempts", attempt)
			}
		}
	})
}

// TestProxyAmidLifecycle: proxied GETs sent while hibernates, pauses and
// resumes of the same sandbox run concurrently with them are all answered
// 200 (the port proxy's promise: a call racing a lifecycle change waits and
// is answered; issue 18: 3 of ~40 had answered 502 "use of closed network
// connection").
func TestProxyAmidLifecycle(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id := sb.ID
	if err := workload.Start(ctx, c, id, 16); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var lifecycle sync.WaitGroup
	lifecycle.Add(1)
	ops := 0
	go func() {
		defer lifecycle.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			var err error
			switch (i * 7 / 3) % 3 { // every order of the three: h p r, h r p, p h r, …
			case 0:
				_, err = c.Hibernate(ctx, id)
			case 1:
				_, err = c.Pause(ctx, id)
			case 2:
				_, err = c.Resume(ctx, id)
			}
			if err != nil && !client.IsConflict(err) { // a pause with a request in flight is refused (409)
				t.Errorf("lifecycle call %d: %v", i, err)
			}
			ops++
			time.Sleep(time.Duration(i%4) * 20 * time.Millisecond)
		}
	}()
	const workers, each = 6, 20
	var gets sync.WaitGroup
	var mu sync.Mutex
	failed := 0
	for w := range workers {
		gets.Add(1)
		go func() {
			defer gets.Done()
			for i := range each {
				if _, err := workload.Get(ctx, c, id, "/count"); err != nil {
					mu.Lock()
					failed++
					mu.Unlock()
					t.Errorf("worker %d GET %d: %v", w, i, err)
				}
				time.Sleep(time.Duration(w*7+i%5) * time.Millisecond)
			}
		}()
	}
	gets.Wait()
	close(stop)
	lifecycle.Wait()
	t.Logf("%d proxied GETs amid %d hibernates, pauses and resumes: %d failed", workers*each, ops, failed)
}
