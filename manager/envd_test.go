package manager_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// envdCall sends one envd request through the manager and returns the
// answer's status and body.
func envdCall(t *testing.T, m *manager.Manager, id, method, target string, body []byte) (int, []byte) {
	t.Helper()
	return envdCallWith(t, m, id, method, target, body, nil)
}

// envdCallChecked sends GET /health through the manager with check.
func envdCallChecked(t *testing.T, m *manager.Manager, id string, check func(manager.RequestState) error) (int, []byte) {
	t.Helper()
	return envdCallWith(t, m, id, "GET", "/health", nil, check)
}

func envdCallWith(t *testing.T, m *manager.Manager, id, method, target string, body []byte, check func(manager.RequestState) error) (int, []byte) {
	t.Helper()
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, "http://envd"+target, r)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := m.EnvdRoundTrip(id, req, check)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the answer: %v", method, target, err)
	}
	return resp.StatusCode, b
}

// TestEnvdHibernateAfterBurst: envd requests reuse the agent client's
// connections (fewer dials than requests), and a hibernate right after a
// burst of them returns well within HibernateDrain, as no idle connection
// counts as a request in flight; the sandbox is hibernated, and the next envd
// request resumes it and reads what the burst wrote.
func TestEnvdHibernateAfterBurst(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	id := h.prepare(fromRunning)
	dials := h.eng.Calls(fake.Dial)
	const workers, rounds = 6, 5
	content := func(w int) string { return fmt.Sprintf("written by worker %d\n", w) }
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			file := fmt.Sprintf("/files?username=root&path=/tmp/burst-%d", w)
			for range rounds {
				if st, b := envdCall(t, h.m, id, "POST", file, []byte(content(w))); st != http.StatusOK {
					t.Errorf("POST %s: %d %s", file, st, b)
				}
				if st, b := envdCall(t, h.m, id, "GET", file, nil); st != http.StatusOK || string(b) != content(w) {
					t.Errorf("GET %s: %d %q", file, st, b)
				}
				if st, b := envdCall(t, h.m, id, "GET", "/health", nil); st != http.StatusNoContent {
					t.Errorf("GET /health: %d %s", st, b)
				}
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if n := h.eng.Calls(fake.Dial) - dials; n >= workers*rounds*3 || n == 0 {
		t.Fatalf("%d envd requests made %d dials to the agent: want its connections kept alive (more than 0, fewer than the requests)", workers*rounds*3, n)
	}

	t0 := time.Now()
	if _, err := h.m.Hibernate(ctx, id, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d > manager.HibernateDrain/2 {
		t.Fatalf("hibernate after a burst of envd requests took %v: an idle envd connection held its drain (%v)", d, manager.HibernateDrain)
	}
	if st := h.record(id).State; st != sandbox.StateHibernated {
		t.Fatalf("state %s after the hibernate, want hibernated", st)
	}
	for w := range workers {
		file := fmt.Sprintf("/files?username=root&path=/tmp/burst-%d", w)
		if st, b := envdCall(t, h.m, id, "GET", file, nil); st != http.StatusOK || string(b) != content(w) {
			t.Errorf("GET %s after the hibernate: %d %q", file, st, b)
		}
	}
	if st := h.record(id).State; st != sandbox.StateRunning {
		t.Errorf("state %s after an envd request to the hibernated sandbox, want running (resumed on request)", st)
	}
}

// TestEnvdRoundTripCheck: EnvdRoundTrip's check sees the sandbox's state as
// read under its lock, and its refusal is the call's error, before anything
// else: a hibernated sandbox that resumes on request stays hibernated, and
// nothing reaches its agent.
func TestEnvdRoundTripCheck(t *testing.T) {
	h := newHost(t, hostOpts{})
	id := h.prepare(fromHibernated)
	dials := h.eng.Calls(fake.Dial)
	refused := errors.New("refused by the check")
	var seen []manager.RequestState
	req, err := http.NewRequestWithContext(context.Background(), "GET", "http://envd/health", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.m.EnvdRoundTrip(id, req, func(st manager.RequestState) error {
		seen = append(seen, st)
		return refused
	})
	if err == nil {
		resp.Body.Close()
	}
	if !errors.Is(err, refused) {
		t.Fatalf("EnvdRoundTrip: %v, want the check's error", err)
	}
	if len(seen) != 1 || seen[0].State != sandbox.StateHibernated || !seen[0].ResumeOnRequest {
		t.Fatalf("the check saw %+v, want once a hibernated sandbox that resumes on request", seen)
	}
	if st := h.record(id).State; st != sandbox.StateHibernated {
		t.Fatalf("state %s after a refused envd request, want hibernated (not resumed)", st)
	}
	if n := h.eng.Calls(fake.Dial) - dials; n != 0 {
		t.Fatalf("a refused envd request dialled the agent %d times", n)
	}

	// A check that lets it through: the sandbox resumes and answers.
	seen = nil
	if st, b := envdCallChecked(t, h.m, id, func(st manager.RequestState) error { seen = append(seen, st); return nil }); st != http.StatusNoContent {
		t.Fatalf("GET /health: %d %s", st, b)
	}
	if len(seen) != 1 || seen[0].State != sandbox.StateHibernated {
		t.Fatalf("the check saw %+v, want once the hibernated sandbox", seen)
	}
	if st := h.record(id).State; st != sandbox.StateRunning {
		t.Fatalf("state %s after an envd request let through, want running", st)
	}
}
