package server

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// fakeServer is a server on the in-memory engine (engine/fake: no root, no
// runsc) behind an httptest server, with image "tiny" (64 MiB sandboxes).
type fakeServer struct {
	srv *Server
	url string
}

func startFakeServer(t *testing.T, limits manager.LimitsConfig) *fakeServer {
	t.Helper()
	srv, url, _, _ := StartFake(t, Config{Limits: limits, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	return &fakeServer{srv: srv, url: url}
}

// post sends body to path with Idempotency-Key key ("" = none) and returns
// the status, the Retry-After header and the body.
func (f *fakeServer) post(t *testing.T, path, key, body string) (int, string, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, f.url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(apiv1.IdempotencyKeyHeader, key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Retry-After"), b
}

// ids returns the ids of the sandboxes the server has, sorted.
func (f *fakeServer) ids(t *testing.T) []string {
	t.Helper()
	all, err := f.srv.Manager.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range all {
		out = append(out, s.ID)
	}
	sort.Strings(out)
	return out
}

func sandboxOf(t *testing.T, b []byte) apiv1.Sandbox {
	t.Helper()
	var sb apiv1.Sandbox
	if err := json.Unmarshal(b, &sb); err != nil || sb.ID == "" {
		t.Fatalf("not a sandbox: %s (%v)", b, err)
	}
	return sb
}

func forkIDs(t *testing.T, b []byte) []string {
	t.Helper()
	var fr apiv1.ForkResponse
	if err := json.Unmarshal(b, &fr); err != nil {
		t.Fatalf("not a fork answer: %s (%v)", b, err)
	}
	var out []string
	for _, s := range fr.Sandboxes {
		out = append(out, s.ID)
	}
	return out
}

const tinyCreate = `{"image":"tiny","memory_mib":64}`

// TestIdempotentCreateAndFork: a create or fork sent again with its key gets
// the first call's sandboxes and status, never a second set; concurrent
// calls with one key make one set; the key with another body is 422; a
// malformed key is 400; without a key every call makes its own.
func TestIdempotentCreateAndFork(t *testing.T) {
	f := startFakeServer(t, manager.LimitsConfig{})
	st, _, b := f.post(t, "/v1/sandboxes", "create-1", tinyCreate)
	if st != http.StatusCreated {
		t.Fatalf("create: %d %s", st, b)
	}
	first := sandboxOf(t, b)
	st, _, b = f.post(t, "/v1/sandboxes", "create-1", tinyCreate)
	if again := sandboxOf(t, b); st != http.StatusCreated || again.ID != first.ID || again.State != apiv1.StateRunning {
		t.Errorf("retry: %d %s, want 201 with %s", st, b, first.ID)
	}
	if got := f.ids(t); len(got) != 1 {
		t.Errorf("sandboxes after a retried create: %v, want 1", got)
	}
	st, _, b = f.post(t, "/v1/sandboxes", "create-1", `{"image":"tiny","memory_mib":128}`)
	if st != http.StatusUnprocessableEntity || !strings.Contains(string(b), apiv1.CodeIdempotencyReuse) {
		t.Errorf("same key, another body: %d %s, want 422 %s", st, b, apiv1.CodeIdempotencyReuse)
	}
	if st, _, b = f.post(t, "/v1/sandboxes/"+first.ID+"/fork", "create-1", `{"count":1}`); st != http.StatusUnprocessableEntity {
		t.Errorf("same key on another path: %d %s, want 422", st, b)
	}
	if idempotencyKeyProblem("bad\x01key") == "" || idempotencyKeyProblem("") == "" || idempotencyKeyProblem("a b~") != "" {
		t.Error("idempotencyKeyProblem: control characters or an empty key accepted, or printable ASCII refused")
	}
	if p := idempotencyKeyProblem("clé"); p != "want printable ASCII characters only (a UUID or hex digits), byte 2 is 0xc3" {
		t.Errorf("idempotencyKeyProblem of a non-ASCII key: %q", p)
	}
	if st, _, b = f.post(t, "/v1/sandboxes", strings.Repeat("k", 256), tinyCreate); st != http.StatusBadRequest {
		t.Errorf("malformed key: %d %s, want 400", st, b)
	}

	// Concurrent calls with one key: one sandbox, every answer names it.
	const n = 5
	var wg sync.WaitGroup
	got := make([]string, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, _, b := f.post(t, "/v1/sandboxes", "create-2", tinyCreate)
			if st == http.StatusCreated {
				got[i] = sandboxOf(t, b).ID
			} else {
				t.Errorf("concurrent create %d: %d %s", i, st, b)
			}
		}()
	}
	wg.Wait()
	for _, id := range got {
		if id != got[0] {
			t.Errorf("concurrent creates with one key answered %v, want one id", got)
			break
		}
	}
	if all := f.ids(t); len(all) != 2 {
		t.Errorf("sandboxes after concurrent creates with one key: %v, want 2", all)
	}

	// Fork: a retry gets the same clones.
	st, _, b = f.post(t, "/v1/sandboxes/"+first.ID+"/fork", "fork-1", `{"count":2}`)
	clones := forkIDs(t, b)
	if st != http.StatusCreated || len(clones) != 2 {
		t.Fatalf("fork: %d %s", st, b)
	}
	st, _, b = f.post(t, "/v1/sandboxes/"+first.ID+"/fork", "fork-1", `{"count":2}`)
	if again := forkIDs(t, b); st != http.StatusCreated || fmt.Sprint(again) != fmt.Sprint(clones) {
		t.Errorf("fork retry: %d %v, want 201 %v", st, again, clones)
	}
	if all := f.ids(t); len(all) != 4 {
		t.Errorf("sandboxes after a retried fork: %v, want 4", all)
	}
	// Without a key, each call makes its own.
	f.post(t, "/v1/sandboxes", "", tinyCreate)
	f.post(t, "/v1/sandboxes", "", tinyCreate)
	if all := f.ids(t); len(all) != 6 {
		t.Errorf("sandboxes after two creates without a key: %v, want 6", all)
	}
	// A sandbox deleted since: the retry says so rather than make another.
	if err := f.srv.Manager.Delete(context.Background(), first.ID); err != nil {
		t.Fatal(err)
	}
	if st, _, b = f.post(t, "/v1/sandboxes", "create-1", tinyCreate); st != http.StatusConflict || !strings.Contains(string(b), first.ID) {
		t.Errorf("retry after the sandbox was deleted: %d %s, want 409 naming %s", st, b, first.ID)
	}
}

// TestIdempotentAfterCrash: a record without a status (a crash cut the
// call) answers the sandboxes the call made; when it made none, the retry
// makes them with the recorded ids; records older than a day expire.
func TestIdempotentAfterCrash(t *testing.T) {
	f := startFakeServer(t, manager.LimitsConfig{})
	ctx := context.Background()
	hash := func(path, body string) []byte {
		h := sha256.New()
		fmt.Fprintf(h, "POST %s\n", path)
		h.Write([]byte(body))
		return h.Sum(nil)
	}
	cut := manager.NewSandboxID()
	if _, _, err := f.srv.db.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "cut-before", RequestHash: hash("/v1/sandboxes", tinyCreate),
		SandboxIDs: []string{cut}, CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	st, _, b := f.post(t, "/v1/sandboxes", "cut-before", tinyCreate)
	if sb := sandboxOf(t, b); st != http.StatusCreated || sb.ID != cut {
		t.Errorf("retry of a call cut before it made anything: %d %s, want 201 with the recorded id %s", st, b, cut)
	}
	made, err := f.srv.Manager.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.srv.db.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "cut-after", RequestHash: hash("/v1/sandboxes", tinyCreate),
		SandboxIDs: []string{made.ID}, CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	before := f.ids(t)
	st, _, b = f.post(t, "/v1/sandboxes", "cut-after", tinyCreate)
	if sb := sandboxOf(t, b); st != http.StatusCreated || sb.ID != made.ID || len(f.ids(t)) != len(before) {
		t.Errorf("retry of a call cut after it made its sandbox: %d %s (sandboxes %v), want 201 with %s and nothing new", st, b, f.ids(t), made.ID)
	}
	// Cut while it made its sandbox: the restart left that one in state
	// error. Two retries at once get one working sandbox under the recorded
	// id (the remainder removed and made again), and nothing else is made.
	broken := manager.NewSandboxID()
	now := time.Now().UTC()
	if err := f.srv.db.CreateSandbox(ctx, &metadata.Sandbox{ID: broken, State: sandbox.StateError, Error: "create interrupted by server restart",
		Image: "tiny", MemoryMiB: 64, CPUs: 1, Generation: 99, Seq: 1, CreatedAt: now, StateChangedAt: now}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.srv.db.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "cut-during", RequestHash: hash("/v1/sandboxes", tinyCreate),
		SandboxIDs: []string{broken}, CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	before = f.ids(t)
	var wg sync.WaitGroup
	answers := make([][]byte, 2)
	codes := make([]int, 2)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i], _, answers[i] = f.post(t, "/v1/sandboxes", "cut-during", tinyCreate)
		}()
	}
	wg.Wait()
	for i, b := range answers {
		if sb := sandboxOf(t, b); codes[i] != http.StatusCreated || sb.ID != broken || sb.State != apiv1.StateRunning {
			t.Errorf("retry %d of a create cut while it made its sandbox: %d %s, want 201 with %s running", i, codes[i], b, broken)
		}
	}
	if after := f.ids(t); len(after) != len(before) {
		t.Errorf("sandboxes after the two retries: %v, before %v: want as many (the remainder replaced)", after, before)
	}
	// Expiry: a record older than a day is gone, the key makes a new sandbox.
	if _, _, err := f.srv.db.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "old", RequestHash: hash("/v1/sandboxes", tinyCreate),
		SandboxIDs: []string{made.ID}, Status: 201, CreatedAt: time.Now().Add(-IdempotencyKeyTTL - time.Minute)}); err != nil {
		t.Fatal(err)
	}
	f.srv.idem.expiredAt = time.Time{}
	st, _, b = f.post(t, "/v1/sandboxes", "old", tinyCreate)
	if sb := sandboxOf(t, b); st != http.StatusCreated || sb.ID == made.ID {
		t.Errorf("key older than a day: %d %s, want a new sandbox", st, b)
	}
}

// TestAdmissionAnswers: with room for one 64 MiB sandbox, the next create
// (REST and E2B) and fork are 503 with Retry-After and say the host's
// memory is full; a refused create's key is free again, so the same retry
// succeeds once memory is.
func TestAdmissionAnswers(t *testing.T) {
	f := startFakeServer(t, manager.LimitsConfig{HostMemoryBytes: 100 << 20, RetryAfter: 3 * time.Second})
	st, _, b := f.post(t, "/v1/sandboxes", "", tinyCreate)
	if st != http.StatusCreated {
		t.Fatalf("first create: %d %s", st, b)
	}
	first := sandboxOf(t, b)
	for _, c := range []struct{ path, body string }{
		{"/v1/sandboxes", tinyCreate},
		{"/v1/sandboxes/" + first.ID + "/fork", `{"count":1}`},
		{"/sandboxes", `{"templateID":"tiny"}`}, // E2B
	} {
		st, retry, b := f.post(t, c.path, "full-"+c.path, c.body)
		if st != http.StatusServiceUnavailable || retry != "3" || !strings.Contains(string(b), "host memory full") {
			t.Errorf("POST %s with the host full: %d Retry-After %q %s, want 503, 3 and the reason", c.path, st, retry, b)
		}
	}
	if all := f.ids(t); len(all) != 1 {
		t.Errorf("sandboxes after refused calls: %v, want 1", all)
	}
	if err := f.srv.Manager.Delete(context.Background(), first.ID); err != nil {
		t.Fatal(err)
	}
	if st, _, b := f.post(t, "/v1/sandboxes", "full-/v1/sandboxes", tinyCreate); st != http.StatusCreated {
		t.Errorf("the refused create's retry once memory is free: %d %s, want 201", st, b)
	}
}
