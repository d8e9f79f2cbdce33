package server

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/local"
)

// StoreConfig selects and configures the snapshot store.
//
//	"plain" (default)  the plain-file store (snapshot/local) in <data-dir>/snapshots:
//	                   the engine's files as written plus a manifest with the sha256
//	                   of every file; the fastest hibernate here
//	"chunked"          chunked store (snapshot/chunked) on the filesystem backend in
//	                   <data-dir>/chunks: dedup, diff snapshots, zstd, verification
//	                   ("local" is accepted as an alias)
//	"s3"               chunked store on an S3-compatible bucket; <data-dir>/chunks
//	                   keeps only staging, opened snapshots and the chunk cache
//
// plain stays the default until the chunked store's first hibernate is as fast
// (measured here: 21–42 MiB/s first commit against ~150 MiB/s plain; see README).
type StoreConfig struct {
	Kind        string
	S3Endpoint  string // http(s)://host:port or host:port (TLS)
	S3Bucket    string
	S3AccessKey string
	S3SecretKey string
	S3Region    string
	S3Prefix    string
	// S3VirtualHost selects virtual-host-style requests (default path-style, which
	// self-hosted servers need).
	S3VirtualHost bool
	// CacheBytes bounds the local chunk cache in front of S3 (default 10 GiB; 0
	// keeps the default, a negative value disables the cache).
	CacheBytes int64
	// AsyncUpload makes asynchronous upload the default for hibernates that do
	// not choose (idle and timeout hibernates, forks, API calls without
	// async_upload). Not with the plain store.
	AsyncUpload bool
	// UploadRetry is the first delay before a failed background upload is
	// retried (doubling up to 60 s; default 1 s).
	UploadRetry time.Duration

	readOnly bool // OpenStore: no background upload
}

// OpenStore opens the snapshot store a server with data directory dataDir and
// store configuration cfg uses, without background collection, for tools that
// inspect or verify snapshots next to a running server (read-only use only).
func OpenStore(ctx context.Context, dataDir string, cfg StoreConfig) (snapshot.Store, func() error, error) {
	if cfg.Kind != "plain" {
		cfg.CacheBytes = -1 // the running server owns the cache (and the uploads)
		cfg.readOnly = true
	}
	return openStore(ctx, dataDir, cfg, slog.Default(), false)
}

// openStore opens the configured snapshot store; closeFn stops its background work.
func openStore(ctx context.Context, dataDir string, cfg StoreConfig, log *slog.Logger, autoGC bool) (snapshot.Store, func() error, error) {
	nop := func() error { return nil }
	switch cfg.Kind {
	case "", "plain":
		if cfg.AsyncUpload {
			return nil, nil, fmt.Errorf("snapshot store plain: --async-upload needs --store chunked or s3 (the plain store has no durable tier to upload to)")
		}
		s, err := local.New(filepath.Join(dataDir, "snapshots"))
		return s, nop, err
	case "chunked", "local":
		s, err := chunked.New(ctx, chunked.Config{Dir: filepath.Join(dataDir, "chunks"), AutoGC: autoGC,
			Logger: log, ReadOnly: cfg.readOnly, UploadRetry: cfg.UploadRetry})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot store: %w", err)
		}
		return s, s.Close, nil
	case "s3":
		b, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: cfg.S3Endpoint, Bucket: cfg.S3Bucket,
			AccessKey: cfg.S3AccessKey, SecretKey: cfg.S3SecretKey, Region: cfg.S3Region, Prefix: cfg.S3Prefix,
			PathStyle: !cfg.S3VirtualHost})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot store: %w", err)
		}
		cache := cfg.CacheBytes
		if cache == 0 {
			cache = 10 << 30
		}
		if cache < 0 {
			cache = 0
		}
		s, err := chunked.New(ctx, chunked.Config{Dir: filepath.Join(dataDir, "chunks"), Backend: b,
			CacheBytes: cache, AutoGC: autoGC, Logger: log, ReadOnly: cfg.readOnly, UploadRetry: cfg.UploadRetry})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot store: %w", err)
		}
		return s, s.Close, nil
	default:
		return nil, nil, fmt.Errorf("snapshot store %q: want plain, chunked or s3", cfg.Kind)
	}
}
