package cli

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// TestCreateRefusesZeroLimits: create --memory or --cpus of 0 or less is a
// wrong command line (exit 2, naming the flag) that sends nothing to the
// server; it made a 512 MiB, 1-CPU sandbox in a new-user trial, since 0 went
// as "not given".
func TestCreateRefusesZeroLimits(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		http.Error(w, "not expected", http.StatusTeapot)
	}))
	defer srv.Close()
	for _, c := range []struct{ flag, value string }{
		{"--memory", "0"}, {"--memory", "-5"}, {"--cpus", "0"}, {"--cpus", "-1"},
	} {
		r := runTorpor("create", "--url", srv.URL, c.flag, c.value)
		if r.code != 2 || !strings.Contains(r.stderr, c.flag+" "+c.value) {
			t.Errorf("create %s %s: %+v, want exit 2 naming the flag", c.flag, c.value, r)
		}
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("the refused creates sent %d requests", n)
	}
}
