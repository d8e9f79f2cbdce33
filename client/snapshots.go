package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/torpor/torpor/apiv1"
)

func snapshotPath(id string, rest ...string) string {
	p := "/v1/snapshots/" + url.PathEscape(id)
	for _, r := range rest {
		p += "/" + r
	}
	return p
}

// ListSnapshots lists every committed snapshot, oldest first.
func (c *Client) ListSnapshots(ctx context.Context) ([]apiv1.Snapshot, error) {
	var r apiv1.ListSnapshotsResponse
	err := c.call(ctx, http.MethodGet, "/v1/snapshots", nil, &r)
	return r.Snapshots, err
}

// GetSnapshot returns one snapshot (sizes, parent, durability, expiry).
func (c *Client) GetSnapshot(ctx context.Context, id string) (apiv1.Snapshot, error) {
	var s apiv1.Snapshot
	err := c.call(ctx, http.MethodGet, snapshotPath(id), nil, &s)
	return s, err
}

// DeleteSnapshot deletes a snapshot; it fails (conflict) while a sandbox resumes
// from it.
func (c *Client) DeleteSnapshot(ctx context.Context, id string) error {
	return c.call(ctx, http.MethodDelete, snapshotPath(id), nil, nil)
}

// VerifySnapshot reads a whole snapshot from the store and checks its hashes. A
// corrupt snapshot is an *APIError with code snapshot_corrupt naming the file.
func (c *Client) VerifySnapshot(ctx context.Context, id string) (apiv1.VerifySnapshotResponse, error) {
	var r apiv1.VerifySnapshotResponse
	err := c.call(ctx, http.MethodPost, snapshotPath(id, "verify"), nil, &r)
	return r, err
}

// StoreUsage returns the snapshot store's footprint (GET /v1/store).
func (c *Client) StoreUsage(ctx context.Context) (apiv1.StoreUsage, error) {
	var u apiv1.StoreUsage
	err := c.call(ctx, http.MethodGet, "/v1/store", nil, &u)
	return u, err
}
