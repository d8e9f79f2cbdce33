package manager_test

import (
	"bytes"
	"context"
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
	resp, err := m.EnvdRoundTrip(id, req)
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
