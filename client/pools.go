package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/torpor/torpor/apiv1"
)

// SetImagePool sets image name's warm pool size (0 to 16; 0 ends the pool):
// that many restored-and-paused clones are kept ready for creates of the
// image with its default spec (PUT /v1/images/{name}/pool). The answer's
// Ready counts the clones ready now; the pool fills in the background.
func (c *Client) SetImagePool(ctx context.Context, name string, size int) (apiv1.Pool, error) {
	return c.setPool(ctx, "/v1/images/"+url.PathEscape(name)+"/pool", size)
}

// SetSnapshotPool marks snapshot id a template with a warm pool of size
// clones for forks of a sandbox hibernated on it (0 unmarks it; PUT
// /v1/snapshots/{id}/pool).
func (c *Client) SetSnapshotPool(ctx context.Context, id string, size int) (apiv1.Pool, error) {
	return c.setPool(ctx, snapshotPath(id, "pool"), size)
}

func (c *Client) setPool(ctx context.Context, path string, size int) (apiv1.Pool, error) {
	var p apiv1.Pool
	err := c.call(ctx, http.MethodPut, path, apiv1.SetPoolRequest{Size: &size}, &p)
	return p, err
}

// ListPools lists the warm pools, by template kind and name (GET /v1/pools).
func (c *Client) ListPools(ctx context.Context) ([]apiv1.Pool, error) {
	var r apiv1.ListPoolsResponse
	err := c.call(ctx, http.MethodGet, "/v1/pools", nil, &r)
	return r.Pools, err
}
