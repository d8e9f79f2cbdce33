package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/torpor/torpor/apiv1"
)

// ListNodes returns the nodes on the server's metadata database, by name.
func (c *Client) ListNodes(ctx context.Context) ([]apiv1.Node, error) {
	var r apiv1.ListNodesResponse
	err := c.call(ctx, http.MethodGet, "/v1/nodes", nil, &r)
	return r.Nodes, err
}

// DrainNode marks node name draining (drain true) or not, and returns its
// record: a draining node takes no new or resumed sandboxes and hibernates
// its own, which resume on other nodes on their next request. Errors: 404
// for an unknown node.
func (c *Client) DrainNode(ctx context.Context, name string, drain bool) (apiv1.Node, error) {
	var n apiv1.Node
	op := "/drain"
	if !drain {
		op = "/undrain"
	}
	err := c.call(ctx, http.MethodPost, "/v1/nodes/"+url.PathEscape(name)+op, nil, &n)
	return n, err
}

// DeleteNode removes the record of node name, which must be lost (its
// server stopped for longer than the lease time), own no sandbox and hold no
// volume. A server that later starts as name registers it again. Errors:
// 404 for an unknown node; 409 (IsConflict) naming why otherwise.
func (c *Client) DeleteNode(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/nodes/"+url.PathEscape(name), nil, nil)
}
