package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/local"
)

// StoreConfig selects and configures the snapshot store.
//
//	"chunked" (default) chunked store (snapshot/chunked) on the filesystem backend
//	                   in <data-dir>/chunks: dedup, diff snapshots, zstd, packs,
//	                   verification ("local" is accepted as an alias)
//	"s3"               chunked store on an S3-compatible bucket; <data-dir>/chunks
//	                   keeps only staging, opened snapshots and the chunk cache
//	"plain"            the plain-file store (snapshot/local) in <data-dir>/snapshots:
//	                   the engine's files as written plus a manifest with checksums;
//	                   the fastest first hibernate, 2x slower diff hibernates
//
// "" means the kind the data directory was set up with (ResolveStoreKind).
type StoreConfig struct {
	Kind        string
	S3Endpoint  string // http(s)://host:port or host:port (TLS)
	S3Bucket    string
	S3AccessKey string
	S3SecretKey string
	S3Region    string
	S3Prefix    string
	// S3ImagePrefix is where in the bucket images are shared between the
	// servers on it (default DefaultImagePrefix, "images/"; server/images.go).
	S3ImagePrefix string
	// S3VirtualHost selects virtual-host-style requests (default path-style, which
	// self-hosted servers need).
	S3VirtualHost bool
	// CacheBytes bounds the local chunk cache in front of S3 (default 10 GiB; 0
	// keeps the default, a negative value disables the cache).
	CacheBytes int64
	// OpenBytes bounds the chunked store's opened copies (each live
	// snapshot's files, uncompressed, for warm resumes and diff hibernates;
	// least recently used removed above it, after a minute unused). Default
	// 20 GiB; a negative value means no bound.
	OpenBytes int64
	// AsyncUpload makes asynchronous upload the default for hibernates that do
	// not choose (idle and timeout hibernates, forks, API calls without
	// async_upload). Not with the plain store.
	AsyncUpload bool
	// UploadRetry is the first delay before a failed background upload is
	// retried (doubling up to 15 s, chunked.maxUploadRetry; default 1 s).
	UploadRetry time.Duration
	// SyncFirstCommits, with the chunked store on this disk, acknowledges a
	// sandbox's first hibernate only once its chunks are stored; by default
	// it is acknowledged once the checkpoint's files are synced (the plain
	// store's durability) and chunked in the background
	// (chunked.Config.DeferFirstCommits; docs/snapshot-store.md).
	SyncFirstCommits bool
	// KeyFile, when set, holds the key that encrypts new snapshots at rest
	// (chunked.LoadKey: 32 bytes, raw, hex or base64, mode 0600 or
	// stricter); OldKeyFiles hold earlier keys whose snapshots must still
	// open (rotation). Not with the plain store.
	KeyFile     string
	OldKeyFiles []string

	readOnly bool // OpenStore: no background upload
	// collectLock, set by New on a shared database, gives the lock by which
	// every node's store on the bucket prefix of store id keeps its garbage
	// collection away from the others' commits (chunked.CollectLock).
	collectLock func(storeID string) chunked.CollectLock
}

// storeKindFile, in a data directory, records the snapshot store the
// directory was set up with: its snapshots are only reachable through it. One
// line with the kind; for s3 also "bucket=B" and "prefix=P" lines.
const storeKindFile = "store"

// storeRecord is what storeKindFile holds.
func storeRecord(cfg StoreConfig) string {
	if cfg.Kind != "s3" {
		return cfg.Kind + "\n"
	}
	return fmt.Sprintf("s3\nbucket=%s\nprefix=%s\n", cfg.S3Bucket, cfg.S3Prefix)
}

// ResolveStoreKind returns the snapshot store kind for data directory dir and
// store configuration cfg: the kind recorded in dir/store, which an explicit
// cfg.Kind ("local" is "chunked") must match (and for s3 the bucket and
// prefix); without a record, cfg.Kind if given, else what the directory holds
// from before the record: "plain" if dir/snapshots has snapshots, "chunked" if
// dir/chunks/store has manifests, an error if dir/chunks exists otherwise (it
// may be an S3 store's local side: say which), else "chunked", the default.
// Errors name the file and the recorded configuration.
func ResolveStoreKind(dir string, cfg StoreConfig) (string, error) {
	kind := cfg.Kind
	if kind == "local" {
		kind = "chunked"
	}
	switch kind {
	case "", "plain", "chunked", "s3":
	default:
		return "", fmt.Errorf("snapshot store %q: want plain, chunked or s3", kind)
	}
	p := filepath.Join(dir, storeKindFile)
	b, err := os.ReadFile(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("data directory %s: %w", dir, err)
	}
	if lines := strings.Fields(string(b)); len(lines) > 0 {
		recorded := lines[0]
		switch recorded {
		case "plain", "chunked", "s3":
		default:
			return "", fmt.Errorf("%s: unknown snapshot store %q (want plain, chunked or s3)", p, recorded)
		}
		if kind != "" && kind != recorded {
			return "", fmt.Errorf("data directory %s is set up for --store %s (recorded in %s), and its snapshots are only reachable through it: start with --store %s or without --store, or use another --data-dir", dir, recorded, p, recorded)
		}
		if recorded == "s3" && (cfg.S3Bucket != "" || cfg.S3Prefix != "") {
			// A bucket or prefix left out is the record's (withRecordedS3).
			filled := withRecordedS3(dir, cfg)
			want := storeRecord(StoreConfig{Kind: "s3", S3Bucket: filled.S3Bucket, S3Prefix: filled.S3Prefix})
			if strings.Join(strings.Fields(want), " ") != strings.Join(lines, " ") {
				var given []string
				if cfg.S3Bucket != "" {
					given = append(given, fmt.Sprintf("--s3-bucket %q", cfg.S3Bucket))
				}
				if cfg.S3Prefix != "" {
					given = append(given, fmt.Sprintf("--s3-prefix %q", cfg.S3Prefix))
				}
				return "", fmt.Errorf("data directory %s is set up for S3 %s (recorded in %s); %s would put its snapshots out of reach (leave out --s3-bucket and --s3-prefix to use the recorded ones)", dir, strings.Join(lines[1:], " "), p, strings.Join(given, " "))
			}
		}
		return recorded, nil
	}
	if kind != "" {
		return kind, nil
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "snapshots")); len(ents) > 0 {
		return "plain", nil
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "chunks", "store", "manifests")); len(ents) > 0 {
		return "chunked", nil
	}
	if _, err := os.Stat(filepath.Join(dir, "chunks")); err == nil {
		return "", fmt.Errorf("data directory %s has a chunked store's local directory (chunks/) but no record of which store it belongs to (it predates %s): start once with --store chunked, or --store s3 and its bucket", dir, p)
	}
	return "chunked", nil
}

// withRecordedS3 returns cfg with the S3 bucket and the prefix recorded in
// dir/store in place of those cfg leaves empty (the endpoint and keys are not
// recorded).
func withRecordedS3(dir string, cfg StoreConfig) StoreConfig {
	if cfg.S3Bucket != "" && cfg.S3Prefix != "" {
		return cfg
	}
	b, err := os.ReadFile(filepath.Join(dir, storeKindFile))
	if err != nil {
		return cfg
	}
	lines := strings.Fields(string(b))
	if len(lines) == 0 || lines[0] != "s3" {
		return cfg
	}
	for _, l := range lines[1:] {
		if v, ok := strings.CutPrefix(l, "bucket="); ok && cfg.S3Bucket == "" {
			cfg.S3Bucket = v
		} else if v, ok := strings.CutPrefix(l, "prefix="); ok && cfg.S3Prefix == "" {
			cfg.S3Prefix = v
		}
	}
	return cfg
}

// hasStore says whether data directory dir holds a snapshot store: its kind
// record, or a plain or chunked store's directory.
func hasStore(dir string) bool {
	for _, p := range []string{storeKindFile, "snapshots", "chunks"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err == nil {
			return true
		}
	}
	return false
}

// recordStoreKind writes dir/store (temp file, fsync, rename) unless it holds
// a record already.
func recordStoreKind(dir string, cfg StoreConfig) error {
	p := filepath.Join(dir, storeKindFile)
	if b, err := os.ReadFile(p); err == nil && len(strings.Fields(string(b))) > 0 {
		return nil
	}
	if err := atomicfile.WriteFile(p, []byte(storeRecord(cfg)), 0o644); err != nil {
		return fmt.Errorf("data directory %s: record the store kind: %w", dir, err)
	}
	return nil
}

// storeIDFile, in a data directory, holds the random id with which its
// store claims an S3 prefix (chunked.Owner).
const storeIDFile = "store-id"

// storeID returns the data directory's store id (32 hex digits), creating
// dir/store-id (temp file, fsync, rename) on first use.
func storeID(dir string) (string, error) {
	p := filepath.Join(dir, storeIDFile)
	if b, err := os.ReadFile(p); err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return strings.TrimSpace(string(b)), nil
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("data directory %s: %w", dir, err)
	}
	var raw [16]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	id := hex.EncodeToString(raw[:])
	if err := atomicfile.WriteFile(p, []byte(id+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("data directory %s: record the store id: %w", dir, err)
	}
	return id, nil
}

// OpenStore opens the snapshot store a server with data directory dataDir and
// store configuration cfg uses, without background collection, for tools that
// inspect or verify snapshots next to a running server (read-only use only).
func OpenStore(ctx context.Context, dataDir string, cfg StoreConfig) (snapshot.Store, func() error, error) {
	// A server's directory has its SQLite file, or with its metadata in
	// PostgreSQL at least the lock file every server writes.
	if _, err := os.Stat(filepath.Join(dataDir, "torpor.db")); err != nil {
		if _, lerr := os.Stat(filepath.Join(dataDir, "lock")); lerr != nil {
			return nil, nil, fmt.Errorf("%s is not a torpor data directory (no torpor.db, no lock): %w", dataDir, err)
		}
	}
	kind, err := ResolveStoreKind(dataDir, cfg)
	if err != nil {
		return nil, nil, err
	}
	if !hasStore(dataDir) {
		// Opening would create the store's directories, and the next server
		// would take them for a store of unknown kind.
		return nil, nil, fmt.Errorf("data directory %s has no snapshot store yet (no %s record, no snapshots/ or chunks/): nothing to read", dataDir, storeKindFile)
	}
	cfg = withRecordedS3(dataDir, cfg)
	cfg.Kind = kind
	if cfg.Kind != "plain" {
		cfg.CacheBytes = -1 // the running server owns the cache (and the uploads)
		cfg.readOnly = true
	}
	return openStore(ctx, dataDir, cfg, slog.Default(), false)
}

// openStore opens the configured snapshot store (cfg.Kind resolved by
// ResolveStoreKind); closeFn stops its background work.
func openStore(ctx context.Context, dataDir string, cfg StoreConfig, log *slog.Logger, autoGC bool) (snapshot.Store, func() error, error) {
	nop := func() error { return nil }
	key, oldKeys, err := cfg.loadKeys()
	if err != nil {
		return nil, nil, err
	}
	if err := cfg.checkKind(); err != nil {
		return nil, nil, err
	}
	switch cfg.Kind {
	case "plain":
		s, err := local.New(filepath.Join(dataDir, "snapshots"))
		return s, nop, err
	case "chunked", "local":
		s, err := chunked.New(ctx, chunked.Config{Dir: filepath.Join(dataDir, "chunks"), AutoGC: autoGC, OpenBytes: cfg.openBytes(),
			Logger: log, ReadOnly: cfg.readOnly, UploadRetry: cfg.UploadRetry, Key: key, OldKeys: oldKeys,
			DeferFirstCommits: !cfg.SyncFirstCommits})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot store: %w", err)
		}
		return s, s.Close, nil
	case "s3":
		var owner *chunked.Owner
		var lock chunked.CollectLock
		if !cfg.readOnly {
			id, err := storeID(dataDir)
			if err != nil {
				return nil, nil, err
			}
			host, _ := os.Hostname()
			abs, _ := filepath.Abs(dataDir)
			owner = &chunked.Owner{StoreID: id, Host: host, DataDir: abs}
			if cfg.collectLock != nil {
				lock = cfg.collectLock(id)
			}
		}
		b, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: cfg.S3Endpoint, Bucket: cfg.S3Bucket,
			AccessKey: cfg.S3AccessKey, SecretKey: cfg.S3SecretKey, Region: cfg.S3Region, Prefix: cfg.S3Prefix,
			PathStyle: !cfg.S3VirtualHost, Owner: owner})
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
			CacheBytes: cache, OpenBytes: cfg.openBytes(), AutoGC: autoGC, Logger: log, ReadOnly: cfg.readOnly, UploadRetry: cfg.UploadRetry,
			Key: key, OldKeys: oldKeys, CollectLock: lock})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot store: %w", err)
		}
		return s, s.Close, nil
	default:
		return nil, nil, fmt.Errorf("snapshot store %q: want plain, chunked or s3", cfg.Kind)
	}
}

// checkKind refuses the options c's resolved Kind cannot have: the plain
// store has no durable tier (AsyncUpload) and keeps the engine's files as
// they are (KeyFile, OldKeyFiles).
func (c StoreConfig) checkKind() error {
	if c.Kind != "plain" {
		return nil
	}
	if c.AsyncUpload {
		return fmt.Errorf("snapshot store plain: --async-upload needs --store chunked or s3 (the plain store has no durable tier to upload to)")
	}
	if c.KeyFile != "" || len(c.OldKeyFiles) > 0 {
		return fmt.Errorf("snapshot store plain: --snapshot-key needs --store chunked or s3 (the plain store keeps the engine's files as they are)")
	}
	return nil
}

// checkStoreConfig checks cfg against data directory dir without writing
// anything, so that a refused configuration leaves no data directory (or
// database, or store) behind: the store kind (ResolveStoreKind, which only
// reads dir's record), the options the kind cannot have (checkKind), and the
// key files (loadKeys).
func checkStoreConfig(dir string, cfg StoreConfig) error {
	cfg = withRecordedS3(dir, cfg)
	kind, err := ResolveStoreKind(dir, cfg)
	if err != nil {
		return err
	}
	cfg.Kind = kind
	if err := cfg.checkKind(); err != nil {
		return err
	}
	_, _, err = cfg.loadKeys()
	return err
}

// loadKeys reads KeyFile and OldKeyFiles (chunked.LoadKey); nil without
// KeyFile. Errors name the file.
func (c StoreConfig) loadKeys() (key *chunked.Key, old []*chunked.Key, err error) {
	if c.KeyFile != "" {
		if key, err = chunked.LoadKey(c.KeyFile); err != nil {
			return nil, nil, err
		}
	}
	for _, p := range c.OldKeyFiles {
		k, err := chunked.LoadKey(p)
		if err != nil {
			return nil, nil, err
		}
		old = append(old, k)
	}
	return key, old, nil
}

// openBytes maps StoreConfig.OpenBytes to chunked.Config.OpenBytes (0 = no bound).
func (c StoreConfig) openBytes() int64 {
	switch {
	case c.OpenBytes == 0:
		return 20 << 30
	case c.OpenBytes < 0:
		return 0
	}
	return c.OpenBytes
}
