package client

import (
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
)

// TestIdempotentRetry: CreateSandbox and Fork send an Idempotency-Key and,
// when the answer is lost (the connection closed without one, a body cut
// short), send the call again with the same key; an answer that arrived (an
// error) is not retried; a key from the context is the one sent.
func TestIdempotentRetry(t *testing.T) {
	f, c := newFake(t)
	var mu sync.Mutex
	keys := map[string][]string{}
	cut := map[string]int{} // path -> answers still to cut
	lose := func(w http.ResponseWriter, half bool) {
		if half { // a body cut short
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(201)
			w.Write([]byte(`{"id":"sbx-`))
		}
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Fatal(err)
		}
		conn.Close()
	}
	handle := func(path string, answer func(w http.ResponseWriter)) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			keys[path] = append(keys[path], r.Header.Get(apiv1.IdempotencyKeyHeader))
			n := cut[path]
			cut[path]--
			mu.Unlock()
			if n > 0 {
				lose(w, n == 1)
				return
			}
			answer(w)
		}
	}
	f.handlers["POST /v1/sandboxes"] = handle("/v1/sandboxes", func(w http.ResponseWriter) {
		writeJSON(w, 201, apiv1.Sandbox{ID: "sbx-aaaaaaaaaaaa"})
	})
	f.handlers["POST /v1/sandboxes/sbx-src/fork"] = handle("/v1/sandboxes/sbx-src/fork", func(w http.ResponseWriter) {
		writeJSON(w, 201, apiv1.ForkResponse{Sandboxes: []apiv1.Sandbox{{ID: "sbx-bbbbbbbbbbbb"}}})
	})
	ctx := context.Background()

	cut["/v1/sandboxes"] = 2
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{})
	if err != nil || sb.ID != "sbx-aaaaaaaaaaaa" {
		t.Fatalf("create after two lost answers: %+v %v", sb, err)
	}
	if k := keys["/v1/sandboxes"]; len(k) != 3 || k[0] == "" || k[1] != k[0] || k[2] != k[0] {
		t.Errorf("keys sent by the create's attempts: %q, want three times the same key", k)
	}
	if _, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	if k := keys["/v1/sandboxes"]; len(k) != 4 || k[3] == k[0] {
		t.Errorf("a second create sent key %q, want a new one", k[len(k)-1])
	}

	cut["/v1/sandboxes/sbx-src/fork"] = 1
	kctx := WithIdempotencyKey(ctx, "my-key-1")
	clones, err := c.Fork(kctx, "sbx-src", 1)
	if err != nil || len(clones) != 1 {
		t.Fatalf("fork after a lost answer: %+v %v", clones, err)
	}
	if k := keys["/v1/sandboxes/sbx-src/fork"]; strings.Join(k, ",") != "my-key-1,my-key-1" {
		t.Errorf("fork keys %q, want my-key-1 twice", k)
	}

	// An answer that arrived is not retried; Retries bounds the attempts.
	calls := 0
	f.handlers["POST /v1/sandboxes"] = func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.Header().Set("Retry-After", "5")
		writeErr(w, 503, apiv1.CodeUnavailable, "host memory full")
	}
	if _, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{}); err == nil || calls != 1 {
		t.Errorf("create answered 503: %v after %d calls, want the error after 1", err, calls)
	}
	calls = 0
	f.handlers["POST /v1/sandboxes"] = func(w http.ResponseWriter, r *http.Request) { calls++; lose(w, false) }
	c.Retries = 2
	t0 := time.Now()
	// net/http may itself resend a request with an Idempotency-Key once on a
	// reused connection, so 3 attempts reach the server 3 to 6 times.
	if _, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{}); err == nil || calls < 3 || calls > 6 {
		t.Errorf("create whose answers are all lost: %v after %d calls, want an error after 3 attempts", err, calls)
	}
	if d := time.Since(t0); d < 700*time.Millisecond {
		t.Errorf("two retries took %v, want the 250+500 ms waits", d)
	}
	// No server at all: refused at once, not retried.
	gone := New("http://" + f.srv.Listener.Addr().String())
	f.srv.Close()
	t0 = time.Now()
	if _, err := gone.CreateSandbox(ctx, apiv1.CreateSandboxRequest{}); err == nil || time.Since(t0) > 200*time.Millisecond {
		t.Errorf("create with no server: %v after %v, want a refusal at once", err, time.Since(t0))
	}
}

// TestTrustCA: a client trusts an https server whose certificate is in the
// file TORPOR_CA_CERT names, and fails every request (naming the file) when
// the file is not a certificate; without it the server's self-signed
// certificate is refused.
func TestTrustCA(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, map[string]bool{"ok": true})
	}))
	defer srv.Close()
	ctx := context.Background()
	t.Setenv(CACertEnv, "")
	if err := New(srv.URL).Health(ctx); err == nil {
		t.Error("a self-signed certificate was trusted without TORPOR_CA_CERT")
	}
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(CACertEnv, ca)
	if err := New(srv.URL).Health(ctx); err != nil {
		t.Errorf("with TORPOR_CA_CERT: %v", err)
	}
	bad := filepath.Join(t.TempDir(), "bad.pem")
	os.WriteFile(bad, []byte("not a certificate"), 0o644)
	t.Setenv(CACertEnv, bad)
	if err := New(srv.URL).Health(ctx); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("with a bad TORPOR_CA_CERT: %v, want an error naming %s", err, bad)
	}
}
