package e2e

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	_ "modernc.org/sqlite" // the server's database, rewritten as an old server left it

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
)

// TestSnapshotOfAnotherRunscVersion: a snapshot taken by another runsc version
// (as it looks after a runsc upgrade: its manifest and its database record
// name the old version) is refused before runsc sees it — resume, exec and
// fork answer 409 conflict "snapshot <id> was taken by runsc <old>, this host
// runs runsc <new>" — and the sandbox stays hibernated; with the record back
// as this host wrote it, the sandbox resumes with its files (docs/upgrades.md).
func TestSnapshotOfAnotherRunscVersion(t *testing.T) {
	srv := start(t, servertest.Options{Store: server.StoreConfig{Kind: "plain"}})
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	writeFile(t, c, sb.ID, "/root/kept", []byte("kept across the upgrade"))
	h := hibernate(t, c, sb.ID)
	snap := h.Snapshot.ID
	current := srv.Engine.Version()
	const old = "runsc v0.0.0-20240101000000-000000000000"

	manifest := filepath.Join(srv.DataDir, "snapshots", snap, "manifest.json")
	orig, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	var origRecord string
	setVersion := func(version, record string) {
		t.Helper()
		dec := json.NewDecoder(bytes.NewReader(orig))
		dec.UseNumber()
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			t.Fatal(err)
		}
		if m["engine_version"] != current {
			t.Fatalf("manifest records engine_version %v, want this host's %q", m["engine_version"], current)
		}
		m["engine_version"] = version
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if version == current {
			b = orig
		}
		if err := os.WriteFile(manifest, b, 0o644); err != nil {
			t.Fatal(err)
		}
		// The record is rewritten in the database file itself, as an older
		// server would have left it (the metadata interface has no call
		// that changes a snapshot's engine, on purpose).
		db, err := sql.Open("sqlite", filepath.Join(srv.DataDir, "torpor.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if origRecord == "" {
			if err := db.QueryRowContext(context.Background(), `SELECT engine FROM snapshots WHERE id = ?`, snap).Scan(&origRecord); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := db.Exec(`UPDATE snapshots SET engine = ? WHERE id = ?`, record, snap); err != nil {
			t.Fatal(err)
		}
	}
	setVersion(old, "gvisor "+old)
	srv.Restart(t) // the upgrade: a new server (with the same runsc here)
	c = srv.Client

	want := "snapshot " + snap + " was taken by " + old + ", this host runs " + current
	for _, call := range []struct{ what, method, path, body string }{
		{"resume", http.MethodPost, "/resume", ""},
		{"exec", http.MethodPost, "/exec", `{"cmd":["true"]}`},
		{"fork", http.MethodPost, "/fork", `{"count":1}`},
	} {
		var body []byte
		if call.body != "" {
			body = []byte(call.body)
		}
		res := rawCall(t, call.method, srv.URL+"/v1/sandboxes/"+sb.ID+call.path, "application/json", body)
		if res.Status != http.StatusConflict || res.Err.Code != apiv1.CodeConflict || !strings.Contains(res.Err.Message, want) {
			t.Errorf("%s of an older runsc's snapshot: HTTP %d %s %q, want 409 conflict saying %q", call.what, res.Status, res.Err.Code, res.Err.Message, want)
		}
	}
	after := wantState(t, c, sb.ID, apiv1.StateHibernated)
	if after.Error != "" || after.Snapshot == nil || after.Snapshot.ID != snap {
		t.Fatalf("after the refusals: error %q, snapshot %v; want none and %s", after.Error, after.Snapshot, snap)
	}
	if _, all, _ := instancesOf(t, srv, sb.ID); len(all) != 0 {
		t.Fatalf("engine instances of %s after the refusals: %v, want none", sb.ID, all)
	}

	setVersion(current, origRecord)
	if _, err := c.Resume(ctxFor(t, 2*time.Minute), sb.ID); err != nil {
		t.Fatalf("resume with the snapshot's record back: %v", err)
	}
	if got := string(readFile(t, c, sb.ID, "/root/kept")); got != "kept across the upgrade" {
		t.Fatalf("/root/kept after the resume: %q", got)
	}
}
