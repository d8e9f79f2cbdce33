package e2e

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
)

// TestDeleteRacingResume fires a resume and a DELETE at a hibernated sandbox at
// once, in both orders and at several offsets, on a server whose resumes pause
// 1.5 s after marking the sandbox resuming. Whatever wins, the DELETE must
// succeed, the sandbox must be 404 afterwards, and no runsc process of it may be
// left — neither in the engine's list nor in the host's process table.
func TestDeleteRacingResume(t *testing.T) {
	const delay = 1500 * time.Millisecond
	srv := start(t, servertest.Options{ResumeDelay: delay})
	c := srv.Client

	cases := []struct {
		name string
		// first is sent, then after gap the other one.
		deleteFirst bool
		gap         time.Duration
		// resumeBy is how the resume is asked for: "resume", "proxy" or "exec".
		resumeBy string
	}{
		{"resume, delete during the resume delay", false, 300 * time.Millisecond, "resume"},
		{"resume, delete while the engine restores", false, delay + 100*time.Millisecond, "resume"},
		{"resume and delete at once", false, 0, "resume"},
		{"delete, then resume", true, 5 * time.Millisecond, "resume"},
		{"proxied request, delete during the resume delay", false, 300 * time.Millisecond, "proxy"},
		{"exec, delete during the resume delay", false, 300 * time.Millisecond, "exec"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxFor(t, 3*time.Minute)
			sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
			hibernate(t, c, sb.ID)

			var wg sync.WaitGroup
			var resumeErr, deleteErr error
			var resumeStatus int
			doResume := func() {
				defer wg.Done()
				switch tc.resumeBy {
				case "resume":
					_, resumeErr = c.Resume(ctx, sb.ID)
				case "exec":
					_, _, _, resumeErr = c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"true"}})
				case "proxy":
					resp, err := c.Do(ctx, http.MethodGet, "/v1/sandboxes/"+sb.ID+"/ports/8080/", nil, nil)
					if err != nil {
						resumeErr = err
						return
					}
					resp.Body.Close()
					resumeStatus = resp.StatusCode
				}
			}
			doDelete := func() {
				defer wg.Done()
				deleteErr = c.DeleteSandbox(ctx, sb.ID)
			}
			wg.Add(2)
			t0 := time.Now()
			if tc.deleteFirst {
				go doDelete()
				time.Sleep(tc.gap)
				go doResume()
			} else {
				go doResume()
				time.Sleep(tc.gap)
				go doDelete()
			}
			wg.Wait()
			t.Logf("both calls returned after %v: resume err=%v (proxy status %d), delete err=%v",
				time.Since(t0).Round(time.Millisecond), resumeErr, resumeStatus, deleteErr)

			if deleteErr != nil {
				t.Errorf("DELETE failed: %v", deleteErr)
			}
			// The resume either won (and was then deleted) or lost with 404; a
			// proxied request that won gets 502 (nothing listens on 8080).
			if resumeErr != nil && !client.IsNotFound(resumeErr) && !errors.Is(resumeErr, context.Canceled) {
				var ee *client.ExecError
				if !errors.As(resumeErr, &ee) {
					t.Errorf("resume failed with %v, want success or not_found", resumeErr)
				}
			}
			if tc.resumeBy == "proxy" && resumeStatus != http.StatusNotFound && resumeStatus != http.StatusBadGateway {
				t.Errorf("proxied request answered %d, want 404 (deleted first) or 502 (nothing on the port)", resumeStatus)
			}
			if _, err := c.GetSandbox(ctx, sb.ID); !client.IsNotFound(err) {
				t.Errorf("GET after the race: err %v, want not_found", err)
			}
			for _, s := range mustList(t, c) {
				if s.ID == sb.ID {
					t.Errorf("list still shows %s (%s)", sb.ID, s.State)
				}
			}
			// A call after the race must not bring it back.
			if _, err := c.Resume(ctx, sb.ID); !client.IsNotFound(err) {
				t.Errorf("resume after the race: err %v, want not_found", err)
			}
			assertGone(t, srv, sb.ID)
		})
	}
}

func mustList(t *testing.T, c *client.Client) []apiv1.Sandbox {
	t.Helper()
	all, err := c.ListSandboxes(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	return all
}

// TestConcurrentSameCallsOneActs: two hibernates of a running sandbox sent at
// once, then two resumes of it: in each pair exactly one call acts and the
// other answers unchanged (decided under the sandbox's lock), and both answer
// the same final state.
func TestConcurrentSameCallsOneActs(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{})
	ctx := ctxFor(t, 3*time.Minute)
	for round := 0; round < 3; round++ {
		var wg sync.WaitGroup
		hib := make([]apiv1.HibernateResponse, 2)
		errs := make([]error, 2)
		for i := range hib {
			wg.Add(1)
			go func() {
				defer wg.Done()
				hib[i], errs[i] = c.HibernateCall(ctx, sb.ID, apiv1.HibernateRequest{})
			}()
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: hibernates: %v, %v", round, errs[0], errs[1])
		}
		if hib[0].Unchanged == hib[1].Unchanged || hib[0].Snapshot == nil || hib[1].Snapshot == nil || hib[0].Snapshot.ID != hib[1].Snapshot.ID {
			t.Fatalf("round %d: two hibernates: unchanged %v and %v, snapshots %v and %v; want one acting, same snapshot",
				round, hib[0].Unchanged, hib[1].Unchanged, hib[0].Snapshot, hib[1].Snapshot)
		}
		res := make([]apiv1.ResumeResponse, 2)
		for i := range res {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res[i], errs[i] = c.ResumeCall(ctx, sb.ID)
			}()
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: resumes: %v, %v", round, errs[0], errs[1])
		}
		if res[0].Unchanged == res[1].Unchanged || res[0].Generation != res[1].Generation || res[0].State != apiv1.StateRunning {
			t.Fatalf("round %d: two resumes: unchanged %v and %v, generations %d and %d; want one acting, same generation",
				round, res[0].Unchanged, res[1].Unchanged, res[0].Generation, res[1].Generation)
		}
	}
}

// TestDeleteRightAfterHibernate deletes sandboxes the moment their hibernate
// answers, while the exited instance is still being removed in the background
// (the hibernate does not wait for runsc delete and the network namespaces):
// the DELETE's answer must mean nothing of the sandbox is left — checked here
// without waiting for the manager's background work. A sandbox hibernated,
// resumed and hibernated again in quick succession (two removals in flight)
// ends the same way, and a server stopped right after a hibernate leaves no
// instance of it behind.
func TestDeleteRightAfterHibernate(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	left := func(id string) []string {
		var out []string
		infos, err := srv.Engine.List(ctx) // not instancesOf: no Manager.Wait
		if err != nil {
			t.Fatalf("engine list: %v", err)
		}
		for _, i := range infos {
			if strings.HasPrefix(i.ID, id+"-") {
				out = append(out, "instance "+i.ID)
			}
		}
		for _, p := range hostProcs(id) {
			out = append(out, "process "+p)
		}
		for _, n := range netnsOf(id) {
			out = append(out, "netns "+n)
		}
		return out
	}

	a := create(t, c, apiv1.CreateSandboxRequest{})
	hibernate(t, c, a.ID)
	if err := c.DeleteSandbox(ctx, a.ID); err != nil {
		t.Fatalf("delete right after hibernate: %v", err)
	}
	if l := left(a.ID); len(l) > 0 {
		t.Errorf("after the DELETE answered, left of %s: %v", a.ID, l)
	}

	b := create(t, c, apiv1.CreateSandboxRequest{})
	hibernate(t, c, b.ID)
	if _, err := c.Resume(ctx, b.ID); err != nil {
		t.Fatalf("resume right after hibernate: %v", err)
	}
	if got := sh(t, c, b.ID, "echo ok"); got != "ok\n" {
		t.Fatalf("exec after the quick resume: %q", got)
	}
	hibernate(t, c, b.ID)
	if err := c.DeleteSandbox(ctx, b.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if l := left(b.ID); len(l) > 0 {
		t.Errorf("after hibernate, resume, hibernate and DELETE, left of %s: %v", b.ID, l)
	}

	d := create(t, c, apiv1.CreateSandboxRequest{})
	hibernate(t, c, d.ID)
	srv.Restart(t)
	c = srv.Client
	if l := left(d.ID); len(l) > 0 {
		t.Errorf("after a restart right after the hibernate, left of %s: %v", d.ID, l)
	}
	if _, err := c.Resume(ctx, d.ID); err != nil {
		t.Fatalf("resume after the restart: %v", err)
	}
	if got := sh(t, c, d.ID, "echo ok"); got != "ok\n" {
		t.Fatalf("exec after the restart: %q", got)
	}
}
