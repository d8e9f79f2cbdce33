// Package client is the Go client of torpor's REST API v1 (see apiv1 for the wire
// types and apiv1/openapi.json for the document).
//
//	c := client.New("") // TORPOR_URL or http://127.0.0.1:7070
//	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base"})
//	stdout, stderr, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"uname", "-a"}})
//	snap, err := c.Hibernate(ctx, sb.ID)
//	sb, err = c.Resume(ctx, sb.ID)
//
// Every method takes a context first and honours it; the underlying http.Client has
// no overall timeout because exec, hibernate and image builds can take long. Errors
// the server reports come back as *APIError; IsNotFound and IsConflict test for the
// common codes.
package client
