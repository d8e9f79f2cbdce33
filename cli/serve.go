package cli

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"strings"

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
	standby, err := standbyMemoryMiB(cfg.StandbyMemory)
	if err != nil {
		return err
	}
	// One log for all of the server: what logs through slog.Default or the
	// log package (net/http's own lines among them) comes out in the same
	// format as the rest.
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	slog.SetDefault(logger)
	return server.Run(ctx, server.Config{
		Logger:           logger,
		StandbyMemoryMiB: standby,
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
		Limits:           manager.LimitsConfig{PidsLimit: cfg.PidsLimit, MemoryOvercommit: cfg.MemoryOvercommit, Restores: cfg.Restores},
		Egress:           egress,

		PreparedContainers: cfg.PreparedContainers,
		SpareNetworks:      cfg.SpareNetworks,
		BackgroundRestore:  cfg.BackgroundRestore,
		StreamColdResumes:  cfg.StreamColdResumes,
	})
}

// cacheBytes maps the flag (0 = no cache) to server.StoreConfig (0 = default, < 0 = none).
func cacheBytes(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}

// standbyMemoryMiB reads --standby-memory: "auto" is half of the host's
// memory (MemTotal in /proc/meminfo), "0" no budget, else a size in MiB or
// GiB (parseSizesMiB).
func standbyMemoryMiB(v string) (int, error) {
	switch strings.TrimSpace(v) {
	case "0", "none":
		return 0, nil
	case "auto", "":
		b, err := os.ReadFile("/proc/meminfo")
		if err != nil {
			return 0, nil // unknown: no budget
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
				kib, _ := strconv.Atoi(f[1])
				return kib / 1024 / 2, nil
			}
		}
		return 0, nil
	}
	sizes, err := parseSizesMiB(v)
	if err != nil || len(sizes) != 1 {
		return 0, usagef("--standby-memory %q: want auto, 0 or one size such as 4GiB", v)
	}
	return sizes[0], nil
}
