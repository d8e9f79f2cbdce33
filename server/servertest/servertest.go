// Package servertest starts a real torpor server (real runsc, real images) for
// tests and benchmarks in any package: a fresh data directory per call, an HTTP
// listener on loopback, and cleanup that deletes every sandbox the test made and
// stops the server. Tests that use it need root, runsc and the Debian tools that
// `make setup` installs; without root they are skipped.
package servertest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/server"
)

// Server is a running test server.
type Server struct {
	*server.Server
	URL     string
	Client  *client.Client
	DataDir string
	cfg     server.Config
	// resumeDelay: Options.ResumeDelay.
	resumeDelay time.Duration
	hs          *http.Server
	ln          net.Listener

	// APIKey is a key made at start when the server requires keys
	// (Options.Auth); Client sends it.
	APIKey string
}

// Options tune a test server.
type Options struct {
	// DataDir reuses a data directory (e.g. to test a restart); "" = t.TempDir().
	DataDir string
	// ResumeDelay, when set, pauses every engine Restore this long before it
	// starts (the sandbox is then marked resuming): tests race other calls
	// against a resume.
	ResumeDelay time.Duration
	// ResumeHookDeadline and ResumeAckDeadline are passed to server.Config.
	ResumeHookDeadline time.Duration
	ResumeAckDeadline  time.Duration
	// KeepSandboxes leaves sandboxes running when the test ends (restart tests
	// hand them to the next server, which must clean up).
	KeepSandboxes bool
	// Lifecycle runs the idle and timeout loop (off by default, so that tests not
	// about it never see a sandbox hibernate under them); IdleCPUThreshold and
	// LifecycleInterval are passed to server.Config.
	Lifecycle         bool
	IdleCPUThreshold  float64
	LifecycleInterval time.Duration
	// StandbyMemoryMiB is server.Config's (0 = no budget).
	StandbyMemoryMiB int
	// Store selects the snapshot store (passed to server.Config.Store); the zero
	// value is the default for a new data directory, the chunked store on local
	// disk (server.ResolveStoreKind).
	Store server.StoreConfig
	// Logger receives the server's log (nil = warnings and errors to the test's log).
	Logger *slog.Logger
	// AgentPath is the guest agent binary the server installs ("" = AgentBinary,
	// built from this checkout).
	AgentPath string
	// E2B configures the E2B API (passed to server.Config.E2B).
	E2B server.E2BConfig
	// Auth is passed to server.Config.Auth; the listener is on loopback, so
	// the default is no keys. With server.AuthRequired, Start makes a key
	// (Server.APIKey) and Client sends it.
	Auth server.AuthMode
	// Limits are passed to server.Config.Limits (pids limit, admission).
	Limits manager.LimitsConfig
	// Egress is passed to server.Config.Egress (nil: sandboxes have no way out).
	Egress *sandboxnet.EgressConfig
	// PreparedContainers is passed to server.Config (0: none).
	PreparedContainers int
	// SpareNetworks is passed to server.Config (0: none).
	SpareNetworks int
	// BackgroundRestore and StreamColdResumes are passed to server.Config.
	BackgroundRestore, StreamColdResumes bool
}

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// Root returns the module's root directory.
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// AgentBinary builds the guest agent once per test process and returns its
// path: .tools/build/test-agent/torpor-agent-<sha256 prefix> in the checkout
// (ignored by git), named by its content, so test processes building other
// sources at once (worktrees sharing .tools) never replace each other's agent,
// and test runs leave nothing behind in /tmp. Agents of other builds not
// refreshed for a day are removed.
func AgentBinary(t testing.TB) string {
	agentOnce.Do(func() {
		dir := filepath.Join(Root(), ".tools", "build", "test-agent")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			agentErr = err
			return
		}
		tmp, err := os.MkdirTemp(dir, "build-")
		if err != nil {
			agentErr = err
			return
		}
		defer os.RemoveAll(tmp)
		bin := filepath.Join(tmp, "torpor-agent")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/torpor-agent")
		cmd.Dir = Root()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = fmt.Errorf("build agent: %v: %s", err, out)
			return
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			agentErr = err
			return
		}
		sum := sha256.Sum256(b)
		agentPath = filepath.Join(dir, "torpor-agent-"+hex.EncodeToString(sum[:6]))
		if agentErr = os.Rename(bin, agentPath); agentErr != nil {
			return
		}
		old, _ := filepath.Glob(filepath.Join(dir, "torpor-agent*"))
		for _, p := range old {
			if fi, err := os.Stat(p); err == nil && p != agentPath && time.Since(fi.ModTime()) > 24*time.Hour {
				os.Remove(p)
			}
		}
	})
	if agentErr != nil {
		t.Fatal(agentErr)
	}
	return agentPath
}

// Runsc returns the runsc binary: $TORPOR_RUNSC, else the pinned one under .tools.
func Runsc(t testing.TB) string {
	if p := os.Getenv("TORPOR_RUNSC"); p != "" {
		return p
	}
	m, _ := filepath.Glob(filepath.Join(Root(), ".tools", "runsc-*"))
	if len(m) == 0 {
		t.Skip("no runsc: run `make setup` (or set TORPOR_RUNSC)")
	}
	return m[len(m)-1]
}

// Start starts a server and registers its cleanup with t.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	dir := opts.DataDir
	if dir == "" {
		dir = t.TempDir()
	}
	agent := opts.AgentPath
	if agent == "" {
		agent = AgentBinary(t)
	}
	cfg := server.Config{
		DataDir: dir, RunscPath: Runsc(t), AgentPath: agent,
		Logger:             slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		ResumeHookDeadline: opts.ResumeHookDeadline, ResumeAckDeadline: opts.ResumeAckDeadline,
		Store: opts.Store, Auth: opts.Auth, E2B: opts.E2B, Limits: opts.Limits, Egress: opts.Egress,
		PreparedContainers: opts.PreparedContainers, SpareNetworks: opts.SpareNetworks,
		BackgroundRestore: opts.BackgroundRestore, StreamColdResumes: opts.StreamColdResumes,
	}
	if opts.Logger != nil {
		cfg.Logger = opts.Logger
	}
	cfg.DisableLifecycle = !opts.Lifecycle
	cfg.IdleCPUThreshold, cfg.LifecycleInterval = opts.IdleCPUThreshold, opts.LifecycleInterval
	cfg.StandbyMemoryMiB = opts.StandbyMemoryMiB
	s := &Server{DataDir: dir, cfg: cfg, resumeDelay: opts.ResumeDelay}
	s.start(t)
	t.Cleanup(func() {
		if !opts.KeepSandboxes {
			s.DeleteAll(t)
		}
		engines := s.Engines
		s.Stop()
		if !opts.KeepSandboxes && engines != nil {
			for _, e := range engines.All() {
				if c, ok := e.(io.Closer); ok {
					c.Close() // unmount runsc's null-netns so the temp dir can be removed
				}
			}
		}
	})
	return s
}

func (s *Server) start(t testing.TB) {
	ctx := context.Background()
	cfg := s.cfg
	if s.resumeDelay > 0 {
		engines, err := server.DefaultEngines(s.DataDir, cfg.RunscPath, cfg.Egress)
		if err != nil {
			t.Fatalf("start server: %v", err)
		}
		gv, ok := engines.Default().(*gvisor.Engine)
		if !ok {
			t.Fatalf("start server: default engine %s is not gVisor", engines.Default().Name())
		}
		slow := slowRestore{Engine: gv, delay: s.resumeDelay}
		if cfg.Engines, err = engine.NewRegistry(slow.Name(), slow); err != nil {
			t.Fatal(err)
		}
	}
	srv, err := server.New(ctx, cfg)
	if err != nil {
		t.Fatalf("start server: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Server, s.ln = srv, ln
	s.URL = "http://" + ln.Addr().String()
	s.Client = client.New(s.URL)
	if srv.AuthRequired && s.APIKey == "" {
		if s.APIKey, _, err = apikey.Create(ctx, srv.Keys(), "servertest", time.Now()); err != nil {
			t.Fatalf("start server: make an API key: %v", err)
		}
	}
	if s.APIKey != "" {
		s.Client.APIKey = s.APIKey
	}
	s.hs = &http.Server{Handler: srv.Handler(), ErrorLog: srv.ErrorLog()}
	go s.hs.Serve(ln)
}

// Stop stops the HTTP server and closes the database; sandboxes keep running (as
// after a crash of the server process).
func (s *Server) Stop() {
	if s.hs == nil {
		return
	}
	s.hs.Close()
	s.Server.Close()
	s.hs = nil
}

// Restart stops the server and starts a new one on the same data directory.
func (s *Server) Restart(t testing.TB) {
	s.Stop()
	s.start(t)
}

// DeleteAll deletes every sandbox of the server.
func (s *Server) DeleteAll(t testing.TB) {
	if s.hs == nil {
		return
	}
	ctx := context.Background()
	all, err := s.Client.ListSandboxes(ctx)
	if err != nil {
		t.Logf("cleanup: list: %v", err)
		return
	}
	for _, sb := range all {
		if err := s.Client.DeleteSandbox(ctx, sb.ID); err != nil {
			t.Logf("cleanup: delete %s: %v", sb.ID, err)
		}
	}
}

// slowRestore is the gVisor engine whose Restore waits delay first.
type slowRestore struct {
	*gvisor.Engine
	delay time.Duration
}

func (e slowRestore) Restore(ctx context.Context, spec engine.Spec, dir string) error {
	select {
	case <-time.After(e.delay):
	case <-ctx.Done():
		return ctx.Err()
	}
	return e.Engine.Restore(ctx, spec, dir)
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

var _ io.Writer = testWriter{}
