package e2e

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
)

// TestSnapshotAPI: GET /v1/snapshots/{id} after a hibernate shows the sizes,
// parent, durability, expiry and dedup ratio; the list has it; DELETE of a
// snapshot a sandbox resumes from is 409; verify is ok, and after one byte of
// pages.img is flipped it is 422 snapshot_corrupt naming the file; deleting the
// sandbox removes its snapshot.
func TestSnapshotAPI(t *testing.T) {
	srv := start(t, servertest.Options{Store: server.StoreConfig{Kind: "plain"}})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if got := get(t, c, sb.ID); got.ExpiresAt != nil {
		t.Errorf("new sandbox expires_at %v, want null (never)", got.ExpiresAt)
	}
	h1 := hibernate(t, c, sb.ID)
	// A sandbox's first snapshot has "parent": null (the next hibernate
	// replaces it).
	if raw := rawCall(t, http.MethodGet, srv.URL+"/v1/snapshots/"+h1.Snapshot.ID, "", nil); !strings.Contains(string(raw.Body), `"parent": null`) {
		t.Errorf("GET /v1/snapshots/%s (a first snapshot) body lacks \"parent\": null: %s", h1.Snapshot.ID, raw.Body)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	h2 := hibernate(t, c, sb.ID)
	id := h2.Snapshot.ID

	snap, err := c.GetSnapshot(ctx, id)
	if err != nil {
		t.Fatalf("GET snapshot %s: %v", id, err)
	}
	t.Logf("snapshot: %+v", snap)
	if snap.ID != id || snap.SandboxID != sb.ID || snap.Bytes <= 0 {
		t.Errorf("snapshot %+v: want id %s, sandbox %s, bytes > 0", snap, id, sb.ID)
	}
	// The plain store: logical = stored = new = bytes, ratio 1.
	if snap.LogicalBytes != snap.Bytes || snap.StoredBytes != snap.Bytes || snap.NewBytes != snap.Bytes || snap.DedupRatio != 1 {
		t.Errorf("sizes logical %d stored %d new %d ratio %g; want all %d, ratio 1", snap.LogicalBytes, snap.StoredBytes,
			snap.NewBytes, snap.DedupRatio, snap.Bytes)
	}
	if snap.Parent == nil || *snap.Parent != h1.Snapshot.ID {
		t.Errorf("parent %v, want the previous snapshot %s", snap.Parent, h1.Snapshot.ID)
	}
	if !snap.Durable || snap.ExpiresAt != nil {
		t.Errorf("durable %v expires_at %v; want true and null", snap.Durable, snap.ExpiresAt)
	}
	if len(snap.UsedBy) != 1 || snap.UsedBy[0] != sb.ID {
		t.Errorf("used_by %v, want [%s]", snap.UsedBy, sb.ID)
	}
	// The raw body has every field, expires_at as null.
	raw := rawCall(t, http.MethodGet, srv.URL+"/v1/snapshots/"+id, "", nil)
	for _, f := range []string{`"logical_bytes"`, `"stored_bytes"`, `"new_bytes"`, `"parent"`, `"durable": true`, `"expires_at": null`, `"dedup_ratio"`} {
		if !strings.Contains(string(raw.Body), f) {
			t.Errorf("GET /v1/snapshots/%s body lacks %s: %s", id, f, raw.Body)
		}
	}
	// The sandbox's view embeds the same snapshot.
	if v := get(t, c, sb.ID); v.Snapshot == nil || v.Snapshot.LogicalBytes != snap.LogicalBytes || !v.Snapshot.Durable {
		t.Errorf("sandbox view snapshot %+v", v.Snapshot)
	}
	list, err := c.ListSnapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range list {
		found = found || s.ID == id
		if s.ID == h1.Snapshot.ID {
			t.Errorf("the replaced snapshot %s is still listed", s.ID)
		}
	}
	if !found {
		t.Errorf("list of %d snapshots lacks %s", len(list), id)
	}

	// In use: 409, and the snapshot stays.
	if err := c.DeleteSnapshot(ctx, id); !client.IsConflict(err) {
		t.Errorf("DELETE of a snapshot in use: %v, want conflict", err)
	}
	if _, err := c.GetSnapshot(ctx, id); err != nil {
		t.Errorf("after the refused delete: %v", err)
	}
	if err := c.DeleteSnapshot(ctx, "snap-doesnotexist"); !client.IsNotFound(err) {
		t.Errorf("DELETE of an unknown snapshot: %v, want not_found", err)
	}

	// Verify: ok, then corrupt.
	vr, err := c.VerifySnapshot(ctx, id)
	if err != nil || !vr.OK {
		t.Fatalf("verify intact snapshot: %+v %v", vr, err)
	}
	flips := corruptMemoryFile(t, srv, id)
	res := rawCall(t, http.MethodPost, srv.URL+"/v1/snapshots/"+id+"/verify", "", nil)
	if res.Status != http.StatusUnprocessableEntity || res.Err.Code != apiv1.CodeSnapshotCorrupt {
		t.Errorf("verify of a corrupt snapshot: HTTP %d %s, want 422 snapshot_corrupt: %s", res.Status, res.Err.Code, res.Body)
	} else if !strings.Contains(res.Err.Message, "pages.img") || !strings.Contains(res.Err.Message, id) {
		t.Errorf("verify message %q does not name %s and pages.img", res.Err.Message, id)
	}
	t.Logf("verify of the corrupt snapshot: %d %s", res.Status, res.Err.Message)
	for _, f := range flips {
		flipByte(t, f.path, f.off) // flip back
	}
	if vr, err := c.VerifySnapshot(ctx, id); err != nil || !vr.OK {
		t.Errorf("verify after restoring the byte: %+v %v", vr, err)
	}

	// Deleting the sandbox deletes its snapshot.
	if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSnapshot(ctx, id); !client.IsNotFound(err) {
		t.Errorf("snapshot of a deleted sandbox: %v, want not_found", err)
	}
}

// TestSnapshotRetention: with the lifecycle loop running, a hibernated sandbox
// whose expires_at has passed is deleted with its snapshot within a few seconds;
// one without expires_at stays; a running sandbox with a past expires_at is not
// deleted until it is hibernated.
func TestSnapshotRetention(t *testing.T) {
	srv := start(t, servertest.Options{Lifecycle: true, LifecycleInterval: 500 * time.Millisecond})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	never := 0
	past := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)

	keep := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
	expiring := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
	// A past expires_at is refused on create (TestBadInput) but may be set by
	// PATCH: that is how a caller has a sandbox deleted once it is hibernated.
	running := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
	if up, err := c.UpdateSandbox(ctx, running.ID, apiv1.UpdateSandboxRequest{ExpiresAt: apiv1.ExpireAt(past)}); err != nil || up.ExpiresAt == nil || !up.ExpiresAt.Equal(past) {
		t.Errorf("PATCH expires_at %v answered %v %v", past, up.ExpiresAt, err)
	}
	hibernate(t, c, keep.ID)
	h := hibernate(t, c, expiring.ID)
	snapID := h.Snapshot.ID

	// PATCH sets a time, then null clears it, then the past time is set.
	future := time.Now().Add(24 * time.Hour).UTC().Truncate(time.Second)
	up, err := c.UpdateSandbox(ctx, expiring.ID, apiv1.UpdateSandboxRequest{ExpiresAt: apiv1.ExpireAt(future)})
	if err != nil || up.ExpiresAt == nil || !up.ExpiresAt.Equal(future) {
		t.Fatalf("PATCH expires_at %v: %v %v", future, up.ExpiresAt, err)
	}
	if s, err := c.GetSnapshot(ctx, snapID); err != nil || s.ExpiresAt == nil || !s.ExpiresAt.Equal(future) {
		t.Errorf("snapshot expires_at after PATCH: %v %v", s.ExpiresAt, err)
	}
	res := rawCall(t, http.MethodPatch, srv.URL+"/v1/sandboxes/"+expiring.ID, "application/json", []byte(`{"expires_at":null}`))
	if res.Status != http.StatusOK || !strings.Contains(string(res.Body), `"expires_at": null`) {
		t.Fatalf("PATCH expires_at null: %d %s", res.Status, res.Body)
	}
	res = rawCall(t, http.MethodPatch, srv.URL+"/v1/sandboxes/"+expiring.ID, "application/json", []byte(`{"expires_at":"soon"}`))
	if res.Status != http.StatusBadRequest {
		t.Errorf("PATCH expires_at \"soon\": %d %s, want 400", res.Status, res.Body)
	}
	// The zero time is refused, not taken for "never".
	res = rawCall(t, http.MethodPatch, srv.URL+"/v1/sandboxes/"+expiring.ID, "application/json", []byte(`{"expires_at":"0001-01-01T00:00:00Z"}`))
	if res.Status != http.StatusBadRequest || !strings.Contains(res.Err.Message, "zero time") {
		t.Errorf("PATCH expires_at 0001-01-01T00:00:00Z: %d %s, want 400 naming the zero time", res.Status, res.Body)
	}
	if _, err := c.UpdateSandbox(ctx, expiring.ID, apiv1.UpdateSandboxRequest{ExpiresAt: apiv1.ExpireAt(past)}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	for {
		_, err := c.GetSandbox(ctx, expiring.ID)
		if client.IsNotFound(err) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Since(t0) > 15*time.Second {
			t.Fatalf("hibernated sandbox %s with expires_at in the past still exists after %v", expiring.ID, time.Since(t0))
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("expired sandbox deleted %v after its expires_at was set in the past", time.Since(t0).Round(time.Millisecond))
	// The record goes first, then its snapshots (the same order as DELETE).
	for t1 := time.Now(); ; time.Sleep(100 * time.Millisecond) {
		_, err := c.GetSnapshot(ctx, snapID)
		if client.IsNotFound(err) {
			break
		}
		if time.Since(t1) > 5*time.Second {
			t.Errorf("snapshot %s of the expired sandbox: %v, want not_found", snapID, err)
			break
		}
	}
	assertGone(t, srv, expiring.ID)

	// A few more ticks: the others are untouched.
	time.Sleep(2 * time.Second)
	if k := wantState(t, c, keep.ID, apiv1.StateHibernated); k.ExpiresAt != nil {
		t.Errorf("kept sandbox expires_at %v", k.ExpiresAt)
	}
	wantState(t, c, running.ID, apiv1.StateRunning)
	if out := sh(t, c, running.ID, "echo alive"); strings.TrimSpace(out) != "alive" {
		t.Errorf("running sandbox answered %q", out)
	}
	// Once hibernated, the running one's past expires_at deletes it.
	hibernate(t, c, running.ID)
	t0 = time.Now()
	for {
		_, err := c.GetSandbox(ctx, running.ID)
		if client.IsNotFound(err) {
			break
		}
		if time.Since(t0) > 15*time.Second {
			t.Fatalf("sandbox %s, hibernated past its expires_at, still exists after %v", running.ID, time.Since(t0))
		}
		time.Sleep(200 * time.Millisecond)
	}
	wantState(t, c, keep.ID, apiv1.StateHibernated)
}

// TestSnapshotAPIChunked: with the chunked store a diff hibernate's snapshot
// reports new_bytes below its stored_bytes, a dedup ratio, its parent; verify reads
// the chunks from the backend and names the corrupt chunk.
func TestSnapshotAPIChunked(t *testing.T) {
	srv := start(t, servertest.Options{Store: server.StoreConfig{Kind: "chunked"}})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	h1 := hibernate(t, c, sb.ID)
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	sh(t, c, sb.ID, "echo changed > /root/changed.txt")
	h2 := hibernate(t, c, sb.ID)
	id := h2.Snapshot.ID
	snap, err := c.GetSnapshot(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("diff snapshot: logical %d stored %d new %d ratio %.2f", snap.LogicalBytes, snap.StoredBytes, snap.NewBytes, snap.DedupRatio)
	if snap.LogicalBytes <= 0 || snap.StoredBytes <= 0 || snap.NewBytes >= snap.StoredBytes || snap.DedupRatio <= 0 {
		t.Errorf("chunked diff snapshot sizes: %+v", snap)
	}
	if snap.Parent == nil || *snap.Parent != h1.Snapshot.ID || !snap.Durable {
		t.Errorf("parent %v durable %v, want %s and true", snap.Parent, snap.Durable, h1.Snapshot.ID)
	}
	if vr, err := c.VerifySnapshot(ctx, id); err != nil || !vr.OK {
		t.Fatalf("verify: %+v %v", vr, err)
	}
	checkStoreUsage(t, srv, snap)
	flips := corruptMemoryFile(t, srv, id)
	res := rawCall(t, http.MethodPost, srv.URL+"/v1/snapshots/"+id+"/verify", "", nil)
	if res.Status != http.StatusUnprocessableEntity || !strings.Contains(res.Err.Message, "pages.img") {
		t.Errorf("verify of a corrupt chunk: %d %s", res.Status, res.Body)
	}
	for _, f := range flips {
		if f.chunk != "" && !strings.Contains(res.Err.Message, f.chunk) {
			t.Errorf("verify message %q does not name chunk %s", res.Err.Message, f.chunk)
		}
	}
	t.Logf("verify of the corrupt chunk: %d %s", res.Status, res.Err.Message)
	for _, f := range flips {
		flipByte(t, f.path, f.off)
	}
	if vr, err := c.VerifySnapshot(ctx, id); err != nil || !vr.OK {
		t.Errorf("verify after restoring the byte: %+v %v", vr, err)
	}
}

// checkStoreUsage checks GET /v1/store and the torpor_store_* metrics against
// the snapshot list, with snap (a chunked snapshot of this server) among them.
func checkStoreUsage(t *testing.T, srv *servertest.Server, snap apiv1.Snapshot) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	u, err := srv.Client.StoreUsage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	list, err := srv.Client.ListSnapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var logical int64
	for _, s := range list {
		logical += s.LogicalBytes
	}
	t.Logf("store usage: %+v", u)
	if u.Kind != "chunked" || u.Snapshots != len(list) || u.LogicalBytes != logical {
		t.Errorf("store usage %+v; want kind chunked, %d snapshots of %d logical bytes", u, len(list), logical)
	}
	if u.ChunkBytes < snap.StoredBytes || u.StoredBytes < u.ChunkBytes || u.Chunks == 0 || u.Packs == 0 {
		t.Errorf("store usage %+v: chunk bytes below the snapshot's %d, or stored below chunk bytes", u, snap.StoredBytes)
	}
	if u.LocalBytes < snap.LogicalBytes || u.PendingUploadBytes != 0 || u.DedupRatio <= 0 {
		t.Errorf("store usage %+v: local bytes below the opened copy's %d, pending upload, or no ratio", u, snap.LogicalBytes)
	}
	// The metrics read the same figures at scrape time (a background garbage
	// collection may have changed them since: only their presence is exact).
	res := rawCall(t, http.MethodGet, srv.URL+"/metrics", "", nil)
	for _, name := range []string{"torpor_store_snapshots", "torpor_store_logical_bytes", "torpor_store_stored_bytes",
		"torpor_store_chunk_bytes", "torpor_store_pending_upload_bytes", "torpor_store_local_bytes"} {
		var v float64
		found := false
		for _, line := range strings.Split(string(res.Body), "\n") {
			if rest, ok := strings.CutPrefix(line, name+" "); ok {
				v, err = strconv.ParseFloat(rest, 64)
				found = err == nil
			}
		}
		if !found || (v <= 0 && name != "torpor_store_pending_upload_bytes") {
			t.Errorf("metrics: %s found %v, value %g", name, found, v)
		}
	}
}
