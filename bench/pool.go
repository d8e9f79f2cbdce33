package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
)

// TargetPoolCreateP50MS is the target of a create from a pooled template:
// create -> first exec answered, p50.
const TargetPoolCreateP50MS = 30.0

// PoolOptions configure Pool (`torpor bench pool`).
type PoolOptions struct {
	// URL is the torpor server ("" = $TORPOR_URL, else client.DefaultURL).
	URL string
	// Image is the template image (default "base"); PoolSize its pool size
	// during the run (default 2). The image's pool size before the run is set
	// back at the end.
	Image    string
	PoolSize int
	// Samples is the number of timed creates of each kind (default 20).
	Samples int
	// JSON prints the result as JSON instead of a table.
	JSON bool
	// Out receives the result (nil = os.Stdout); Progress one line per phase
	// (nil = Out for tables, nothing for JSON).
	Out, Progress io.Writer
}

// PoolResult is Pool's measurement, in milliseconds: from just before the
// create call until the answer of the first exec (`true`) in the new
// sandbox, for creates that take a clone of the image's pool (Pooled) and
// for creates of the same image that the pool does not serve (Unpooled: an
// environment variable set, so the sandbox is started), alternating in one
// run.
type PoolResult struct {
	Image    string
	PoolSize int
	Pooled   Summary
	Unpooled Summary
	// PooledCall and UnpooledCall are the create calls alone (until their
	// answer), of the same samples.
	PooledCall, UnpooledCall Summary
	// Refill is how long the pool took to have PoolSize ready again after a
	// pooled create (until GET /v1/pools said so).
	Refill Summary
}

// RatioP50 is Pooled.P50 / Unpooled.P50.
func (r PoolResult) RatioP50() float64 {
	if r.Unpooled.P50 == 0 {
		return 0
	}
	return r.Pooled.P50 / r.Unpooled.P50
}

// Pool measures creates from a pooled template beside unpooled creates of
// the same image, against a running server. Every sandbox it makes is
// deleted; errors are the API's.
func Pool(ctx context.Context, o PoolOptions) (PoolResult, error) {
	if o.Image == "" {
		o.Image = "base"
	}
	if o.PoolSize <= 0 {
		o.PoolSize = 2
	}
	if o.Samples <= 0 {
		o.Samples = 20
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	progress := o.Progress
	if progress == nil && !o.JSON {
		progress = o.Out
	}
	if progress == nil {
		progress = io.Discard
	}
	url := o.URL
	if url == "" {
		url = os.Getenv("TORPOR_URL")
	}
	if url == "" {
		url = client.DefaultURL
	}
	c := client.New(url)
	res := PoolResult{Image: o.Image, PoolSize: o.PoolSize}
	prev := 0
	pools, err := c.ListPools(ctx)
	if err != nil {
		return res, err
	}
	for _, p := range pools {
		if p.Template == "image" && p.Name == o.Image {
			prev = p.Size
		}
	}
	if _, err := c.SetImagePool(ctx, o.Image, o.PoolSize); err != nil {
		return res, err
	}
	defer func() { _, _ = c.SetImagePool(context.WithoutCancel(ctx), o.Image, prev) }()
	fmt.Fprintf(progress, "pool of %d for image %s: filling\n", o.PoolSize, o.Image)
	if _, err := waitPoolReady(ctx, c, o.Image, o.PoolSize); err != nil {
		return res, err
	}
	var pooled, unpooled, refill, pooledCall, unpooledCall []float64
	for i := 0; i < o.Samples; i++ {
		d, call, forked, err := createFirstExec(ctx, c, apiv1.CreateSandboxRequest{Image: o.Image})
		if err != nil {
			return res, fmt.Errorf("pooled create %d: %w", i+1, err)
		}
		if !forked {
			return res, fmt.Errorf("pooled create %d: the sandbox was started, not taken from the pool", i+1)
		}
		pooled, pooledCall = append(pooled, msOf(d)), append(pooledCall, msOf(call))
		t0 := time.Now()
		if _, err := waitPoolReady(ctx, c, o.Image, o.PoolSize); err != nil {
			return res, err
		}
		refill = append(refill, msOf(time.Since(t0)))
		d, call, forked, err = createFirstExec(ctx, c, apiv1.CreateSandboxRequest{Image: o.Image, Env: map[string]string{"TORPOR_BENCH": "unpooled"}})
		if err != nil {
			return res, fmt.Errorf("unpooled create %d: %w", i+1, err)
		}
		if forked {
			return res, fmt.Errorf("unpooled create %d: took a clone", i+1)
		}
		unpooled, unpooledCall = append(unpooled, msOf(d)), append(unpooledCall, msOf(call))
		fmt.Fprintf(progress, "sample %d/%d: pooled %.1f ms, unpooled %.1f ms, refill %.0f ms\n", i+1, o.Samples,
			pooled[i], unpooled[i], refill[i])
	}
	res.Pooled, res.Unpooled, res.Refill = Summarize(pooled), Summarize(unpooled), Summarize(refill)
	res.PooledCall, res.UnpooledCall = Summarize(pooledCall), Summarize(unpooledCall)
	return res, nil
}

// createFirstExec creates a sandbox with req, runs `true` in it, and
// deletes it; it returns the time from the create call to the exec's
// answer, the create call's alone, and whether the sandbox was a clone
// (taken from a pool).
func createFirstExec(ctx context.Context, c *client.Client, req apiv1.CreateSandboxRequest) (total, call time.Duration, forked bool, err error) {
	t0 := time.Now()
	sb, err := c.CreateSandbox(ctx, req)
	if err != nil {
		return 0, 0, false, err
	}
	call = time.Since(t0)
	defer c.DeleteSandbox(context.WithoutCancel(ctx), sb.ID)
	_, stderr, code, err := c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"true"}})
	total = time.Since(t0)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, stderr)
	}
	return total, call, sb.LastResume != nil && sb.LastResume.Forked, err
}

// waitPoolReady waits until image's pool has n clones ready.
func waitPoolReady(ctx context.Context, c *client.Client, image string, n int) (apiv1.Pool, error) {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		pools, err := c.ListPools(ctx)
		if err != nil {
			return apiv1.Pool{}, err
		}
		for _, p := range pools {
			if p.Template == "image" && p.Name == image && p.Ready >= n {
				return p, nil
			}
		}
		if time.Now().After(deadline) {
			return apiv1.Pool{}, errors.New("the pool did not fill in 5 minutes")
		}
		select {
		case <-ctx.Done():
			return apiv1.Pool{}, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// PrintPool writes r as a table, or as JSON.
func PrintPool(w io.Writer, r PoolResult, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			PoolResult
			RatioP50 float64 `json:"ratio_p50"`
			TargetMS float64 `json:"target_pooled_p50_ms"`
		}{r, r.RatioP50(), TargetPoolCreateP50MS})
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "create -> first exec (image %s, pool of %d)\tp50 ms\tp90 ms\tp99 ms\tmax ms\tn\n", r.Image, r.PoolSize)
	for _, row := range []struct {
		name string
		s    Summary
	}{{"pooled", r.Pooled}, {"  of which the create call", r.PooledCall}, {"unpooled", r.Unpooled},
		{"  of which the create call", r.UnpooledCall}, {"pool refill (one clone)", r.Refill}} {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%d\n", row.name, row.s.P50, row.s.P90, row.s.P99, row.s.Max, row.s.N)
	}
	met := "met"
	if r.Pooled.P50 > TargetPoolCreateP50MS {
		met = "missed"
	}
	fmt.Fprintf(tw, "pooled / unpooled p50\t%.3f\n", r.RatioP50())
	fmt.Fprintf(tw, "target pooled p50 <= %.0f ms\t%s\n", TargetPoolCreateP50MS, met)
	return tw.Flush()
}
