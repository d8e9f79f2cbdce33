//go:build !torpor_server

package cli

import (
	"context"
	"errors"
)

// Until package server exists, serve.go (build tag torpor_server) is left out.
func runServe(ctx context.Context, cfg serveConfig) error {
	return errors.New("serve: server package not built yet")
}
