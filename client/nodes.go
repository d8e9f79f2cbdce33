package client

import (
	"context"
	"net/http"

	"github.com/torpor/torpor/apiv1"
)

// ListNodes returns the nodes on the server's metadata database, by name.
func (c *Client) ListNodes(ctx context.Context) ([]apiv1.Node, error) {
	var r apiv1.ListNodesResponse
	err := c.call(ctx, http.MethodGet, "/v1/nodes", nil, &r)
	return r.Nodes, err
}
