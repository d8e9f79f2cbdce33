package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/local"
)

// torpor snapshot ls|inspect|verify|rm talk to the server by default; --data-dir
// reads a store directly; create and set send expires_at.
func TestSnapshotCommands(t *testing.T) {
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	parent := "snap-0"
	snap := apiv1.Snapshot{ID: "snap-a", SandboxID: "sbx-1", Bytes: 200 << 20, LogicalBytes: 200 << 20, StoredBytes: 50 << 20,
		NewBytes: 10 << 20, DedupRatio: 4, Durable: true, Parent: &parent, ExpiresAt: &exp, Engine: "gvisor"}
	bodies := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies[r.Method+" "+r.URL.Path] = string(b)
		w.Header().Set("Content-Type", "application/json")
		errBody := func(status int, code, msg string) {
			w.WriteHeader(status)
			json.NewEncoder(w).Encode(apiv1.ErrorBody{Error: apiv1.ErrorDetail{Code: code, Message: msg}})
		}
		switch r.Method + " " + r.URL.Path {
		case "GET /v1/snapshots":
			json.NewEncoder(w).Encode(apiv1.ListSnapshotsResponse{Snapshots: []apiv1.Snapshot{snap}})
		case "GET /v1/snapshots/snap-a":
			json.NewEncoder(w).Encode(snap)
		case "POST /v1/snapshots/snap-a/verify":
			json.NewEncoder(w).Encode(apiv1.VerifySnapshotResponse{OK: true, Files: 3, Bytes: 200 << 20})
		case "POST /v1/snapshots/snap-bad/verify":
			errBody(422, apiv1.CodeSnapshotCorrupt, "snapshot snap-bad: file pages.img: sha256 mismatch")
		case "DELETE /v1/snapshots/snap-a":
			errBody(409, apiv1.CodeConflict, "snapshot snap-a is in use: sandbox sbx-1 resumes from it")
		case "DELETE /v1/snapshots/snap-old":
			w.WriteHeader(http.StatusNoContent)
		case "GET /v1/store":
			json.NewEncoder(w).Encode(apiv1.StoreUsage{Kind: "s3", Snapshots: 3, LogicalBytes: 600 << 20, StoredBytes: 150 << 20,
				DedupRatio: 4, ChunkBytes: 140 << 20, Chunks: 9000, Packs: 20, PendingUploadBytes: 5 << 20, LocalBytes: 300 << 20})
		default:
			json.NewEncoder(w).Encode(apiv1.Sandbox{ID: "sbx-1", State: apiv1.StateRunning, ExpiresAt: &exp,
				Hibernation: apiv1.Hibernation{Mode: "memory"}})
		}
	}))
	defer srv.Close()
	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := Run(context.Background(), append([]string{"--url", srv.URL}, args...), strings.NewReader(""), &out, &errb)
		return code, out.String(), errb.String()
	}
	must := func(args ...string) string {
		t.Helper()
		code, out, errb := run(args...)
		if code != 0 {
			t.Fatalf("torpor %v: exit %d: %s", args, code, errb)
		}
		return out
	}

	out := must("snapshot", "ls")
	for _, w := range []string{"snap-a", "sbx-1", "200.0 MiB", "50.0 MiB", "10.0 MiB", "4.00x", "snap-0", "true", "2030-01-02T03:04:05Z"} {
		if !strings.Contains(out, w) {
			t.Errorf("snapshot ls lacks %q:\n%s", w, out)
		}
	}
	var got apiv1.Snapshot
	if err := json.Unmarshal([]byte(must("snapshot", "inspect", "snap-a")), &got); err != nil || got.StoredBytes != 50<<20 || got.NewBytes != 10<<20 {
		t.Errorf("snapshot inspect: %+v %v", got, err)
	}
	if out := must("snapshot", "verify", "snap-a"); out != "snap-a ok: 3 files, 200.0 MiB verified\n" {
		t.Errorf("snapshot verify: %q", out)
	}
	if code, _, errb := run("snapshot", "verify", "snap-bad"); code == 0 || !strings.Contains(errb, "pages.img") {
		t.Errorf("verify of a corrupt snapshot: exit %d, stderr %q", code, errb)
	}
	if code, _, errb := run("snapshot", "rm", "snap-a"); code == 0 || !strings.Contains(errb, "in use") {
		t.Errorf("rm of a snapshot in use: exit %d, stderr %q", code, errb)
	}
	if out := must("snapshot", "rm", "snap-old"); out != "deleted snap-old\n" {
		t.Errorf("snapshot rm: %q", out)
	}
	out = must("snapshot", "usage")
	for _, w := range []string{"s3", "600.0 MiB", "150.0 MiB", "4.00x", "9000 (140.0 MiB)", "20", "5.0 MiB", "300.0 MiB"} {
		if !strings.Contains(out, w) {
			t.Errorf("snapshot usage lacks %q:\n%s", w, out)
		}
	}
	var u apiv1.StoreUsage
	if err := json.Unmarshal([]byte(must("snapshot", "usage", "--json")), &u); err != nil || u.Packs != 20 || u.PendingUploadBytes != 5<<20 {
		t.Errorf("snapshot usage --json: %+v %v", u, err)
	}
	// --data-dir: the offline mode reads the directory (an empty store here) and
	// never calls the server.
	delete(bodies, "GET /v1/snapshots")
	delete(bodies, "GET /v1/store")
	empty := t.TempDir()
	for name, content := range map[string]string{"torpor.db": "", "store": "chunked\n"} {
		if err := os.WriteFile(filepath.Join(empty, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if out := must("snapshot", "ls", "--data-dir", empty); !strings.HasPrefix(out, "ID") || strings.Contains(out, "snap-a") {
		t.Errorf("offline ls of an empty data dir: %q", out)
	}
	if out := strings.TrimSpace(must("snapshot", "ls", "--json", "--data-dir", empty)); out != "[]" {
		t.Errorf("offline ls --json of an empty data dir: %q", out)
	}
	if code, out, _ := run("snapshot", "verify", "--json", "--data-dir", empty, "snap-none"); code == 0 {
		t.Errorf("offline verify of a missing snapshot: exit 0, %q", out)
	}
	// Offline verify --json answers as POST /v1/snapshots/{id}/verify does.
	plain := t.TempDir()
	for name, content := range map[string]string{"torpor.db": "", "store": "plain\n"} {
		if err := os.WriteFile(filepath.Join(plain, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ls, err := local.New(filepath.Join(plain, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	staged, err := ls.Stage(context.Background(), "snap-p")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staged, "pages.img"), bytes.Repeat([]byte("p"), 5000), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ls.Commit(context.Background(), "snap-p", snapshot.Manifest{ID: "snap-p", SandboxID: "sbx-p"}); err != nil {
		t.Fatal(err)
	}
	var vr apiv1.VerifySnapshotResponse
	out = must("snapshot", "verify", "--json", "--data-dir", plain, "snap-p")
	if err := json.Unmarshal([]byte(out), &vr); err != nil || vr != (apiv1.VerifySnapshotResponse{OK: true, Files: 1, Bytes: 5000}) {
		t.Errorf("offline verify --json: %q %v", out, err)
	}
	if out := must("snapshot", "usage", "--data-dir", empty); !strings.Contains(out, "chunked") || !strings.Contains(out, "snapshots       0") {
		t.Errorf("offline usage of an empty data dir: %q", out)
	}
	// An unreachable S3 endpoint is named as such, not taken for the server.
	s3dir := t.TempDir()
	for name, content := range map[string]string{"torpor.db": "", "store": "s3\nbucket=bkt\nprefix=\n"} {
		if err := os.WriteFile(filepath.Join(s3dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	code, _, errb := run("snapshot", "ls", "--data-dir", s3dir, "--s3-endpoint", "http://127.0.0.1:1", "--s3-bucket", "bkt",
		"--s3-access-key", "k", "--s3-secret-key", "s")
	if code == 0 || strings.Contains(errb, "torpor server") || !strings.Contains(errb, "127.0.0.1:1") {
		t.Errorf("offline ls with S3 unreachable: exit %d, stderr %q", code, errb)
	}
	// A data directory without a store (never served) is refused and left as
	// it was: opening it would create a store a later server could not place.
	bare := t.TempDir()
	if err := os.WriteFile(filepath.Join(bare, "torpor.db"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range [][]string{{"snapshot", "usage", "--data-dir", bare}, {"snapshot", "ls", "--data-dir", bare, "--store", "plain"}} {
		if code, _, errb := run(cmd...); code == 0 || !strings.Contains(errb, "no snapshot store yet") {
			t.Errorf("%v: exit %d, stderr %q", cmd, code, errb)
		}
	}
	if ents, _ := os.ReadDir(bare); len(ents) != 1 {
		t.Errorf("offline commands on a data dir without a store changed it: %v", ents)
	}
	if _, ok := bodies["GET /v1/store"]; ok {
		t.Error("offline usage called the server")
	}
	// A directory that is not a data directory (a typo) is refused, not created.
	typo := filepath.Join(t.TempDir(), "typo")
	if code, _, errb := run("snapshot", "ls", "--data-dir", typo); code == 0 || !strings.Contains(errb, "not a torpor data directory") {
		t.Errorf("offline ls of a missing directory: exit %d, stderr %q", code, errb)
	}
	if _, err := os.Stat(typo); err == nil {
		t.Errorf("offline ls created %s", typo)
	}
	if _, ok := bodies["GET /v1/snapshots"]; ok {
		t.Error("offline ls called the server")
	}
	if code, _, _ := run("snapshot", "rm", "snap-old", "--data-dir", t.TempDir()); code != 2 {
		t.Errorf("offline rm: exit %d, want 2 (usage)", code)
	}

	// Retention flags.
	must("create", "--expires-at", "2030-01-02T03:04:05Z")
	var cr apiv1.CreateSandboxRequest
	if err := json.Unmarshal([]byte(bodies["POST /v1/sandboxes"]), &cr); err != nil || cr.ExpiresAt == nil || !cr.ExpiresAt.Equal(exp) {
		t.Errorf("create --expires-at sent %s", bodies["POST /v1/sandboxes"])
	}
	if out := must("set", "sbx-1", "--expires-at", "never"); !strings.Contains(out, "expires_at 2030-01-02T03:04:05Z") {
		t.Errorf("set output %q", out)
	}
	if b := strings.TrimSpace(bodies["PATCH /v1/sandboxes/sbx-1"]); b != `{"expires_at":null}` {
		t.Errorf("set --expires-at never sent %s", b)
	}
	must("set", "sbx-1", "--expires-at", "2030-01-02T03:04:05Z")
	if b := strings.TrimSpace(bodies["PATCH /v1/sandboxes/sbx-1"]); b != `{"expires_at":"2030-01-02T03:04:05Z"}` {
		t.Errorf("set --expires-at TIME sent %s", b)
	}
	if code, _, _ := run("set", "sbx-1", "--expires-at", "tomorrow"); code != 2 {
		t.Errorf("set --expires-at tomorrow: exit %d, want 2", code)
	}
}
