package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/torpor/torpor/apiv1"
)

// UpdateSandbox changes a sandbox's policies (PATCH /v1/sandboxes/{id}); only the
// fields set in req change.
func (c *Client) UpdateSandbox(ctx context.Context, id string, req apiv1.UpdateSandboxRequest) (apiv1.Sandbox, error) {
	var sb apiv1.Sandbox
	err := c.call(ctx, http.MethodPatch, sandboxPath(id), req, &sb)
	return sb, err
}

// ForkWith is Fork with every option of the fork request (e.g. Volumes "copy").
func (c *Client) ForkWith(ctx context.Context, id string, req apiv1.ForkRequest) ([]apiv1.Sandbox, error) {
	if req.Count <= 0 {
		req.Count = 1
	}
	var r apiv1.ForkResponse
	err := c.call(ctx, http.MethodPost, sandboxPath(id, "fork"), req, &r)
	return r.Sandboxes, err
}

// CreateVolume creates an empty named volume.
func (c *Client) CreateVolume(ctx context.Context, name string) (apiv1.Volume, error) {
	var v apiv1.Volume
	err := c.call(ctx, http.MethodPost, "/v1/volumes", apiv1.CreateVolumeRequest{Name: name}, &v)
	return v, err
}

// ListVolumes lists the volumes.
func (c *Client) ListVolumes(ctx context.Context) ([]apiv1.Volume, error) {
	var r apiv1.ListVolumesResponse
	err := c.call(ctx, http.MethodGet, "/v1/volumes", nil, &r)
	return r.Volumes, err
}

// GetVolume returns one volume.
func (c *Client) GetVolume(ctx context.Context, name string) (apiv1.Volume, error) {
	var v apiv1.Volume
	err := c.call(ctx, http.MethodGet, "/v1/volumes/"+url.PathEscape(name), nil, &v)
	return v, err
}

// DeleteVolume deletes a volume and its data; it fails (conflict) while a sandbox
// mounts it.
func (c *Client) DeleteVolume(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, "/v1/volumes/"+url.PathEscape(name), nil, nil)
}
