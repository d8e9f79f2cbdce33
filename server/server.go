// Package server is torpor's HTTP server: REST API v1 (apiv1), the port proxy that
// wakes hibernated sandboxes, /healthz and Prometheus /metrics, with API keys
// required or not (Config.Auth, auth.go; the keys are package apikey's). It wires the
// embedded defaults — SQLite metadata (or PostgreSQL: Config.Database), the local
// snapshot store, the image store, the gVisor engine — into a sandbox manager,
// registers the host as a node (Config.Node) and serves it.
//
// Data directory layout (default /var/lib/torpor):
//
//	torpor.db        metadata (SQLite; none with Config.Database PostgreSQL)
//	store            the snapshot store kind the directory was set up with
//	images/          content-addressed EROFS images
//	chunks/          snapshot store (default): packs, manifests, opened snapshots, cache
//	snapshots/       plain-file snapshots (--store plain), one directory each
//	guest/<sha256>/  guest agent binaries, mounted read-only at /.torpor
//	gvisor/          runsc state, bundles and logs
//	e2b-secret       the key of the E2B envdAccessTokens' HMAC (api/e2b.LoadSecret)
//	heartbeat, watchdog.lock, watchdog.log
//	                 with a PostgreSQL Database: the node's watchdog's (package watchdog)
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/watchdog"
)

// Config configures a server.
type Config struct {
	// DataDir holds everything the server keeps (default /var/lib/torpor).
	DataDir string
	// Database is the metadata database: "" for SQLite in DataDir/torpor.db,
	// or a postgres:// URL (OpenDatabase). With PostgreSQL the data
	// directory still holds images, snapshots and engine state.
	Database string
	// Node is the name the server registers as a node in the database
	// (default: the host name, node.DefaultName); Advertise the base URL of
	// its API for other nodes and operators (default http://<Listen>, or
	// https:// with TLSCert, the host's name for an address on all
	// interfaces).
	Node      string
	Advertise string
	// Listen is the API address (default 127.0.0.1:7070). New reads it only
	// to resolve Auth and the node's default Advertise; Run listens on it.
	Listen string
	// Auth says whether REST v1, the port proxy and /metrics require an API
	// key (default AuthAuto: required unless Listen is a loopback address;
	// see ResolveAuth).
	Auth AuthMode
	// RunscPath is the runsc binary; AgentPath the static guest agent binary.
	RunscPath string
	AgentPath string
	Logger    *slog.Logger
	// ImageCache is the host-wide image build cache ("" = image.BuildCacheFromEnv()).
	ImageCache string
	// Engines, when set, are the host's engines instead of the gVisor engine the
	// server makes on RunscPath with its state in <data dir>/gvisor (tests wrap
	// that engine, see servertest).
	Engines *engine.Registry
	// Store selects the snapshot store (default: the data directory's recorded
	// kind, chunked for a new one; see StoreConfig and ResolveStoreKind).
	Store StoreConfig
	// IdleCPUThreshold is the CPU use (fraction of one core) below which a sandbox
	// counts as idle (default 0.05); LifecycleInterval how often the idle and
	// timeout loop checks (default 1 s). DisableLifecycle turns the loop off (no
	// idle hibernation, no run timeouts; servertest's default).
	IdleCPUThreshold  float64
	LifecycleInterval time.Duration
	DisableLifecycle  bool
	// StandbyMemoryMiB is the budget of paused sandboxes, in MiB of their
	// memory limits; beyond it the ones paused longest are hibernated
	// (manager.LifecycleConfig). 0 = no budget.
	StandbyMemoryMiB int
	// ResumeHookDeadline and ResumeAckDeadline bound each user resume hook and the
	// wait for in-sandbox subscribers (see manager.Config; defaults 10 s and 5 s).
	ResumeHookDeadline time.Duration
	ResumeAckDeadline  time.Duration
	// E2B configures the E2B-compatible API served beside API v1 (api/e2b).
	E2B E2BConfig
	// TLSCert and TLSKey, when set, are the PEM files of the certificate
	// chain and private key Run serves HTTPS with (CertReloader: reloaded on
	// SIGHUP); both or neither.
	TLSCert string
	TLSKey  string
	// Limits are the sandboxes' limits and the host's admission control
	// (manager.LimitsConfig: pids per sandbox, memory overcommit).
	Limits manager.LimitsConfig
	// Egress is the uplink sandbox traffic leaves through (docs/security.md,
	// "Network egress"); nil = none, and no sandbox reaches anything outside
	// itself. Listen's address, when it is a specific one, is added to the
	// addresses no sandbox reaches.
	Egress *sandboxnet.EgressConfig
	// Executable is the torpor binary whose hidden `serve-watchdog` command
	// runs the node's watchdog (package watchdog), started with a
	// PostgreSQL Database when the server makes its own gVisor engine
	// (Engines nil); default os.Executable().
	Executable string
	// PreparedContainers is how many containers the gVisor engine keeps
	// created ahead of time for resumes (gvisor.Config.PreparedContainers;
	// docs/operations.md); 0 = none. Unused with Engines set.
	PreparedContainers int
	// SpareNetworks is how many pairs of network namespaces the gVisor
	// engine keeps made ahead of time for creates and resumes
	// (gvisor.Config.SpareNetworks; docs/operations.md); 0 = none. Unused
	// with Engines set.
	SpareNetworks int
	// BackgroundRestore passes --background to runsc restore
	// (gvisor.Config.BackgroundRestore): for a runsc built with
	// `make runsc-readers` (docs/decisions/patched-runsc.md); off by
	// default. Unused with Engines set.
	BackgroundRestore bool
	// StreamColdResumes resumes a sandbox whose snapshot has no copy on this
	// host while the chunked store fetches it, served through FUSE
	// (manager.Config.StreamColdResumes; docs/snapshot-store.md); off by
	// default.
	StreamColdResumes bool
}

// E2BConfig configures the E2B-compatible API (docs/e2b.md).
type E2BConfig struct {
	// Domain routes in-sandbox requests by host name ("<port>-<sandboxID>.<Domain>")
	// and is the create answer's domain; "" = header routing only.
	Domain string
}

// Server is a torpor server with its parts opened.
type Server struct {
	Manager *manager.Manager
	Images  *image.Store
	// Engines are the host's engines (gvisor today); Engine is their default,
	// which starts new sandboxes.
	Engines *engine.Registry
	Engine  engine.Engine
	// StoreKind is the snapshot store in use: chunked, s3 or plain.
	StoreKind  string
	db         metadata.Store
	log        *slog.Logger
	reg        *prometheus.Registry
	closeStore func() error
	lock       *os.File // the data directory's flock (lockDataDir)
	dataDir    string   // Config.DataDir, named in the answers of a full disk
	stopLC     func()   // stops the lifecycle loop and waits for it
	// stopCluster stops the cluster loop (clusterLoop) and waits for it.
	stopCluster func()
	heartbeat   *node.Heartbeat
	node        string // the node's name
	handler     http.Handler
	ingress     *ingress.Proxy // the port proxy's and E2B's forwarding to sandboxes
	e2b         *e2b.Service
	cluster     *clusterFront // forwarding between nodes (nil with SQLite: one node)
	fence       selfFence     // self-fencing (with cluster; selffence.go)
	// locker keeps the node's lock in a shared database (nil with SQLite);
	// fatal receives the error a server that lost it to another server
	// exits with (Run).
	locker serverLocker
	fatal  chan error
	// watchdog is the node's watchdog (cluster mode with the server's own
	// gVisor engine; nil otherwise): released by Close.
	watchdog *watchdog.Handle

	// AuthRequired says whether requests need an API key (Config.Auth resolved).
	AuthRequired bool
	keys         *apikey.Verifier
	idem         idempotency // idempotent creates and forks (idempotency.go)
}

// New opens the data directory, reconciles the host with the database (see
// manager.Reconcile) and returns a server ready to serve. Errors name the part
// that failed (database, runsc, agent binary).
// defaultLogger is the server's log without Config.Logger: slog's text
// format on stderr.
func defaultLogger() *slog.Logger { return slog.New(slog.NewTextHandler(os.Stderr, nil)) }

// ErrorLog is a *log.Logger for the net/http parts that take one
// (http.Server.ErrorLog, httputil.ReverseProxy.ErrorLog: TLS handshake
// errors, a proxied body cut): their lines go to the server's slog logger
// at level WARN, in its format, instead of Go's plain log format.
func (s *Server) ErrorLog() *log.Logger { return slog.NewLogLogger(s.log.Handler(), slog.LevelWarn) }

func New(ctx context.Context, cfg Config) (*Server, error) {
	authRequired, err := ResolveAuth(cfg.Auth, cfg.Listen)
	if err != nil {
		return nil, err
	}
	tuneGC()
	if cfg.DataDir == "" {
		cfg.DataDir = "/var/lib/torpor"
	}
	if cfg.Logger == nil {
		cfg.Logger = defaultLogger()
	}
	dir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	// What can be checked without writing is checked before the data
	// directory is made or touched.
	if cfg.Node == "" {
		cfg.Node = node.DefaultName()
	}
	if err := node.CheckName(cfg.Node); err != nil {
		return nil, err
	}
	if cfg.Advertise != "" {
		if err := CheckAdvertise(cfg.Advertise); err != nil {
			return nil, err
		}
	}
	if err := checkStoreConfig(dir, cfg.Store); err != nil {
		return nil, err
	}
	// A data directory this start makes is removed again if the start fails
	// (a database that cannot be reached, a refused node lock, …): a refused
	// start leaves none behind.
	_, statErr := os.Stat(dir)
	made := errors.Is(statErr, fs.ErrNotExist)
	unmake := func() {
		if made {
			os.RemoveAll(dir)
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("data dir %s: %w", dir, err)
	}
	lock, err := lockDataDir(dir)
	if err != nil {
		unmake()
		return nil, err
	}
	db, err := openServerDatabase(ctx, dir, cfg.Database, cfg.Node)
	if err != nil {
		lock.Close()
		unmake()
		return nil, err
	}
	var closeStore func() error
	fail := func(err error) (*Server, error) {
		if closeStore != nil {
			closeStore()
		}
		db.Close()
		lock.Close()
		unmake()
		return nil, err
	}
	images, err := image.Open(filepath.Join(dir, "images"), db)
	if err != nil {
		return fail(err)
	}
	if cfg.ImageCache == "" {
		cfg.ImageCache = image.BuildCacheFromEnv()
	}
	images.SetBuildCache(cfg.ImageCache)
	cfg.Store = withRecordedS3(dir, cfg.Store)
	if cfg.Store.Kind, err = ResolveStoreKind(dir, cfg.Store); err != nil {
		return fail(err)
	}
	// On a shared database (several nodes, one bucket prefix) the nodes'
	// stores collect chunks one at a time and never during another's
	// commit, under an advisory lock of the store id (chunked.CollectLock);
	// each node's index follows the others' collections before it commits or
	// opens a snapshot from the bucket (docs/snapshot-store.md).
	if pg, ok := db.(*postgres.DB); ok {
		cfg.Store.collectLock = func(id string) chunked.CollectLock { return pg.CollectLock(id) }
	}
	store, cs, err := openStore(ctx, dir, cfg.Store, cfg.Logger, true)
	if err != nil {
		return fail(err)
	}
	closeStore = cs
	if bucket, err := openImageBucket(ctx, cfg.Store, cfg.Logger); err != nil {
		return fail(err)
	} else if bucket != nil {
		images.SetBucket(bucket)
	}
	if ks, ok := store.(interface{ KeyID() string }); ok && ks.KeyID() != "" {
		cfg.Logger.Info("snapshot store: new snapshots are encrypted at rest", "key_id", ks.KeyID(), "old_keys", len(cfg.Store.OldKeyFiles))
	}
	if err := recordStoreKind(dir, cfg.Store); err != nil {
		return fail(err)
	}
	engines := cfg.Engines
	if engines == nil {
		if engines, err = defaultEngines(dir, cfg.RunscPath, egressFor(cfg), gvisor.Config{PreparedContainers: cfg.PreparedContainers,
			SpareNetworks: cfg.SpareNetworks, BackgroundRestore: cfg.BackgroundRestore}); err != nil {
			return fail(err)
		}
	}
	if p, ok := engines.Default().(engine.EgressProvider); ok && cfg.Egress != nil {
		if dns, err := p.Resolver(); err == nil && !dns.IsValid() {
			cfg.Logger.Warn("egress: no resolver: the uplink has no IPv4 nameserver; sandboxes reach addresses but resolve no names until torpor serve --dns names one")
		} else if err == nil {
			cfg.Logger.Info("egress", "uplink_netns", cfg.Egress.UplinkNetns, "uplink", cfg.Egress.UplinkIface, "resolver", dns)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mgr, err := manager.New(manager.Config{
		Engines: engines, Store: store, DB: db, Images: images,
		GuestDir: filepath.Join(dir, "guest"), AgentPath: cfg.AgentPath,
		Logger: cfg.Logger, Metrics: manager.NewMetrics(reg),
		Lifecycle: manager.LifecycleConfig{IdleCPUThreshold: cfg.IdleCPUThreshold, CheckInterval: cfg.LifecycleInterval,
			VolumesDir: filepath.Join(dir, "volumes"), StandbyMemoryMiB: cfg.StandbyMemoryMiB},
		ResumeHookDeadline: cfg.ResumeHookDeadline, ResumeAckDeadline: cfg.ResumeAckDeadline,
		AsyncUpload: cfg.Store.AsyncUpload, StreamColdResumes: cfg.StreamColdResumes,
		Limits: cfg.Limits,
		Node:   cfg.Node, SingleNode: cfg.Database == "",
	})
	if err != nil {
		return fail(err)
	}
	reg.MustRegister(manager.NewStateCollector(mgr), manager.NewStoreCollector(mgr))
	var heartbeat *node.Heartbeat
	var wd *watchdog.Handle
	failStarted := fail
	fail = func(err error) (*Server, error) {
		if heartbeat != nil {
			heartbeat.Stop()
		}
		if wd != nil {
			wd.Release(false) // it stops what is left at the self-fence time
		}
		return failStarted(err)
	}
	if cfg.Database != "" {
		// A cluster node registers (and is watched) before it reattaches
		// anything: startWatchedNode.
		if heartbeat, wd, err = startWatchedNode(ctx, db, mgr, cfg, dir); err != nil {
			return fail(err)
		}
	}
	if err := mgr.Reconcile(ctx); err != nil {
		return fail(err)
	}
	if heartbeat == nil {
		if heartbeat, err = startNode(ctx, db, mgr, cfg, nil); err != nil {
			return fail(err)
		}
	}
	s := &Server{Manager: mgr, Images: images, Engines: engines, Engine: engines.Default(), StoreKind: cfg.Store.Kind, db: db, log: cfg.Logger, reg: reg, closeStore: closeStore, lock: lock, dataDir: cfg.DataDir,
		heartbeat: heartbeat, node: heartbeat.Name(), fatal: make(chan error, 1), watchdog: wd,
		AuthRequired: authRequired, keys: apikey.NewVerifier(db, apikey.Config{Logger: cfg.Logger}), idem: idempotency{db: db}}
	secretPath := filepath.Join(dir, "e2b-secret")
	secret, err := e2b.LoadSecret(secretPath)
	if err != nil {
		return fail(err)
	}
	if cfg.Database != "" {
		if secret, err = e2b.ShareSecret(ctx, db, secretPath, secret); err != nil {
			return fail(err)
		}
	}
	s.ingress = ingress.New(s.ErrorLog())
	var e2bKeys *apikey.Verifier
	if authRequired {
		e2bKeys = s.keys
	}
	if s.e2b, err = e2b.New(e2b.Config{Manager: mgr, Images: images, Keys: e2bKeys, Secret: secret,
		Domain: cfg.E2B.Domain, Ingress: s.ingress, Logger: cfg.Logger, Refer: s.refer}); err != nil {
		return fail(err)
	}
	s.handler = s.routes()
	if authRequired {
		s.handler = s.requireKeys(s.handler)
		if keys, err := db.ListAPIKeys(ctx); err == nil && len(keys) == 0 {
			where := "--data-dir " + dir
			if cfg.Database != "" {
				where = "--database URL (or TORPOR_DATABASE)"
			}
			cfg.Logger.Warn("API keys are required and there is none: every call but /healthz is refused until one is made with `torpor key create " + where + "`")
		}
	}
	// In-sandbox requests (E2B's routing) reach the sandbox whatever their
	// path, /v1/… included; the E2B front checks their envd access token.
	s.handler = s.e2b.Front(s.handler)
	if cfg.Database != "" {
		s.cluster = &clusterFront{s: s, domain: cfg.E2B.Domain}
		inner := s.handler
		s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.cluster.ServeHTTP(w, r, inner) })
	}
	s.stopLC = startLifecycle(mgr, cfg.DisableLifecycle)
	if s.cluster != nil {
		stop, done := make(chan struct{}), make(chan struct{})
		fenceDone, lockDone := make(chan struct{}), make(chan struct{})
		s.locker, _ = db.(serverLocker)
		go func() { defer close(done); s.clusterLoop(stop) }()
		go func() { defer close(fenceDone); s.selfFenceLoop(stop) }()
		go func() { defer close(lockDone); s.nodeLockLoop(stop) }()
		s.stopCluster = func() { close(stop); <-done; <-fenceDone; <-lockDone }
	}
	return s, nil
}

// egressFor is cfg.Egress with the API's listen address among the refused
// ones (nil without an uplink).
func egressFor(cfg Config) *sandboxnet.EgressConfig {
	if cfg.Egress == nil {
		return nil
	}
	eg := *cfg.Egress
	eg.Refuse = slices.Clone(eg.Refuse)
	if host, _, err := net.SplitHostPort(cfg.Listen); err == nil {
		if a, err := netip.ParseAddr(host); err == nil && a.Is4() && !a.IsUnspecified() && !a.IsLoopback() {
			eg.Refuse = append(eg.Refuse, netip.PrefixFrom(a, 32))
		}
	}
	return &eg
}

// DefaultEngines returns the engines of a server on data directory dir: gVisor
// with runsc at runscPath, its state in dir/gvisor, sandbox traffic leaving
// through egress (nil: none). Errors: runsc missing or not executable,
// dir/gvisor not writable, a bad uplink (sandboxnet.NewEgress).
func DefaultEngines(dir, runscPath string, egress *sandboxnet.EgressConfig) (*engine.Registry, error) {
	return defaultEngines(dir, runscPath, egress, gvisor.Config{})
}

// defaultEngines is DefaultEngines whose gVisor engine takes the restore
// options of opts (its PreparedContainers, SpareNetworks and
// BackgroundRestore; the other fields are set here).
func defaultEngines(dir, runscPath string, egress *sandboxnet.EgressConfig, opts gvisor.Config) (*engine.Registry, error) {
	gv, err := gvisor.New(gvisor.Config{Runsc: runscPath, StateDir: filepath.Join(dir, "gvisor"), Egress: egress,
		PreparedContainers: opts.PreparedContainers, SpareNetworks: opts.SpareNetworks, BackgroundRestore: opts.BackgroundRestore})
	if err != nil {
		return nil, err
	}
	return engine.NewRegistry(gv.Name(), gv)
}

// CloseIdleEngines releases the host mounts of every engine that has no
// instance left (io.Closer engines; gVisor unmounts runsc's null-netns file).
// Engines with instances are left alone: the next server reattaches them.
func (s *Server) CloseIdleEngines(ctx context.Context) {
	for _, e := range s.Engines.All() {
		c, ok := e.(io.Closer)
		if !ok {
			continue
		}
		if infos, err := e.List(ctx); err == nil && len(infos) == 0 {
			c.Close()
		}
	}
}

// Keys returns the API keys' records (the server's metadata store), for
// callers that make keys in process (tests; `torpor key` opens the database
// itself).
func (s *Server) Keys() metadata.Keys { return s.db }

// Verifier returns the server's key verifier (one cache and one set of
// failure limits for every API on the server): another surface on the same
// server wraps its handlers with Verifier().Require when AuthRequired.
func (s *Server) Verifier() *apikey.Verifier { return s.keys }

// Handler returns the HTTP handler of the API.
func (s *Server) Handler() http.Handler { return s.handler }

// Close closes the database. Running sandboxes keep running; the next server on
// the same data directory reattaches them — on a shared database only if it
// heartbeats within node.SelfFenceAfter of this server's last heartbeat, else
// the watchdog stops them (released here; it exits at once when no instance is
// left). Prepared containers are removed (manager.DiscardPrepared).
func (s *Server) Close() error {
	if s.stopLC != nil {
		s.stopLC()
	}
	if s.stopCluster != nil {
		s.stopCluster()
	}
	s.Manager.Wait()
	s.Manager.DiscardPrepared(context.Background())
	if s.heartbeat != nil {
		s.heartbeat.Stop()
	}
	if s.watchdog != nil {
		s.watchdog.Release(s.noInstances(context.Background()))
	}
	if s.closeStore != nil {
		s.closeStore()
	}
	err := s.db.Close()
	s.lock.Close()
	return err
}

// noInstances says whether no engine lists an instance (false when one
// cannot list).
func (s *Server) noInstances(ctx context.Context) bool {
	for _, e := range s.Engines.All() {
		if infos, err := e.List(ctx); err != nil || len(infos) > 0 {
			return false
		}
	}
	return true
}

// lockDataDir takes the data directory's lock: an exclusive flock(2) on the
// directory itself (so deleting a file cannot undo it), held until the returned
// file is closed or the process ends; the holder's pid is written to DIR/lock
// for the message a second server gets. One server per data directory: a
// second one would reattach the first one's sandboxes and run their lifecycles
// twice. Errors: the directory is locked by another process (naming the pid in
// DIR/lock), or it cannot be opened.
func lockDataDir(dir string) (*os.File, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("data dir %s: lock: %w", dir, err)
	}
	pidFile := filepath.Join(dir, "lock")
	if err := syscall.Flock(int(d.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		d.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder, _ := os.ReadFile(pidFile)
			pid := strings.TrimSpace(string(holder))
			if pid == "" {
				pid = "unknown"
			}
			return nil, fmt.Errorf("data dir %s is in use by another torpor server (pid %s); stop it or use another --data-dir", dir, pid)
		}
		return nil, fmt.Errorf("data dir %s: lock: %w", dir, err)
	}
	// Replaced whole (written aside, renamed over): a server refused meanwhile
	// reads the old pid or the new one, never an empty file (a trial saw
	// "pid unknown" with an in-place rewrite).
	tmp := pidFile + ".new"
	if err := os.WriteFile(tmp, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err == nil {
		_ = os.Rename(tmp, pidFile)
	}
	return d, nil
}

// serverGCPercent is the garbage collector's GOGC for the server process when
// the environment sets none. The server's heap is small (the manifests it
// keeps in memory, request buffers), and at Go's default of 100 a collection
// ran during most hibernate commits: with 400, a 64 MiB sandbox's diff
// commit took 29–34 ms instead of 34–38 ms and its diff hibernate went from
// 0.93–1.02 to 1.02–1.11 GiB/s (bench.BenchmarkStore, two runs each,
// interleaved, 2026-12-01). GOGC and GOMEMLIMIT in the environment win.
const serverGCPercent = 400

// tuneGC sets serverGCPercent unless GOGC is set in the environment.
func tuneGC() {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(serverGCPercent)
	}
}

// Run serves the API on cfg.Listen until ctx ends, then shuts down gracefully
// (in-flight requests get 10 s). It listens before New sets up the data
// directory: an address it cannot listen on (in use) is an error with nothing
// created there. With cfg.TLSCert and cfg.TLSKey it serves HTTPS and loads
// the pair again on every SIGHUP (a pair that fails to load is logged and
// the previous certificate kept). On a shared database it also ends, with
// an error wrapping postgres.ErrLocked, when another server took this
// node's lock while this one had lost it (docs/multi-host.md#one-server-per-node),
// and with an error naming the URL when its advertised URL does not reach
// it within advertiseCheckFor of serving (checkAdvertise). A Listen port 0
// is the port the kernel picked in the default advertised URL.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:7070"
	}
	if cfg.Logger == nil {
		// Before the certificate reloader, which would log through
		// slog.Default (Go's plain log format) without one.
		cfg.Logger = defaultLogger()
	}
	// The address first: a server that cannot listen (the port is taken)
	// fails before it creates or changes anything in the data directory.
	if _, err := ResolveAuth(cfg.Auth, cfg.Listen); err != nil {
		return err
	}
	var certs *CertReloader
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		var err error
		if certs, err = NewCertReloader(cfg.TLSCert, cfg.TLSKey, cfg.Logger); err != nil {
			return err
		}
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	defer ln.Close()
	if host, port, err := net.SplitHostPort(cfg.Listen); err == nil && port == "0" {
		// A port the kernel picked: the default advertised URL names it.
		_, port, _ = net.SplitHostPort(ln.Addr().String())
		cfg.Listen = net.JoinHostPort(host, port)
	}
	if certs != nil {
		stop := reloadOnSIGHUP(certs)
		defer stop()
	}
	s, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	var stopping time.Time // when the shutdown began
	defer func() {         // after Close: the store, the database and the data directory's lock are released
		if !stopping.IsZero() {
			s.log.Info("stopped", "shutdown_ms", time.Since(stopping).Milliseconds())
		}
	}()
	defer s.Close()
	scope := ""
	if hs, ok := s.Engine.(engine.HostScoper); ok {
		scope = hs.HostScope()
	}
	auth := "none"
	if s.AuthRequired {
		auth = "required"
	}
	scheme := "http"
	hs := &http.Server{Handler: s.handler, ReadHeaderTimeout: 30 * time.Second, ErrorLog: s.ErrorLog()}
	if certs != nil {
		scheme = "https"
		hs.TLSConfig = certs.TLSConfig()
		hs.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){} // HTTP/1.1 only
	}
	s.log.Info("torpor serving", "addr", ln.Addr().String(), "scheme", scheme, "data_dir", cfg.DataDir, "engine", s.Engine.Version(), "scope", scope, "store", s.StoreKind, "auth", auth, "restores", s.Manager.Restores())
	errc := make(chan error, 1)
	go func() {
		if certs != nil {
			errc <- hs.ServeTLS(ln, "", "")
			return
		}
		errc <- hs.Serve(ln)
	}()
	// A cluster server checks, now that it serves, that its advertised URL
	// reaches it: the other nodes forward calls there (checkAdvertise). One
	// that never does stops as it stops otherwise (its node's lock and
	// registration given up, its watchdog released).
	if cfg.Database != "" {
		cctx, stopCheck := context.WithCancel(ctx) // ends with Run
		defer stopCheck()
		go func() {
			switch err := s.checkAdvertise(cctx, nodeAdvertise(cfg)); {
			case cctx.Err() != nil:
			case err != nil:
				select {
				case s.fatal <- err:
				default: // already ending for another reason
				}
			default:
				s.log.Info("cluster: the advertised URL reaches this server", "advertise", nodeAdvertise(cfg))
			}
		}()
	}
	var fatal error // this server is no longer its node (nodeLockTaken), or its URL is not its own
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	case fatal = <-s.fatal:
	}
	stopping = time.Now()
	s.log.Info("shutting down: no new calls; waiting for those in flight (up to 10 s) and for the starts of fork clones")
	// No idle pause, hibernate or pool refill begins from now on.
	if s.stopLC != nil {
		s.stopLC()
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	// Sandboxes keep running across a restart (the next server reattaches them);
	// only when none is left does the engine release its host mounts, once
	// the prepared containers are gone.
	s.Manager.Wait()
	s.Manager.DiscardPrepared(context.Background())
	s.CloseIdleEngines(context.Background())
	return fatal
}

// reloadOnSIGHUP reloads certs on every SIGHUP until the returned stop is
// called.
func reloadOnSIGHUP(certs *CertReloader) (stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-hup:
				_ = certs.Reload()
			case <-done:
				return
			}
		}
	}()
	return func() { signal.Stop(hup); close(done) }
}
