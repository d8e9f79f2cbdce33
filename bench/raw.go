package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/workload"
)

// rawEngine is a gVisor engine of the benchmark's own, outside any torpor server:
// the "equivalent container" runs the same image and the same workload process
// under runsc, with nothing of torpor around checkpoint and restore.
type rawEngine struct {
	eng      *gvisor.Engine
	dir      string // scratch: engine state, guest dir, checkpoint images
	guestDir string
	rootfs   string
	n        int // instance counter
	// rest is how long each cycle waits between checkpoint and restore.
	rest time.Duration
}

// newRawEngine prepares the raw measurement, or returns why it cannot run.
func newRawEngine(opts Options, c *client.Client, digest string) (*rawEngine, string) {
	return newRawEngineConfig(opts, c, digest, gvisor.Config{})
}

// newRawEngineConfig is newRawEngine with an engine configured as cfg (its
// Runsc and StateDir are set here): the restore levers' measurement.
func newRawEngineConfig(opts Options, c *client.Client, digest string, cfg gvisor.Config) (*rawEngine, string) {
	if os.Geteuid() != 0 {
		return nil, "needs root (runsc, network namespaces)"
	}
	if opts.RunscPath == "" {
		return nil, "no runsc (set TORPOR_RUNSC or put runsc in PATH)"
	}
	if _, err := os.Stat(opts.AgentPath); err != nil {
		return nil, fmt.Sprintf("no guest agent at %q (set TORPOR_AGENT): %v", opts.AgentPath, err)
	}
	rootfs, why := imageFile(opts.DataDir, c, digest)
	if rootfs == "" {
		return nil, why
	}
	dir, err := os.MkdirTemp(opts.ScratchDir, "torpor-bench-raw-")
	if err != nil {
		return nil, err.Error()
	}
	r := &rawEngine{dir: dir, rootfs: rootfs, guestDir: filepath.Join(dir, "guest")}
	cfg.Runsc, cfg.StateDir = opts.RunscPath, filepath.Join(dir, "engine")
	eng, err := gvisor.New(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err.Error()
	}
	r.eng = eng
	agent, err := os.ReadFile(opts.AgentPath)
	if err == nil {
		err = os.MkdirAll(r.guestDir, 0o755)
	}
	if err == nil {
		err = os.WriteFile(filepath.Join(r.guestDir, "torpor-agent"), agent, 0o555)
	}
	if err != nil {
		r.close()
		return nil, "guest dir: " + err.Error()
	}
	return r, ""
}

// imageFile returns the path of the image file of digest in the server's data
// directory (the layout of image.Store.Path: <data-dir>/images/sha256/<hex>.erofs),
// or "" and why not.
func imageFile(dataDir string, c *client.Client, digest string) (string, string) {
	if digest == "" {
		imgs, err := c.ListImages(context.Background())
		if err != nil {
			return "", "list images: " + err.Error()
		}
		for _, img := range imgs {
			if img.Name == "base" {
				digest = img.Digest
			}
		}
	}
	hex := strings.TrimPrefix(digest, "sha256:")
	if hex == "" || hex == digest {
		return "", fmt.Sprintf("no image digest for base (%q)", digest)
	}
	p, err := filepath.Abs(filepath.Join(dataDir, "images", "sha256", hex+".erofs"))
	if err != nil {
		return "", err.Error()
	}
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Sprintf("image file %s not found; is the server's data dir %s? (set TORPOR_DATA_DIR)", p, dataDir)
	}
	return p, ""
}

// close unmounts what runsc keeps in the engine's root and removes the scratch
// directory; every instance is stopped by then.
func (r *rawEngine) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	_ = r.eng.DiscardPrepared(ctx)
	cancel()
	_ = r.eng.Close()
	os.RemoveAll(r.dir)
}

func (r *rawEngine) nextID(ws int) string {
	r.n++
	// Fixed width: runsc resolves ids by prefix, so no id may prefix another.
	return fmt.Sprintf("bench-raw-%d-%06d", ws, r.n)
}

// measure starts the workload holding ws MiB in a fresh raw instance, then for
// cycles times checkpoints it (timed) and restores it (timed until the workload's
// first HTTP answer), checking that the counter continued. Every instance it
// starts is stopped and every checkpoint image removed before it returns.
func (r *rawEngine) measure(ctx context.Context, ws, memMiB int, script []byte, cycles int) (ckpt, restore []float64, err error) {
	run, err := r.start(ctx, ws, memMiB, script)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if serr := run.stop(); serr != nil && err == nil {
			err = serr
		}
	}()
	for i := 0; i < cycles; i++ {
		c, rs, err := run.cycle(ctx)
		if err != nil {
			return ckpt, restore, fmt.Errorf("cycle %d: %w", i+1, err)
		}
		ckpt, restore = append(ckpt, c), append(restore, rs)
	}
	return ckpt, restore, nil
}

// rawRun is the workload running in one raw instance, between its cycles.
type rawRun struct {
	r       *rawEngine
	ws      int
	spec    engine.Spec
	count   int64  // the workload's counter, as last answered
	prevDir string // the checkpoint image the current instance was restored from
}

// start starts the workload holding ws MiB in a fresh raw instance and waits
// for its first answer. On error nothing of it is left.
func (r *rawEngine) start(ctx context.Context, ws, memMiB int, script []byte) (run *rawRun, err error) {
	run = &rawRun{r: r, ws: ws, spec: engine.Spec{RootFS: r.rootfs, GuestDir: r.guestDir, MemoryMiB: memMiB, CPUs: 1}}
	run.spec.ID = r.nextID(ws)
	defer func() {
		if err != nil {
			run.stop()
		}
	}()
	if err := r.eng.Start(ctx, run.spec); err != nil {
		return nil, err
	}
	cur := run.spec.ID
	ag := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		return r.eng.Dial(ctx, cur, engine.AgentPort)
	})
	defer ag.CloseIdleConnections()
	if err := ag.WaitReady(ctx, 30*time.Second); err != nil {
		return nil, fmt.Errorf("guest agent: %w", err)
	}
	if err := ag.WriteFile(ctx, workload.ScriptPath, bytes.NewReader(script), int64(len(script))); err != nil {
		return nil, fmt.Errorf("write workload: %w", err)
	}
	if _, err := ag.Start(ctx, proto.ExecRequest{
		Cmd: []string{"python3", workload.ScriptPath, fmt.Sprint(workload.Port), fmt.Sprint(ws)},
	}); err != nil {
		return nil, fmt.Errorf("start workload: %w", err)
	}
	ag.CloseIdleConnections()
	if run.count, err = r.firstAnswer(ctx, cur, 60*time.Second); err != nil {
		return nil, fmt.Errorf("workload did not answer: %w", err)
	}
	return run, nil
}

// cycle checkpoints the instance (timed), waits the engine's rest, restores
// it as a new instance (timed until the workload's first answer) and checks
// that the counter continued. Times are in milliseconds.
func (run *rawRun) cycle(ctx context.Context) (ckpt, restore float64, err error) {
	r := run.r
	dir := filepath.Join(r.dir, fmt.Sprintf("ckpt-%d", r.n))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	if err := r.eng.Checkpoint(ctx, run.spec.ID, dir, false); err != nil {
		os.RemoveAll(dir)
		return 0, 0, fmt.Errorf("checkpoint: %w", err)
	}
	ckpt = msOf(time.Since(t0))
	// The instance restored from prevDir is gone now; its image can go.
	if run.prevDir != "" {
		os.RemoveAll(run.prevDir)
	}
	run.prevDir = dir
	time.Sleep(r.rest)

	run.spec.ID = r.nextID(run.ws)
	t0 = time.Now()
	if err := r.eng.Restore(ctx, run.spec, dir); err != nil {
		return ckpt, 0, fmt.Errorf("restore: %w", err)
	}
	n, err := r.firstAnswer(ctx, run.spec.ID, 60*time.Second)
	d := time.Since(t0)
	if err != nil {
		return ckpt, 0, fmt.Errorf("no answer after restore: %w", err)
	}
	if n != run.count+1 {
		return ckpt, 0, fmt.Errorf("the counter did not continue: %d before checkpoint, %d after restore", run.count, n)
	}
	run.count = n
	return ckpt, msOf(d), nil
}

// stop stops the current instance and removes the image it was restored from.
func (run *rawRun) stop() error {
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := run.r.eng.Stop(sctx, run.spec.ID)
	if run.prevDir != "" {
		os.RemoveAll(run.prevDir)
	}
	return err
}

// firstAnswer sends GET /count to the workload in instance id, retrying the dial
// and the request at once until one is answered or timeout passes, and returns
// the counter.
func (r *rawEngine) firstAnswer(ctx context.Context, id string, timeout time.Duration) (int64, error) {
	hc := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return r.eng.Dial(ctx, id, workload.Port)
		},
	}}
	deadline := time.Now().Add(timeout)
	for {
		n, err := getCount(ctx, hc)
		if err == nil {
			return n, nil
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		if time.Now().After(deadline) {
			return 0, err
		}
		time.Sleep(200 * time.Microsecond)
	}
}

func getCount(ctx context.Context, hc *http.Client) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, "http://sandbox/count", nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	var st workload.State
	if err := json.Unmarshal(b, &st); err != nil {
		return 0, err
	}
	return st.Count, nil
}
