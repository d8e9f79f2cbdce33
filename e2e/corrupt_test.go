package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
)

// TestCorruptSnapshot flips one byte in a hibernated sandbox's memory file. Resume
// (and any call that would resume it) must answer 422 snapshot_corrupt naming the
// snapshot and pages.img, the sandbox must stay hibernated, other sandboxes must
// keep working, and once the byte is restored the resume must succeed with the
// sandbox's state intact.
func TestCorruptSnapshot(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 5*time.Minute)
	victim := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	other := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	writeFile(t, c, victim.ID, "/root/keep.txt", []byte("kept across the corruption\n"))

	h := hibernate(t, c, victim.ID)
	snapID := h.Snapshot.ID
	flips := corruptMemoryFile(t, srv, snapID)
	checkCorrupt := func(what string, res rawResult) {
		t.Helper()
		if res.Status != http.StatusUnprocessableEntity || res.Err.Code != apiv1.CodeSnapshotCorrupt {
			t.Errorf("%s: HTTP %d %s %q, want 422 snapshot_corrupt", what, res.Status, res.Err.Code, res.Err.Message)
			return
		}
		if !strings.Contains(res.Err.Message, snapID) || !strings.Contains(res.Err.Message, "pages.img") {
			t.Errorf("%s: message %q does not name snapshot %s and file pages.img", what, res.Err.Message, snapID)
		}
		for _, f := range flips {
			if f.chunk != "" && !strings.Contains(res.Err.Message, f.chunk) {
				t.Errorf("%s: message %q does not name the corrupt chunk %s", what, res.Err.Message, f.chunk)
			}
		}
	}
	base := srv.URL + "/v1/sandboxes/" + victim.ID
	res := rawCall(t, http.MethodPost, base+"/resume", "", nil)
	checkCorrupt("resume", res)
	t.Logf("resume answered %d: %s", res.Status, res.Body)
	// Calls that wake the sandbox meet the same check.
	checkCorrupt("exec", rawCall(t, http.MethodPost, base+"/exec", "application/json", []byte(`{"cmd":["true"]}`)))
	checkCorrupt("read file", rawCall(t, http.MethodGet, base+"/files?path=/root/keep.txt", "", nil))
	checkCorrupt("proxied request", rawCall(t, http.MethodGet, base+"/ports/8080/", "", nil))
	// A second resume fails the same way: nothing was half-restored.
	checkCorrupt("second resume", rawCall(t, http.MethodPost, base+"/resume", "", nil))

	after := wantState(t, c, victim.ID, apiv1.StateHibernated)
	if after.Snapshot == nil || after.Snapshot.ID != snapID {
		t.Errorf("after the failed resume the sandbox's snapshot is %v, want %s", after.Snapshot, snapID)
	}
	if r, all, _ := instancesOf(t, srv, victim.ID); len(r)+len(all) > 0 {
		t.Errorf("engine has instances of the hibernated sandbox: running %v, all %v", r, all)
	}
	if p := hostProcs(victim.ID); len(p) > 0 {
		t.Errorf("host processes of the hibernated sandbox: %v", p)
	}

	// The server keeps serving other sandboxes.
	if got := sh(t, c, other.ID, "echo alive"); got != "alive\n" {
		t.Errorf("other sandbox's exec answered %q", got)
	}
	if _, err := c.ListSandboxes(ctx); err != nil {
		t.Errorf("list: %v", err)
	}

	// Restoring the byte makes the snapshot good again.
	for _, f := range flips {
		f.undo(t)
	}
	r, err := c.Resume(ctx, victim.ID)
	if err != nil {
		t.Fatalf("resume after restoring the byte: %v", err)
	}
	if r.State != apiv1.StateRunning {
		t.Fatalf("resume after restoring the byte answered state %q", r.State)
	}
	if got := string(readFile(t, c, victim.ID, "/root/keep.txt")); got != "kept across the corruption\n" {
		t.Errorf("file after resume: %q", got)
	}
	wantState(t, c, victim.ID, apiv1.StateRunning)

	// Chunked store: a flipped byte in the local plain copy only (the chunks are
	// intact) is repaired from the chunks; the resume succeeds with the state intact.
	h2 := hibernate(t, c, victim.ID)
	copyPath := filepath.Join(srv.DataDir, "chunks", "open", h2.Snapshot.ID, "pages.img")
	if !fileExists(copyPath) {
		t.Logf("no local copy %s (plain store, or not opened yet): repair case skipped", copyPath)
		return
	}
	st, _ := os.Stat(copyPath)
	flipByte(t, copyPath, st.Size()/3)
	if _, err := c.Resume(ctx, victim.ID); err != nil {
		t.Fatalf("resume with only the local copy damaged: %v", err)
	}
	if got := string(readFile(t, c, victim.ID, "/root/keep.txt")); got != "kept across the corruption\n" {
		t.Errorf("file after the repaired resume: %q", got)
	}
}

// flip is one byte changed in a snapshot file.
type flip struct {
	path  string
	off   int64
	orig  byte
	chunk string // the chunk id, when the file is a chunk of the chunked store
}

func flipByte(t *testing.T, path string, off int64) flip {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatalf("read %s at %d: %v", path, off, err)
	}
	if _, err := f.WriteAt([]byte{b[0] ^ 0x01}, off); err != nil {
		t.Fatal(err)
	}
	t.Logf("flipped bit 0 of byte %d of %s", off, path)
	return flip{path: path, off: off, orig: b[0]}
}

// undo puts the original byte back (a file the store has since removed, such as
// a local copy it rebuilds from chunks, is left alone).
func (f flip) undo(t *testing.T) {
	t.Helper()
	fh, err := os.OpenFile(f.path, os.O_RDWR, 0)
	if os.IsNotExist(err) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if _, err := fh.WriteAt([]byte{f.orig}, f.off); err != nil {
		t.Fatal(err)
	}
}

// corruptMemoryFile flips one byte of the memory file (pages.img) of snapshot id
// where the store keeps it durably: in the plain store the file
// <DataDir>/snapshots/<id>/pages.img; in the chunked store (the default) one
// stored chunk of pages.img under <DataDir>/chunks/store, and the same byte of the
// local plain copy under <DataDir>/chunks/open/<id> if there is one (else the
// store would restore from that copy without reading the chunk). A first
// commit's chunks are stored in the background (deferred first commits,
// docs/snapshot-store.md): the helper waits for its pending manifest
// (<DataDir>/chunks/pending/<id>.json) to go first.
func corruptMemoryFile(t *testing.T, srv *servertest.Server, id string) []flip {
	t.Helper()
	plain := filepath.Join(srv.DataDir, "snapshots", id, "pages.img")
	if st, err := os.Stat(plain); err == nil {
		return []flip{flipByte(t, plain, st.Size()/2)}
	}
	pending := filepath.Join(srv.DataDir, "chunks", "pending", id+".json")
	for deadline := time.Now().Add(2 * time.Minute); fileExists(pending); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s: its deferred chunk commit has not ended after 2 minutes (%s is there)", id, pending)
		}
	}
	man := filepath.Join(srv.DataDir, "chunks", "store", "manifests", id+".json")
	b, err := os.ReadFile(man)
	if err != nil {
		t.Fatalf("snapshot %s: neither %s nor %s: %v", id, plain, man, err)
	}
	var doc struct {
		Files []struct {
			Name   string `json:"name"`
			Chunks []struct {
				ID  string `json:"id"`
				Len int64  `json:"len"`
			} `json:"chunks"`
		} `json:"chunks"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("manifest %s: %v", man, err)
	}
	for _, f := range doc.Files {
		if f.Name != "pages.img" {
			continue
		}
		// The middle stored (not all-zero) chunk of the file.
		type at struct {
			id       string
			off, len int64
		}
		var stored []at
		var off int64
		for _, ch := range f.Chunks {
			if ch.ID != "" {
				stored = append(stored, at{ch.ID, off, ch.Len})
			}
			off += ch.Len
		}
		if len(stored) == 0 {
			t.Fatalf("manifest %s: pages.img has no stored chunk", man)
		}
		ch := stored[len(stored)/2]
		obj, off, n := findInPack(t, filepath.Join(srv.DataDir, "chunks", "store"), ch.id)
		fl := flipByte(t, obj, off+n/2)
		fl.chunk = ch.id
		flips := []flip{fl}
		if copyPath := filepath.Join(srv.DataDir, "chunks", "open", id, "pages.img"); fileExists(copyPath) {
			flips = append(flips, flipByte(t, copyPath, ch.off+ch.len/2))
		}
		return flips
	}
	t.Fatalf("manifest %s has no pages.img", man)
	return nil
}

// findInPack returns the pack file holding chunk id in the filesystem backend
// at dir, and the chunk's offset and stored length in it (from the packs'
// indexes, index/<pack>.json).
func findInPack(t *testing.T, dir, id string) (path string, off, n int64) {
	t.Helper()
	idx, _ := filepath.Glob(filepath.Join(dir, "index", "*.json"))
	for _, p := range idx {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var x struct {
			Chunks []struct {
				ID  string `json:"id"`
				Off int64  `json:"off"`
				Len int64  `json:"len"`
			} `json:"chunks"`
		}
		if err := json.Unmarshal(b, &x); err != nil {
			t.Fatalf("pack index %s: %v", p, err)
		}
		for _, c := range x.Chunks {
			if c.ID == id {
				pack := strings.TrimSuffix(filepath.Base(p), ".json")
				return filepath.Join(dir, "packs", pack[:2], pack), c.Off, c.Len
			}
		}
	}
	t.Fatalf("chunk %s is in none of the %d pack indexes under %s", id, len(idx), dir)
	return "", 0, 0
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// TestMissingSnapshotDirectory: a snapshot the database records but whose
// directory is gone refuses the resume with 422 snapshot_corrupt naming it; the
// sandbox stays hibernated and resumes once the directory is back.
func TestMissingSnapshotDirectory(t *testing.T) {
	srv := start(t, servertest.Options{Store: server.StoreConfig{Kind: "plain"}})
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	h := hibernate(t, c, sb.ID)
	dir := filepath.Join(srv.DataDir, "snapshots", h.Snapshot.ID)
	aside := dir + ".aside"
	if err := os.Rename(dir, aside); err != nil {
		t.Fatal(err)
	}
	res := rawCall(t, http.MethodPost, srv.URL+"/v1/sandboxes/"+sb.ID+"/resume", "", nil)
	if res.Status != http.StatusUnprocessableEntity || res.Err.Code != apiv1.CodeSnapshotCorrupt || !strings.Contains(res.Err.Message, h.Snapshot.ID) {
		t.Errorf("resume without its snapshot: HTTP %d %s %q, want 422 snapshot_corrupt naming %s", res.Status, res.Err.Code, res.Err.Message, h.Snapshot.ID)
	}
	wantState(t, c, sb.ID, apiv1.StateHibernated)
	if err := os.Rename(aside, dir); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(ctxFor(t, time.Minute), sb.ID); err != nil {
		t.Fatalf("resume with the snapshot back: %v", err)
	}
}
