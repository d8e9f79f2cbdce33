package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/torpor/torpor/guest/proto"
)

const (
	// Port is the TCP port the agent listens on inside the sandbox.
	Port = proto.Port
	// GuestDir is where the host mounts the agent's directory, read-only, in the sandbox.
	GuestDir = "/.torpor"
	// BinaryPath is the agent binary's path inside the sandbox.
	BinaryPath = "/.torpor/torpor-agent"
	// LogPath is where Run writes the agent's own log inside the sandbox.
	LogPath = "/tmp/torpor-agent.log"
	// DevShm is the sandbox's shared-memory directory, which Run makes writable by
	// every user (mode 1777).
	DevShm = "/dev/shm"
	// DefaultPath is the PATH commands get unless the sandbox env or the request sets one.
	DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// drainWait is how long an exec keeps reading its pipes after the main process exited.
const drainWait = 50 * time.Millisecond

var startedAt = time.Now()

// Options configure Serve. The zero value is what Run uses inside a sandbox.
type Options struct {
	// Env is the sandbox env: set for every command, over the defaults (PATH, HOME,
	// LANG) and under the request's Env. Nil means the agent's own process environment
	// (os.Environ() at Serve time), which is how the host passes the sandbox's env.
	Env map[string]string
	// ReapAll makes the agent wait for every child, not only those it started. It is
	// always on when the agent is PID 1. The reaper is process-wide and its mode is
	// fixed by the first Serve call of the process.
	ReapAll bool
	// Log receives the agent's log lines; nil discards them.
	Log *log.Logger
	// RunDir enables the resume contract (POST /resume and the events socket): the
	// directory of the generation file, resume.json, clock_offset_ns and the events
	// socket. Run uses /run/torpor; "" disables it (POST /resume answers 404).
	RunDir string
	// HooksDir is the directory of user resume hooks (Run: /etc/torpor/resume.d).
	HooksDir string
	// Root, when set, is the host directory that the files API's absolute paths
	// and commands' working directories are resolved under (a path p becomes
	// Root+p); command lines are not rewritten. It lets an unprivileged test
	// process run one agent per in-memory instance (engine/fake). "" = /.
	Root string
}

// Run listens on addr (":49983" in a sandbox), appends its log to LogPath, and serves
// the agent API to the host only (hostOnly: connections from inside the sandbox
// are refused) until ctx is cancelled; then it returns nil. It returns an error if
// it cannot listen or serving fails.
func Run(ctx context.Context, addr string) error {
	var lg *log.Logger
	if f, err := os.OpenFile(LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); err == nil {
		defer f.Close()
		lg = log.New(f, "torpor-agent ", log.LstdFlags|log.Lmicroseconds)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	if lg != nil {
		lg.Printf("pid %d listening on %s", os.Getpid(), ln.Addr())
	}
	keepPidsExemption(lg) // before any command starts (pids.go)
	// POSIX shared memory and semaphores (Python's multiprocessing, Chromium)
	// need /dev/shm writable by every user, as Linux distributions mount it
	// (1777). torpor's sandboxes get a sized tmpfs of that mode there
	// (engine.Spec ShmMiB); without one (ShmMiB 0; and sandboxes made before
	// it keep what they had, as runsc's restore refuses a spec whose mounts
	// differ from the checkpoint's) gVisor makes it a directory of mode 0755
	// on the /dev tmpfs, which gets the mode here. The mode is in sandbox
	// memory and kept by every checkpoint.
	if err := os.Chmod(DevShm, os.ModeSticky|0o777); err != nil && lg != nil && !errors.Is(err, os.ErrNotExist) {
		lg.Printf("chmod %s: %v", DevShm, err)
	}
	return Serve(ctx, hostOnly{Listener: ln, log: lg}, Options{Log: lg, RunDir: RunDir, HooksDir: HooksDir})
}

// Serve answers the agent API on ln until ctx is cancelled, then closes ln and returns
// nil (running execs are given 2 s, then their connections are closed, which kills
// their commands). It returns the error if serving fails otherwise.
func Serve(ctx context.Context, ln net.Listener, opts Options) error {
	s := newServer(opts)
	if opts.RunDir != "" {
		s.resume = newResumer(s, opts.RunDir, opts.HooksDir)
		eln, err := s.resume.listen()
		if err != nil {
			// The agent still serves exec and files; /resume reports the failure.
			s.log.Printf("events socket: %v", err)
		} else {
			defer eln.Close()
		}
	}
	// HTTP/1.1 for torpor's protocol and envd's Connect clients; cleartext
	// HTTP/2 (prior knowledge) as well, for envd's gRPC clients.
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Protocols:         &protocols,
		Handler:           s.handler(),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       10 * time.Minute,
		ErrorLog:          s.log,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			srv.Close()
		}
		if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}

type server struct {
	env    map[string]string // sandbox env
	reaper *reaper
	log    *log.Logger
	resume *resumer // nil without Options.RunDir
	root   string   // Options.Root
	envd   *envd
}

func newServer(opts Options) *server {
	lg := opts.Log
	if lg == nil {
		lg = log.New(io.Discard, "", 0)
	}
	env := opts.Env
	if env == nil {
		env = make(map[string]string)
		for _, kv := range os.Environ() {
			if k, v, ok := strings.Cut(kv, "="); ok && k != "" {
				env[k] = v
			}
		}
	}
	s := &server{env: env, reaper: getReaper(opts.ReapAll, lg), log: lg, root: opts.Root}
	s.envd = newEnvd(s)
	return s
}

func (s *server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.handleHealth)
	mux.HandleFunc("POST /exec", s.handleExec)
	mux.HandleFunc("GET /files", s.handleGetFile)
	mux.HandleFunc("PUT /files", s.handlePutFile)
	mux.HandleFunc("POST /resume", s.handleResume)
	mux.HandleFunc("POST "+proto.PathPrepareHibernate, s.handlePrepareHibernate)
	s.envd.mount(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health", "/exec", "/files", "/resume", proto.PathPrepareHibernate:
			writeError(w, http.StatusMethodNotAllowed, proto.CodeInvalidArgument, "method "+r.Method+" not allowed on "+r.URL.Path)
		default:
			writeError(w, http.StatusNotFound, proto.CodeNotFound, "no such endpoint: "+r.URL.Path)
		}
	})
	return mux
}

func (s *server) handleHealth(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, proto.Health{OK: true, Pid: os.Getpid(), StartedAt: startedAt.UTC(),
		ProtocolVersion: proto.Version, Agent: build})
}

// build names this agent binary in the health answer: "torpor-agent", its module
// version and, when it was built from a git checkout, the commit
// ("vcs.revision=…", "+dirty" for uncommitted changes).
var build = func() string {
	s := "torpor-agent"
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return s
	}
	s += " " + bi.Main.Version
	var rev, dirty string
	for _, kv := range bi.Settings {
		switch kv.Key {
		case "vcs.revision":
			rev = kv.Value
		case "vcs.modified":
			if kv.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	if rev != "" {
		s += " vcs.revision=" + rev + dirty
	}
	return s
}()

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	b = append(b, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(b)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, proto.ErrorBody{Error: proto.ErrorDetail{Code: code, Message: msg}})
}
