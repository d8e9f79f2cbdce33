package quickstart

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/workload"
)

// DefaultDataDir is the data directory of a server the quickstart starts itself.
const DefaultDataDir = "/var/lib/torpor"

// WorkingSetMiB is how much random data the workload holds.
const WorkingSetMiB = 64

// Options configure Run.
type Options struct {
	// URL is the torpor server's URL ("" = $TORPOR_URL, else client.DefaultURL).
	URL string
	// Out receives the walk-through (nil = os.Stdout).
	Out io.Writer
	// DataDir is the data directory of a server Run starts itself when none answers
	// at URL ("" = DefaultDataDir).
	DataDir string
}

// Run walks through create, hibernate and resume-on-request against the server at
// opts.URL, starting a server itself if none answers there.
func Run(ctx context.Context, opts Options) (err error) {
	out := opts.Out
	if out == nil {
		out = os.Stdout
	}
	p := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	c := client.New(opts.URL)

	// 1. A server: the one at URL, else one of our own.
	if !answers(ctx, c) {
		dataDir := opts.DataDir
		if dataDir == "" {
			dataDir = DefaultDataDir
		}
		srv, err := startServer(ctx, c.BaseURL, dataDir)
		if err != nil {
			return err
		}
		p("No torpor server at %s: started one (data dir %s, log %s).", c.BaseURL, dataDir, srv.logPath)
		defer func() {
			if serr := srv.stop(); serr != nil && err == nil {
				err = serr
			}
		}()
	} else {
		p("Using the torpor server at %s.", c.BaseURL)
	}

	// 2. A sandbox from "base" (built on first use).
	imgs, err := c.ListImages(ctx)
	if err != nil {
		return fmt.Errorf("list images: %w", err)
	}
	haveBase := false
	for _, img := range imgs {
		if img.Name == "base" {
			haveBase = true
		}
	}
	if !haveBase {
		p("Preparing the base image (first use on this data directory: seconds from the host's build cache that `make setup` fills, else a 1–2 minute build)…")
	}
	t0 := time.Now()
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: 512})
	if err != nil {
		return fmt.Errorf("create sandbox: %w", err)
	}
	id := sb.ID
	deleted := false
	defer func() {
		if !deleted {
			dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = c.DeleteSandbox(dctx, id)
		}
	}()
	p("Created sandbox %s in %s.", id, ms(time.Since(t0)))

	// 3. The workload, and its state before hibernating.
	t0 = time.Now()
	if err := workload.Start(ctx, c, id, WorkingSetMiB); err != nil {
		return err
	}
	p("Started a Python server in it holding %d MiB of random data (%s).", WorkingSetMiB, ms(time.Since(t0)))
	first, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		return err
	}
	before, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		return err
	}
	p("  GET /count    -> %d", first.Count)
	p("  GET /checksum -> %d, sha256 %s", before.Count, short(before.SHA256))

	// 4. Hibernate.
	t0 = time.Now()
	hib, err := c.Hibernate(ctx, id)
	if err != nil {
		return fmt.Errorf("hibernate: %w", err)
	}
	hibMS := time.Since(t0).Milliseconds()
	var snapBytes int64
	if hib.Snapshot != nil {
		snapBytes = hib.Snapshot.Bytes
		if hib.Snapshot.HibernateMS > 0 {
			hibMS = hib.Snapshot.HibernateMS
		}
	}
	p("Hibernated: snapshot %.1f MiB, written in %d ms; the sandbox uses no CPU or memory now.", float64(snapBytes)/(1<<20), hibMS)

	// 5. Resume by sending the next request through the port proxy.
	t0 = time.Now()
	next, err := workload.Get(ctx, c, id, "/count")
	ttfr := time.Since(t0)
	if err != nil {
		return fmt.Errorf("first request after hibernate: %w", err)
	}
	after, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		return err
	}
	p("Sent the next request through the proxy; it woke the sandbox:")
	p("  GET /count    -> %d (was %d before hibernating)", next.Count, before.Count)
	p("  GET /checksum -> %d, sha256 %s", after.Count, short(after.SHA256))
	if next.Count != before.Count+1 || after.Count != next.Count+1 {
		return fmt.Errorf("the counter did not continue: %d before hibernate, then %d and %d", before.Count, next.Count, after.Count)
	}
	if after.SHA256 != before.SHA256 {
		return fmt.Errorf("the data changed across hibernate/resume: sha256 %s before, %s after", before.SHA256, after.SHA256)
	}
	p("  counter continued %d → %d ✓, checksum unchanged ✓, time to first request %s", before.Count, next.Count, ms(ttfr))

	// 6. Clean up.
	if err := c.DeleteSandbox(ctx, id); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	deleted = true
	p("Deleted sandbox %s.", id)
	p("")
	p("Summary: %d MiB working set hibernated to %.1f MiB in %d ms; resumed on the next request in %s with its process state intact.",
		WorkingSetMiB, float64(snapBytes)/(1<<20), hibMS, ms(ttfr))
	return nil
}

func ms(d time.Duration) string {
	if d >= 10*time.Second {
		return fmt.Sprintf("%.1f s", d.Seconds())
	}
	return fmt.Sprintf("%d ms", d.Milliseconds())
}

func short(sum string) string {
	if len(sum) > 16 {
		return sum[:16] + "…"
	}
	return sum
}

// answers reports whether a torpor server answers /healthz at c's URL.
func answers(ctx context.Context, c *client.Client) bool {
	hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return c.Health(hctx) == nil
}

// server is a `torpor serve` process started by the quickstart.
type server struct {
	cmd     *exec.Cmd
	logPath string
	exited  chan struct{}
	waitErr error
}

// startServer runs `<this executable> serve` listening on baseURL's address and
// waits until it answers.
func startServer(ctx context.Context, baseURL, dataDir string) (*server, error) {
	u, err := url.Parse(baseURL)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("no server at %q and cannot start one there: bad URL", baseURL)
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil {
		return nil, fmt.Errorf("no server at %s and cannot start one there: %w", baseURL, err)
	}
	if host == "localhost" {
		host = "127.0.0.1"
	}
	listen := net.JoinHostPort(host, port)
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("start a server: %w", err)
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("no torpor server at %s, and starting one needs root (runsc, network namespaces): run `sudo torpor serve` or the quickstart as root", baseURL)
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("start a server: %w", err)
	}
	logPath := filepath.Join(dataDir, "quickstart-serve.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("start a server: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(exe, "serve", "--data-dir", dataDir, "--listen", listen)
	cmd.Stdout = logf
	cmd.Stderr = logf
	// Its own process group: a Ctrl-C in the terminal reaches the quickstart, which
	// stops the server itself (and its sandboxes are deleted first).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s serve: %w", exe, err)
	}
	s := &server{cmd: cmd, logPath: logPath, exited: make(chan struct{})}
	go func() { s.waitErr = cmd.Wait(); close(s.exited) }()

	c := client.New(baseURL)
	deadline := time.Now().Add(60 * time.Second)
	for {
		if answers(ctx, c) {
			return s, nil
		}
		select {
		case <-s.exited:
			return nil, fmt.Errorf("the torpor server it started exited (%v); see %s:\n%s", s.waitErr, logPath, tail(logPath, 10))
		case <-ctx.Done():
			_ = s.stop()
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = s.stop()
			return nil, fmt.Errorf("the torpor server it started did not answer within 60 s; see %s", logPath)
		}
	}
}

// stop sends SIGTERM to the server's pid, and SIGKILL if it has not exited after 20 s.
func (s *server) stop() error {
	select {
	case <-s.exited:
		return nil
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
		return nil
	case <-time.After(20 * time.Second):
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
	return errors.New("the torpor server it started did not stop on SIGTERM within 20 s; killed it (pid " + fmt.Sprint(s.cmd.Process.Pid) + ")")
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
