package server

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/manager"
)

// TestPoolsAPI: the pool calls' answers and refusals, and an idempotent
// create (the Go client sends a key; the server chooses the id first) that
// takes a ready clone and is answered as the same sandbox when retried.
func TestPoolsAPI(t *testing.T) {
	f := startFakeServer(t, manager.LimitsConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := client.New(f.url)
	for _, tc := range []struct {
		path, body string
		status     int
	}{
		{"/v1/images/tiny/pool", `{}`, http.StatusBadRequest},
		{"/v1/images/tiny/pool", `{"size":17}`, http.StatusBadRequest},
		{"/v1/images/tiny/pool", `{"size":-1}`, http.StatusBadRequest},
		{"/v1/images/nope/pool", `{"size":1}`, http.StatusNotFound},
		{"/v1/snapshots/snap-nope/pool", `{"size":1}`, http.StatusNotFound},
	} {
		req, _ := http.NewRequest(http.MethodPut, f.url+tc.path, strings.NewReader(tc.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("PUT %s %s: %d, want %d", tc.path, tc.body, resp.StatusCode, tc.status)
		}
	}
	p, err := c.SetImagePool(ctx, "tiny", 1)
	if err != nil || p.Template != "image" || p.Name != "tiny" || p.Size != 1 {
		t.Fatalf("set pool: %+v %v", p, err)
	}
	for {
		pools, err := c.ListPools(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(pools) == 1 && pools[0].Ready == 1 {
			if pools[0].SnapshotID == "" || pools[0].MemoryMiB != manager.DefaultMemoryMiB {
				t.Fatalf("ready pool %+v: want its template snapshot and %d MiB", pools[0], manager.DefaultMemoryMiB)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("pool not ready: %+v", pools)
		}
		time.Sleep(10 * time.Millisecond)
	}
	key := "pool-test-key"
	sb, err := c.CreateSandbox(client.WithIdempotencyKey(ctx, key), apiv1.CreateSandboxRequest{Image: "tiny"})
	if err != nil {
		t.Fatal(err)
	}
	if sb.LastResume == nil || !sb.LastResume.Forked || sb.State != apiv1.StateRunning {
		t.Fatalf("create with a ready clone: %+v", sb)
	}
	again, err := c.CreateSandbox(client.WithIdempotencyKey(ctx, key), apiv1.CreateSandboxRequest{Image: "tiny"})
	if err != nil || again.ID != sb.ID {
		t.Fatalf("retry with the same key: %s %v, want %s", again.ID, err, sb.ID)
	}
	if ids := f.ids(t); len(ids) != 1 || ids[0] != sb.ID {
		t.Fatalf("sandboxes %v, want only %s", ids, sb.ID)
	}
	// A template snapshot cannot be deleted while its pool exists.
	if _, err := c.Hibernate(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	got, _ := c.GetSandbox(ctx, sb.ID)
	snap := got.Snapshot.ID
	if _, err := c.SetSnapshotPool(ctx, snap, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Hibernate(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	var ae *client.APIError
	if err := c.DeleteSnapshot(ctx, snap); !errors.As(err, &ae) || ae.Status != http.StatusConflict {
		t.Fatalf("delete of a template snapshot: %v, want 409", err)
	}
	if _, err := c.SetSnapshotPool(ctx, snap, 0); err != nil {
		t.Fatal(err)
	}
	if pools, _ := c.ListPools(ctx); len(pools) != 1 || pools[0].Template != "image" {
		t.Fatalf("pools after the snapshot's size 0: %+v", pools)
	}
}
