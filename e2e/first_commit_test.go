package e2e

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/workload"
)

// TestDeferredFirstCommitCrash: a sandbox's first hibernate into the chunked
// store is recorded once the checkpoint's files and a pending manifest are
// synced, its chunks stored after. `torpor serve` killed (SIGKILL) right
// after the hibernate is recorded leaves the pending manifest; after the
// restart the sandbox is hibernated, resumes with its process and 128 MiB
// buffer intact, the restarted server stores the chunks (the pending
// manifest goes) and the snapshot's sizes become the chunked ones; a second
// hibernate is a diff on it.
func TestDeferredFirstCommitCrash(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log")}
	p.start("TORPOR_TEST_KILL_AT=hibernate-recorded")
	defer p.restartAndDeleteAll()
	c := p.client()
	ctx := ctxFor(t, 10*time.Minute)
	never := 0
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 512, IdleTimeoutS: &never})
	if err := workload.Start(ctx, c, sb.ID, 128); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count := first.Count
	cut := p.client()
	cut.Retries = 0
	if h, err := cut.Hibernate(ctx, sb.ID); err == nil {
		t.Fatalf("hibernate answered (%s) though the server was to be killed once it was recorded", h.State)
	}
	p.waitKilled()
	pending, _ := filepath.Glob(filepath.Join(dataDir, "chunks", "pending", "*.json"))
	if len(pending) == 0 {
		t.Fatalf("no pending manifest after the kill: the first commit was not deferred, or its chunks were stored within the kill\n%s", p.logText())
	}
	t.Logf("pending after the kill: %v", pending)
	p.start()
	c = p.client()
	got := get(t, c, sb.ID)
	if got.State != apiv1.StateHibernated || got.Snapshot == nil {
		t.Fatalf("after the restart %s is %s on snapshot %v, want hibernated", sb.ID, got.State, got.Snapshot)
	}
	snapID := got.Snapshot.ID
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume after the restart: %v\n%s", err, p.logText())
	}
	checkWorkload(t, ctx, c, sb.ID, "after the restart", first, &count)
	var snap apiv1.Snapshot
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if snap, err = c.GetSnapshot(ctx, snapID); err != nil {
			t.Fatal(err)
		}
		_, perr := os.Stat(filepath.Join(dataDir, "chunks", "pending", snapID+".json"))
		if os.IsNotExist(perr) && snap.StoredBytes != snap.Bytes {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s: pending manifest %v, stored %d of %d bytes two minutes after the restart\n%s",
				snapID, perr, snap.StoredBytes, snap.Bytes, p.logText())
		}
	}
	t.Logf("snapshot %s chunked after the restart: logical %d stored %d new %d", snapID, snap.LogicalBytes, snap.StoredBytes, snap.NewBytes)
	if snap.StoredBytes <= 0 || snap.StoredBytes > snap.Bytes || snap.NewBytes > snap.StoredBytes {
		t.Errorf("first snapshot sizes after its chunks were stored: %+v", snap)
	}
	h2 := hibernate(t, c, sb.ID)
	if h2.Snapshot.Parent == nil || *h2.Snapshot.Parent != snapID || h2.Snapshot.NewBytes >= snap.StoredBytes/2 {
		t.Errorf("second hibernate: parent %v, new bytes %d; want a diff on %s", h2.Snapshot.Parent, h2.Snapshot.NewBytes, snapID)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	checkWorkload(t, ctx, c, sb.ID, "after the second hibernate", first, &count)
}
