package cli

import (
	"context"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/server"
)

func runServe(ctx context.Context, cfg serveConfig) error {
	store := cfg.Store
	store.CacheBytes, store.OpenBytes, store.AsyncUpload = cacheBytes(cfg.CacheBytes), cacheBytes(cfg.OpenBytes), cfg.AsyncUpload
	egress, err := cfg.egressConfig()
	if err != nil {
		return err
	}
	return server.Run(ctx, server.Config{
		DataDir:          cfg.DataDir,
		Database:         cfg.Database,
		Node:             cfg.Node,
		Advertise:        cfg.Advertise,
		Listen:           cfg.Listen,
		RunscPath:        cfg.RunscPath,
		AgentPath:        cfg.AgentPath,
		IdleCPUThreshold: cfg.IdleCPUThreshold,
		Store:            store,
		Auth:             server.AuthMode(cfg.Auth),
		E2B:              server.E2BConfig{Domain: cfg.E2BDomain},
		TLSCert:          cfg.TLSCert,
		TLSKey:           cfg.TLSKey,
		Limits:           manager.LimitsConfig{PidsLimit: cfg.PidsLimit, MemoryOvercommit: cfg.MemoryOvercommit},
		Egress:           egress,
	})
}

// cacheBytes maps the flag (0 = no cache) to server.StoreConfig (0 = default, < 0 = none).
func cacheBytes(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}
