package cli

import (
	"context"

	"github.com/torpor/torpor/server"
)

func runServe(ctx context.Context, cfg serveConfig) error {
	return server.Run(ctx, server.Config{
		DataDir:          cfg.DataDir,
		Listen:           cfg.Listen,
		RunscPath:        cfg.RunscPath,
		AgentPath:        cfg.AgentPath,
		IdleCPUThreshold: cfg.IdleCPUThreshold,
	})
}
