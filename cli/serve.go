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
		Store: server.StoreConfig{Kind: cfg.Store, S3Endpoint: cfg.S3Endpoint, S3Bucket: cfg.S3Bucket,
			S3AccessKey: cfg.S3AccessKey, S3SecretKey: cfg.S3SecretKey, S3Region: cfg.S3Region,
			S3Prefix: cfg.S3Prefix, CacheBytes: cacheBytes(cfg.CacheBytes), OpenBytes: cacheBytes(cfg.OpenBytes), AsyncUpload: cfg.AsyncUpload},
	})
}

// cacheBytes maps the flag (0 = no cache) to server.StoreConfig (0 = default, < 0 = none).
func cacheBytes(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}
