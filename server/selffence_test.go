package server

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// fakeLocker answers KeepServerLock with its next answer.
type fakeLocker struct {
	answers []fakeLock
}

type fakeLock struct {
	retaken bool
	err     error
}

func (l *fakeLocker) KeepServerLock(context.Context) (bool, error) {
	a := l.answers[0]
	l.answers = l.answers[1:]
	return a.retaken, a.err
}

// TestNodeLockRefuses: a node that finds its node lock's session gone and
// cannot take the lock again refuses calls about sandboxes (503,
// Retry-After, naming the cause and since when), and /healthz answers 503
// with the same reason, until a check takes the lock again; a lock held all
// along changes nothing (/healthz 200).
func TestNodeLockRefuses(t *testing.T) {
	gone := errors.New("metadata: server lock: connect: connection refused")
	l := &fakeLocker{answers: []fakeLock{{false, nil}, {false, gone}, {false, gone}, {true, nil}}}
	s := &Server{locker: l, node: "node-a", log: defaultLogger()}
	call := func(path string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		if !s.refuseFenced(w, httptest.NewRequest("GET", path, nil)) {
			w.Code = 0 // served
		}
		return w
	}
	now := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	for i, want := range []string{"", "node node-a does not hold its node lock in the database since 2026-12-02T01:00:01Z",
		"node node-a does not hold its node lock in the database since 2026-12-02T01:00:01Z", ""} {
		err := s.keepNodeLock(context.Background(), now.Add(time.Duration(i)*time.Second))
		if (err != nil) != (want != "") {
			t.Errorf("check %d: %v", i, err)
		}
		w := call("/v1/sandboxes/sbx-1")
		hw := httptest.NewRecorder()
		s.healthz(hw, httptest.NewRequest("GET", "/healthz", nil))
		if want == "" {
			if w.Code != 0 {
				t.Errorf("check %d: a sandbox call answered %d %s; want served", i, w.Code, w.Body)
			}
			if hw.Code != http.StatusOK {
				t.Errorf("check %d: /healthz answered %d %s; want 200", i, hw.Code, hw.Body)
			}
			continue
		}
		if hw.Code != http.StatusServiceUnavailable || hw.Header().Get("Retry-After") != "5" || !strings.Contains(hw.Body.String(), want) {
			t.Errorf("check %d: /healthz answered %d %q %s; want 503 with %q", i, hw.Code, hw.Header().Get("Retry-After"), hw.Body, want)
		}
		if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "5" ||
			!strings.Contains(w.Body.String(), want) ||
			!strings.Contains(w.Body.String(), "connection refused") {
			t.Errorf("check %d: a sandbox call answered %d %q %s; want 503 with %q and the cause", i, w.Code, w.Header().Get("Retry-After"), w.Body, want)
		}
	}
}
