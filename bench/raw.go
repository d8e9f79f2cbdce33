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
}

// newRawEngine prepares the raw measurement, or returns why it cannot run.
func newRawEngine(opts Options, c *client.Client, digest string) (*rawEngine, string) {
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
	eng, err := gvisor.New(gvisor.Config{Runsc: opts.RunscPath, StateDir: filepath.Join(dir, "engine")})
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
	spec := engine.Spec{RootFS: r.rootfs, GuestDir: r.guestDir, MemoryMiB: memMiB, CPUs: 1}
	spec.ID = r.nextID(ws)
	cur := spec.ID
	prevDir := "" // the checkpoint image cur was restored from
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if serr := r.eng.Stop(sctx, cur); serr != nil && err == nil {
			err = serr
		}
		if prevDir != "" {
			os.RemoveAll(prevDir)
		}
	}()
	if err := r.eng.Start(ctx, spec); err != nil {
		return nil, nil, err
	}
	ag := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		return r.eng.Dial(ctx, cur, engine.AgentPort)
	})
	defer ag.CloseIdleConnections()
	if err := ag.WaitReady(ctx, 30*time.Second); err != nil {
		return nil, nil, fmt.Errorf("guest agent: %w", err)
	}
	if err := ag.WriteFile(ctx, workload.ScriptPath, bytes.NewReader(script), int64(len(script))); err != nil {
		return nil, nil, fmt.Errorf("write workload: %w", err)
	}
	if _, err := ag.Start(ctx, proto.ExecRequest{
		Cmd: []string{"python3", workload.ScriptPath, fmt.Sprint(workload.Port), fmt.Sprint(ws)},
	}); err != nil {
		return nil, nil, fmt.Errorf("start workload: %w", err)
	}
	ag.CloseIdleConnections()
	count, err := r.firstAnswer(ctx, cur, 60*time.Second)
	if err != nil {
		return nil, nil, fmt.Errorf("workload did not answer: %w", err)
	}

	for i := 0; i < cycles; i++ {
		dir := filepath.Join(r.dir, fmt.Sprintf("ckpt-%d", r.n))
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return ckpt, restore, err
		}
		t0 := time.Now()
		if err := r.eng.Checkpoint(ctx, cur, dir, false); err != nil {
			os.RemoveAll(dir)
			return ckpt, restore, fmt.Errorf("cycle %d: checkpoint: %w", i+1, err)
		}
		ckpt = append(ckpt, msOf(time.Since(t0)))
		// The instance restored from prevDir is gone now; its image can go.
		if prevDir != "" {
			os.RemoveAll(prevDir)
		}
		prevDir = dir

		spec.ID = r.nextID(ws)
		cur = spec.ID
		t0 = time.Now()
		if err := r.eng.Restore(ctx, spec, dir); err != nil {
			return ckpt, restore, fmt.Errorf("cycle %d: restore: %w", i+1, err)
		}
		n, err := r.firstAnswer(ctx, cur, 60*time.Second)
		d := time.Since(t0)
		if err != nil {
			return ckpt, restore, fmt.Errorf("cycle %d: no answer after restore: %w", i+1, err)
		}
		if n != count+1 {
			return ckpt, restore, fmt.Errorf("cycle %d: the counter did not continue: %d before checkpoint, %d after restore", i+1, count, n)
		}
		count = n
		restore = append(restore, msOf(d))
	}
	return ckpt, restore, nil
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
