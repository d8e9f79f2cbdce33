package cli

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/bench"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/quickstart"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/watchdog"
)

// serveConfig is what `torpor serve` hands to server.Run (see serve.go).
type serveConfig struct {
	DataDir string
	// Database is the metadata database ("" = SQLite in DataDir, or a
	// postgres:// URL; server.Config.Database).
	Database  string
	Listen    string
	RunscPath string
	AgentPath string
	// IdleCPUThreshold: CPU use (fraction of one core) below which a sandbox is idle.
	IdleCPUThreshold float64
	// StandbyMemory is the --standby-memory flag: "auto", "0" or a size.
	StandbyMemory string
	// Store is the snapshot store: Kind chunked (filesystem; the default for a
	// new data directory), s3 (chunked, S3) or plain ("" = the kind the data
	// directory records), and the S3 connection (addStoreFlags).
	Store       server.StoreConfig
	CacheBytes  int64
	OpenBytes   int64
	AsyncUpload bool
	// Node and Advertise: the node's name and API URL (server.Config).
	Node      string
	Advertise string
	// E2BDomain routes E2B in-sandbox requests by host name (docs/e2b.md).
	E2BDomain string
	// Auth: required, none or auto (server.ResolveAuth).
	Auth string
	// TLSCert and TLSKey serve HTTPS (reloaded on SIGHUP).
	TLSCert, TLSKey string
	// PidsLimit is the sandboxes' default pids limit (-1: none);
	// MemoryOvercommit the admission ratio (manager.LimitsConfig).
	PidsLimit        int
	MemoryOvercommit float64
	// Restores bounds the resumes restoring at once
	// (manager.LimitsConfig.Restores: 0 the host's CPUs, -1 none).
	Restores int
	// UplinkNetns, Uplink, EgressPool and DNS: the sandboxes' way out
	// (docs/security.md, "Network egress"; egressConfig).
	UplinkNetns, Uplink, EgressPool, DNS string
	// PreparedContainers: server.Config's (docs/operations.md).
	PreparedContainers int
	// SpareNetworks: server.Config's.
	SpareNetworks int
	// BackgroundRestore: server.Config's (docs/decisions/patched-runsc.md).
	BackgroundRestore bool
	// StreamColdResumes: server.Config's (docs/snapshot-store.md).
	StreamColdResumes bool
}

// egressConfig is the uplink the flags name; nil when they name none.
// Errors are usage errors: both uplinks, a bad pool or resolver, --dns or
// --egress-pool without an uplink.
func (c serveConfig) egressConfig() (*sandboxnet.EgressConfig, error) {
	if c.UplinkNetns == "" && c.Uplink == "" {
		if c.DNS != "" || c.EgressPool != "" {
			return nil, usagef("--dns and --egress-pool need an uplink (--uplink-netns or --uplink)")
		}
		return nil, nil
	}
	if c.UplinkNetns != "" && c.Uplink != "" {
		return nil, usagef("give one of --uplink-netns and --uplink")
	}
	eg := &sandboxnet.EgressConfig{UplinkNetns: c.UplinkNetns, UplinkIface: c.Uplink}
	if c.EgressPool != "" {
		p, err := netip.ParsePrefix(c.EgressPool)
		if err != nil {
			return nil, usagef("--egress-pool %q: %v", c.EgressPool, err)
		}
		eg.Pool = p
	}
	if c.DNS != "" {
		a, err := netip.ParseAddr(c.DNS)
		if err != nil || !a.Is4() {
			return nil, usagef("--dns %q: want an IPv4 address", c.DNS)
		}
		eg.DNS = a
	}
	return eg, nil
}

func (a *app) serveCommand() *cobra.Command {
	var cfg serveConfig
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the torpor server (API, sandbox manager, engine)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cfg.RunscPath == "" {
				cfg.RunscPath = defaultRunsc()
			}
			if cfg.AgentPath == "" {
				cfg.AgentPath = defaultAgent()
			}
			fillS3Credentials(&cfg.Store)
			switch cfg.Store.Kind {
			case "", "plain", "chunked", "local":
			case "s3":
				if cfg.Store.S3Endpoint == "" || cfg.Store.S3Bucket == "" {
					return usagef("--store s3 needs --s3-endpoint and --s3-bucket")
				}
			default:
				return usagef("--store %q: want plain, chunked or s3", cfg.Store.Kind)
			}
			// An unknown mode, and none off loopback, are wrong command lines
			// (exit 2), found before anything is set up.
			if _, err := server.ResolveAuth(server.AuthMode(cfg.Auth), cfg.Listen); err != nil {
				return usageError{err}
			}
			if err := server.CheckDatabase(cfg.Database); err != nil {
				return usageError{err}
			}
			// --node '' is no name (not the default's host name), and an
			// --advertise given is checked as given: empty is refused too.
			if cfg.Node != "" || cmd.Flags().Changed("node") {
				if err := node.CheckName(cfg.Node); err != nil {
					return usageError{fmt.Errorf("--node: %w", err)}
				}
			}
			if cfg.Advertise != "" || cmd.Flags().Changed("advertise") {
				if err := server.CheckAdvertise(cfg.Advertise); err != nil {
					return usageError{err}
				}
			}
			if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
				return usagef("--tls-cert and --tls-key go together")
			}
			if cfg.PidsLimit != -1 && (cfg.PidsLimit < manager.MinPidsLimit || cfg.PidsLimit > manager.MaxPidsLimit) {
				return usagef("--pids-limit %d: want %d to %d, or -1 for none", cfg.PidsLimit, manager.MinPidsLimit, manager.MaxPidsLimit)
			}
			if cfg.SpareNetworks < 0 || cfg.SpareNetworks > maxSpareNetworks {
				return usagef("--spare-networks %d: want 0 (none) to %d", cfg.SpareNetworks, maxSpareNetworks)
			}
			if cfg.PreparedContainers < 0 || cfg.PreparedContainers > maxPreparedContainers {
				return usagef("--prepared-containers %d: want 0 (none) to %d", cfg.PreparedContainers, maxPreparedContainers)
			}
			if cfg.Restores < -1 {
				return usagef("--restores %d: want -1 (no bound), 0 (the host's CPUs) or a number of resumes", cfg.Restores)
			}
			if cfg.MemoryOvercommit <= 0 {
				return usagef("--memory-overcommit %g: want a ratio above 0 (1.0: the sandboxes' memory limits may add up to the host's memory)", cfg.MemoryOvercommit)
			}
			if _, err := cfg.egressConfig(); err != nil {
				return err
			}
			if cfg.AsyncUpload && cfg.Store.Kind == "plain" {
				return usagef("--async-upload needs --store chunked or s3 (the plain store has no durable tier to upload to)")
			}
			if (cfg.Store.KeyFile != "" || len(cfg.Store.OldKeyFiles) > 0) && cfg.Store.Kind == "plain" {
				return usagef("--snapshot-key and --snapshot-old-key need --store chunked or s3 (the plain store keeps the engine's files as they are)")
			}
			return runServe(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.DataDir, "data-dir", "/var/lib/torpor", "directory for images, snapshots and metadata")
	f.StringVar(&cfg.Database, "database", os.Getenv("TORPOR_DATABASE"), "metadata database: a PostgreSQL URL, postgres://user@host:port/dbname (password from PGPASSWORD or ~/.pgpass rather than the URL; docs/multi-host.md); default $TORPOR_DATABASE, else SQLite in the data directory")
	f.StringVar(&cfg.Node, "node", "", "the name this server registers as a node in the metadata database (default: the host name)")
	f.StringVar(&cfg.Advertise, "advertise", "", "the base URL of this server's API for other nodes and operators (default: http://<--listen>, with the host name for an address on all interfaces)")
	f.StringVar(&cfg.Listen, "listen", "127.0.0.1:7070", "address to serve the API on")
	f.StringVar(&cfg.RunscPath, "runsc", "", "path of runsc (default $TORPOR_RUNSC, else runsc in PATH, else the pinned one in .tools/ of the checkout)")
	f.StringVar(&cfg.AgentPath, "agent", "", "path of the torpor-agent binary (default $TORPOR_AGENT, else torpor-agent next to torpor)")
	f.Float64Var(&cfg.IdleCPUThreshold, "idle-cpu-threshold", 0.05, "CPU use, as a fraction of one core, below which a sandbox counts as idle (docs/lifecycle.md)")
	f.StringVar(&cfg.StandbyMemory, "standby-memory", "auto", "budget of paused sandboxes, counted at their memory limits (4GiB, 2048MiB); beyond it the ones paused longest are hibernated; auto = half of the host's memory, 0 = no budget (docs/lifecycle.md)")
	addStoreFlags(f, &cfg.Store, "snapshot store: chunked (deduplicated chunks in packs on this disk), s3 (chunks in an S3-compatible bucket, local cache) or plain (one plain file per snapshot file); default: the kind the data directory was set up with (recorded in DATA_DIR/store), chunked for a new one")
	f.StringVar(&cfg.Store.S3ImagePrefix, "s3-image-prefix", envOr("TORPOR_S3_IMAGE_PREFIX", server.DefaultImagePrefix), "with --store s3: key prefix in the bucket under which images are shared with every server on it (the same for all of them, whatever their --s3-prefix; docs/multi-host.md)")
	f.Int64Var(&cfg.CacheBytes, "cache-bytes", 10<<30, "size limit of the local chunk cache in front of S3, bytes (LRU; 0 disables)")
	f.BoolVar(&cfg.Store.SyncFirstCommits, "sync-first-commits", false, "with --store chunked: acknowledge a sandbox's first hibernate only once its chunks are stored (default: once the checkpoint's files are synced, the chunks stored in the background; docs/snapshot-store.md)")
	f.Int64Var(&cfg.OpenBytes, "open-bytes", 20<<30, "size limit of the opened copies (each live snapshot's files, uncompressed, kept for warm resumes and diff hibernates), bytes (LRU, after a minute unused; 0: no limit)")
	f.StringVar(&cfg.E2BDomain, "e2b-domain", "", "domain of E2B's in-sandbox host names, <port>-<sandbox id>.DOMAIN (sandbox.getHost; needs wildcard DNS to this server), sent to E2B's SDKs as the sandboxes' domain; empty: in-sandbox requests are routed by the E2b-Sandbox-Id/-Port headers only (E2B_SANDBOX_URL)")
	f.StringVar(&cfg.Auth, "auth", "auto", "API keys: required (REST v1, the port proxy and /metrics need Authorization: Bearer <key>; make keys with: torpor key create), none (only on a loopback --listen) or auto (required unless --listen is a loopback address)")
	f.StringVar(&cfg.TLSCert, "tls-cert", "", "PEM file of the certificate chain to serve HTTPS with (with --tls-key; reloaded on SIGHUP; for E2B's <port>-<id>.DOMAIN hosts a wildcard *.DOMAIN certificate, docs/security.md)")
	f.StringVar(&cfg.TLSKey, "tls-key", "", "PEM file of the private key of --tls-cert")
	f.IntVar(&cfg.PidsLimit, "pids-limit", manager.DefaultPidsLimit, "cap of the default pids limit of a sandbox (the processes and threads each user may have in it), which is one per 2 MiB of its memory limit (a create's pids_limit overrides it; -1: none)")
	f.Float64Var(&cfg.MemoryOvercommit, "memory-overcommit", 1.0, "admission control: create, resume and fork answer 503 (Retry-After) when the memory limits of the sandboxes holding memory would exceed the host's memory times this ratio")
	f.IntVar(&cfg.Restores, "restores", 0, "resumes of hibernated sandboxes that restore at once; the others wait their turn, still hibernated (torpor_resumes_waiting); a restore is CPU-bound, so a bound answers the first of many wakes sooner and the last no later; 0: the host's CPUs, -1: no bound (docs/operations.md)")
	f.IntVar(&cfg.SpareNetworks, "spare-networks", 0, "pairs of network namespaces kept made ahead of time, so that creates, resumes and fork clones rename one instead of making theirs; no process, no sandbox memory; 0: none (docs/operations.md)")
	f.IntVar(&cfg.PreparedContainers, "prepared-containers", defaultPreparedContainers, "containers kept created ahead of time so that resumes skip creating theirs (runsc create, network namespaces), one per recently hibernated or resumed shape (image, memory, limits, mounts, environment); each holds ~15 MiB of host memory, counted in admission control; 0: none (docs/operations.md)")
	f.BoolVar(&cfg.BackgroundRestore, "background-restore", false, "restore with runsc restore --background: a resumed sandbox runs while its memory pages load behind it; gains only with a runsc of fewer page readers (make runsc-readers; docs/decisions/patched-runsc.md), slower with the stock one")
	f.BoolVar(&cfg.StreamColdResumes, "stream-cold-resumes", false, "resume a sandbox whose snapshot is not on this host (evicted, or on another node) while the chunked store fetches it: its files are served through FUSE, a read waits only for its own bytes, the working set recorded at the last such resume first (needs root and /dev/fuse; pays with --background-restore; docs/snapshot-store.md)")
	f.BoolVar(&cfg.AsyncUpload, "async-upload", false, "hibernates that do not choose (idle, timeout, fork, API without async_upload) answer once the snapshot is on local disk and upload it in the background (snapshot durable: false until then)")
	f.StringVar(&cfg.UplinkNetns, "uplink-netns", "", "network namespace (a name under /run/netns) sandbox traffic leaves through, masqueraded; with neither this nor --uplink, sandboxes reach nothing outside themselves (docs/security.md, Network egress)")
	f.StringVar(&cfg.Uplink, "uplink", "", "interface of the host's own network namespace sandbox traffic leaves through, masqueraded behind its address (needs net.ipv4.ip_forward=1)")
	f.StringVar(&cfg.EgressPool, "egress-pool", "", "IPv4 prefix (/8 to /29) of the sandboxes' addresses on the uplink, a /30 each, unused by any network the uplink reaches (default "+sandboxnet.DefaultPool.String()+")")
	f.StringVar(&cfg.DNS, "dns", "", "IPv4 address of the resolver the sandboxes' /etc/resolv.conf names, reachable on port 53 whatever their rules (default: the uplink's first nameserver, from /etc/netns/NAME/resolv.conf or /etc/resolv.conf)")
	return cmd
}

func defaultRunsc() string {
	if p := os.Getenv("TORPOR_RUNSC"); p != "" {
		return p
	}
	if p, err := exec.LookPath("runsc"); err == nil {
		return p
	}
	// In a checkout, `make setup` builds the pinned runsc into .tools/ beside bin/.
	if exe, err := os.Executable(); err == nil {
		if m, _ := filepath.Glob(filepath.Join(filepath.Dir(exe), "..", ".tools", "runsc-*")); len(m) > 0 {
			return m[len(m)-1]
		}
	}
	return "runsc"
}

func defaultAgent() string {
	if p := os.Getenv("TORPOR_AGENT"); p != "" {
		return p
	}
	if exe, err := os.Executable(); err == nil {
		if resolved, err := filepath.EvalSymlinks(exe); err == nil {
			exe = resolved
		}
		return filepath.Join(filepath.Dir(exe), "torpor-agent")
	}
	return "torpor-agent"
}

func (a *app) quickstartCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "quickstart",
		Short: "Walk through create, hibernate and resume on request (starts a server if none answers)",
		Long: `Walk through torpor's core promise: create a sandbox from image "base", start a
Python server in it holding a counter and 64 MiB of random data, hibernate the
sandbox, wake it with the next request through the port proxy, show the counter
continuing and the data's checksum unchanged, and delete the sandbox.

It uses the server at --url (else $TORPOR_URL, else ` + client.DefaultURL + `). If none
answers there, it starts one itself, as root: torpor serve --data-dir ` + quickstart.DefaultDataDir + `
--listen <that address>, its log in ` + quickstart.DefaultDataDir + `/quickstart-serve.log, and
stops it at the end.`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runQuickstart(cmd.Context(), a.serverURL(), a.stdout)
		},
	}
}

// benchResumeOptions is what `torpor bench resume` hands to bench.Resume (bench.go).
type benchResumeOptions struct {
	URL            string
	Cycles         int
	WorkingSetsMiB []int
	JSON           bool
	// DataDir, RunscPath and AgentPath locate the server's image file, runsc and
	// the guest agent for the raw runsc baseline measured in the same run.
	DataDir   string
	RunscPath string
	AgentPath string
	// Plot is the PNG file to draw the results into ("" = none).
	Plot string
	// Wakes and ForkCycles size the concurrency cases (0 leaves a case out).
	Wakes, ForkCycles int
}

func (a *app) benchCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	var (
		o          benchResumeOptions
		workingSet string
	)
	resume := &cobra.Command{
		Use:   "resume [--cycles 20] [--working-set 64MiB,512MiB] [--json]",
		Short: "Measure hibernate / resume and pause / unpause times over cycles, per working-set size",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.Cycles < 1 {
				return usagef("--cycles %d: want at least 1", o.Cycles)
			}
			if o.Wakes < 0 || o.ForkCycles < 0 {
				return usagef("--wakes %d --fork-cycles %d: want 0 or more", o.Wakes, o.ForkCycles)
			}
			sets, err := parseSizesMiB(workingSet)
			if err != nil {
				return usagef("--working-set: %v", err)
			}
			o.WorkingSetsMiB = sets
			o.URL = a.serverURL()
			if o.RunscPath == "" {
				o.RunscPath = defaultRunsc()
			}
			if o.AgentPath == "" {
				o.AgentPath = defaultAgent()
			}
			return runBenchResume(cmd.Context(), o, a.stdout)
		},
	}
	resume.Flags().IntVar(&o.Cycles, "cycles", 20, "hibernate/resume cycles, and as many pause/unpause cycles, per working-set size")
	resume.Flags().StringVar(&workingSet, "working-set", "64MiB,512MiB", "comma-separated working-set sizes (MiB, GiB; a bare number is MiB)")
	resume.Flags().BoolVar(&o.JSON, "json", false, "print the results as JSON")
	resume.Flags().IntVar(&o.Wakes, "wakes", bench.DefaultWakes, "hibernated sandboxes woken at once, at the first working set (0 = leave the case out)")
	resume.Flags().IntVar(&o.ForkCycles, "fork-cycles", bench.DefaultForkCycles, "forks of 1 and of 4 clones of the running sandbox per working set (0 = leave the case out)")
	resume.Flags().StringVar(&o.Plot, "plot", "", "also draw the latency distribution of each tier beside raw runsc as a PNG at this path")
	resume.Flags().StringVar(&o.DataDir, "data-dir", envOr("TORPOR_DATA_DIR", "/var/lib/torpor"), "the server's data directory (for the raw runsc baseline's image file)")
	resume.Flags().StringVar(&o.RunscPath, "runsc", "", "runsc for the raw baseline (default $TORPOR_RUNSC, else runsc in PATH)")
	resume.Flags().StringVar(&o.AgentPath, "agent", "", "torpor-agent for the raw baseline (default $TORPOR_AGENT, else next to torpor)")
	cmd.AddCommand(resume, a.benchStandbyCommand(), a.benchPoolCommand())
	return cmd
}

// parseSizesMiB parses "64MiB,512MiB,1GiB,128" into MiB.
func parseSizesMiB(s string) ([]int, error) {
	var out []int
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		num, mult := part, 1
		lower := strings.ToLower(part)
		for _, u := range []struct {
			suffix string
			mult   int
		}{{"mib", 1}, {"mb", 1}, {"m", 1}, {"gib", 1024}, {"gb", 1024}, {"g", 1024}} {
			if strings.HasSuffix(lower, u.suffix) {
				num, mult = strings.TrimSpace(part[:len(part)-len(u.suffix)]), u.mult
				break
			}
		}
		n, err := strconv.Atoi(num)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad size %q (want e.g. 64MiB or 1GiB)", part)
		}
		out = append(out, n*mult)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no sizes in %q", s)
	}
	return out, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// maxSpareNetworks bounds --spare-networks: each is two network namespaces
// and a veth pair, made 2 s after one is taken.
const maxSpareNetworks = 64

// defaultPreparedContainers is --prepared-containers' default: two shapes
// (a host's usual template and one more) restore into containers made ahead of
// time; the rest restore on their own (docs/operations.md#prepared-containers).
const defaultPreparedContainers = 2

// maxPreparedContainers bounds --prepared-containers: each holds processes,
// network namespaces and memory while it waits.
const maxPreparedContainers = 64

// serveWatchdogCommand is the hidden `torpor serve-watchdog`, the process a
// cluster server starts to watch itself (package watchdog).
func (a *app) serveWatchdogCommand() *cobra.Command {
	var cfg watchdog.Config
	cmd := &cobra.Command{
		Use:    watchdog.Command,
		Short:  "Stop this node's instances when its server dies (started by torpor serve on a shared database)",
		Hidden: true,
		Args:   usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			return watchdog.Run(cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.DataDir, "data-dir", "", "the server's data directory (absolute)")
	f.StringVar(&cfg.Runsc, "runsc", "", "the server's runsc binary")
	f.StringVar(&cfg.Node, "node", "", "the node's name")
	return cmd
}
