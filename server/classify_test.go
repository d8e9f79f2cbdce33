package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
)

// TestClassifyStoreErrors: a store whose S3 prefix is another store's answers
// 409 conflict (it answered 500 internal in a new-user trial); an unreachable
// S3 answers 503; a full disk 507.
func TestClassifyStoreErrors(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
	}{
		{fmt.Errorf("delete snap-x: s3 delete manifests/snap-x.json: %w", chunked.ErrOwnedElsewhere), http.StatusConflict},
		{fmt.Errorf("s3 list: %w", snapshot.ErrUnavailable), http.StatusServiceUnavailable},
		{fmt.Errorf("boom"), http.StatusInternalServerError},
		// A full data directory disk (docs/operations.md#a-full-disk): 507,
		// whether the manager said so or the write's own error does.
		{&sandbox.Error{Kind: sandbox.InsufficientStorage, Err: fmt.Errorf("the data directory's disk is full")}, http.StatusInsufficientStorage},
		{fmt.Errorf("import: %w", &os.PathError{Op: "write", Path: "/d/images/x", Err: syscall.ENOSPC}), http.StatusInsufficientStorage},
		{fmt.Errorf("metadata: update sandbox sbx-1: database or disk is full (13)"), http.StatusInsufficientStorage},
		// A record another node deleted, or changed under every retry.
		{fmt.Errorf("sandbox sbx-1: %w", metadata.ErrNotFound), http.StatusNotFound},
		{fmt.Errorf("sandbox sbx-1 version 4 (stored: 5): %w", metadata.ErrStale), http.StatusConflict},
	} {
		if got, _ := classify(c.err); got != c.status {
			t.Errorf("classify(%v) = %d, want %d", c.err, got, c.status)
		}
	}
}

// TestPortProxyNoAnswer: a port-proxy request whose server in the sandbox
// closed the connection without answering is 502 bad_gateway (a new-user
// trial got 500 internal "EOF") and is logged.
func TestPortProxyNoAnswer(t *testing.T) {
	var logs bytes.Buffer
	s := &Server{log: slog.New(slog.NewTextHandler(&logs, nil))}
	rec := httptest.NewRecorder()
	s.failPortProxy(rec, httptest.NewRequest(http.MethodGet, "/v1/sandboxes/sbx-1/ports/8002/reset", nil), fmt.Errorf("%w (%w)", ingress.ErrNoAnswer, io.EOF))
	var body apiv1.ErrorBody
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusBadGateway || body.Error.Code != apiv1.CodeBadGateway {
		t.Fatalf("answer %d %s (%v), want 502 bad_gateway", rec.Code, rec.Body.String(), err)
	}
	if !strings.Contains(logs.String(), "without answering") {
		t.Errorf("not logged: %q", logs.String())
	}
}

// TestDecodeNamesTimeField: a create body whose expires_at is not an RFC 3339
// time string is a 400 naming expires_at and the form wanted (a new-user
// trial got time's own message, which names no field).
func TestDecodeNamesTimeField(t *testing.T) {
	for _, body := range []string{`{"expires_at":"yesterday"}`, `{"expires_at":12345}`, `{"image":"base","Expires_At":true}`} {
		var req apiv1.CreateSandboxRequest
		err := decode(httptest.NewRequest(http.MethodPost, "/v1/sandboxes", strings.NewReader(body)), &req, true)
		status, _ := classify(err)
		if err == nil || status != http.StatusBadRequest || !strings.Contains(err.Error(), "expires_at") || !strings.Contains(err.Error(), "RFC 3339") {
			t.Errorf("%s: %d %v, want 400 naming expires_at and RFC 3339", body, status, err)
		}
	}
	var req apiv1.CreateSandboxRequest
	if err := decode(httptest.NewRequest(http.MethodPost, "/v1/sandboxes", strings.NewReader(`{"expires_at":"2030-01-02T03:04:05Z"}`)), &req, true); err != nil || req.ExpiresAt == nil {
		t.Errorf("a good expires_at: %v", err)
	}
}

// TestDenyKeyStoreDown: a key that cannot be checked (the database does
// not answer) is 503 unavailable with Retry-After, the remedy being a
// retry.
func TestDenyKeyStoreDown(t *testing.T) {
	s := &Server{log: defaultLogger()}
	w := httptest.NewRecorder()
	s.denyKey(w, httptest.NewRequest(http.MethodGet, "/v1/sandboxes", nil), errors.New("apikey: verify: connection refused"))
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "5" || !strings.Contains(w.Body.String(), "retry") {
		t.Errorf("key store down: %d Retry-After %q %s; want 503 with Retry-After 5", w.Code, w.Header().Get("Retry-After"), w.Body)
	}
}
