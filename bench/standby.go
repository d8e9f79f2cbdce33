package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/workload"
)

// Defaults of StandbyOptions.
const (
	DefaultStandbyPaused     = 20
	DefaultStandbyHibernated = 100
	DefaultStandbyWindow     = 60 * time.Second
	DefaultStandbyMemoryMiB  = 256
	// standbyWorkingSetMiB is the data each sandbox's workload holds.
	standbyWorkingSetMiB = 8
	// standbySetup is how many sandboxes are set up at once.
	standbySetup = 4
)

// StandbyOptions configure Standby.
type StandbyOptions struct {
	// URL is the torpor server ("" = $TORPOR_URL, else client.DefaultURL).
	URL string
	// Paused and Hibernated are how many sandboxes rest in each tier (default 20
	// and 100); Window how long they rest while measured (default 60 s);
	// MemoryMiB each sandbox's memory (default 256).
	Paused, Hibernated int
	Window             time.Duration
	MemoryMiB          int
	// JSON prints the result as JSON instead of a table.
	JSON bool
	// Out receives the result (nil = os.Stdout); Progress one line per phase
	// (nil = Out for tables, nothing for JSON).
	Out, Progress io.Writer
}

// StandbyResult is what sandboxes cost at rest in each tier.
type StandbyResult struct {
	Paused, Hibernated int
	WindowS            float64
	MemoryMiB          int
	// PausedCPUMS is the CPU time, in ms, each paused sandbox's cgroup used
	// over the window (GET …/metrics at its start and end); PausedCPUTotalMS
	// their sum.
	PausedCPUMS      Summary
	PausedCPUTotalMS float64
	// PausedMemoryMiB is what each paused sandbox's cgroup holds at the end.
	PausedMemoryMiB Summary
	// HibernatedSnapshotMiB is each hibernated sandbox's snapshot size (its
	// whole cost: it holds no memory).
	HibernatedSnapshotMiB Summary
	// HibernatedWithInstance counts hibernated sandboxes that answered metrics
	// (an instance on the host) at the window's end; HibernatedProcesses the
	// host processes whose command line names a hibernated sandbox (-1 when
	// /proc cannot be read: the benchmark is not on the server's host). Both
	// should be 0.
	HibernatedWithInstance int
	HibernatedProcesses    int
}

func (o *StandbyOptions) defaults() {
	if o.Paused < 0 {
		o.Paused = 0
	} else if o.Paused == 0 {
		o.Paused = DefaultStandbyPaused
	}
	if o.Hibernated < 0 {
		o.Hibernated = 0
	} else if o.Hibernated == 0 {
		o.Hibernated = DefaultStandbyHibernated
	}
	if o.Window <= 0 {
		o.Window = DefaultStandbyWindow
	}
	if o.MemoryMiB <= 0 {
		o.MemoryMiB = DefaultStandbyMemoryMiB
	}
	o.Out, o.Progress = outputs(o.Out, o.Progress, o.JSON)
}

// Standby measures what resting sandboxes cost: it sets up opts.Paused paused
// and opts.Hibernated hibernated sandboxes (each running the benchmark's
// workload, a Python server holding 8 MiB), lets them rest opts.Window, and
// reports the paused ones' CPU time and memory and the hibernated ones'
// snapshot sizes and host footprint; then it deletes them all. It prints the
// result (a table, or JSON with opts.JSON) and returns it. A negative count
// leaves that tier out. Errors: no server answers, or a sandbox could not be
// set up or measured (sandboxes made so far are deleted).
func Standby(ctx context.Context, opts StandbyOptions) (StandbyResult, error) {
	opts.defaults()
	res := StandbyResult{Paused: opts.Paused, Hibernated: opts.Hibernated, WindowS: opts.Window.Seconds(), MemoryMiB: opts.MemoryMiB}
	c := client.New(opts.URL)
	if err := c.Health(ctx); err != nil {
		return res, fmt.Errorf("bench: no torpor server answers at %s: %w", c.BaseURL, err)
	}
	var (
		mu      sync.Mutex
		made    []string
		paused  []string
		hibern  []string
		snapMiB []float64
	)
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		fmt.Fprintf(opts.Progress, "deleting %d sandboxes…\n", len(made))
		for _, id := range made {
			_ = c.DeleteSandbox(dctx, id)
		}
	}()
	never := 0
	setup := func(pause bool) error {
		sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: opts.MemoryMiB, IdleTimeoutS: &never, PauseAfterS: &never})
		if err != nil {
			return fmt.Errorf("bench: create sandbox: %w", err)
		}
		mu.Lock()
		made = append(made, sb.ID)
		mu.Unlock()
		if err := workload.Start(ctx, c, sb.ID, standbyWorkingSetMiB); err != nil {
			return err
		}
		if pause {
			if _, err := c.Pause(ctx, sb.ID); err != nil {
				return fmt.Errorf("bench: pause %s: %w", sb.ID, err)
			}
			mu.Lock()
			paused = append(paused, sb.ID)
			mu.Unlock()
			return nil
		}
		h, err := c.Hibernate(ctx, sb.ID)
		if err != nil {
			return fmt.Errorf("bench: hibernate %s: %w", sb.ID, err)
		}
		mu.Lock()
		hibern = append(hibern, sb.ID)
		if h.Snapshot != nil {
			snapMiB = append(snapMiB, float64(h.Snapshot.Bytes)/(1<<20))
		}
		mu.Unlock()
		return nil
	}
	fmt.Fprintf(opts.Progress, "setting up %d hibernated and %d paused sandboxes (memory %d MiB, %d at a time)…\n",
		opts.Hibernated, opts.Paused, opts.MemoryMiB, standbySetup)
	jobs := make(chan bool)
	errs := make(chan error, standbySetup)
	var wg sync.WaitGroup
	for range standbySetup {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var first error
			for pause := range jobs {
				if first == nil {
					first = setup(pause)
				}
			}
			errs <- first
		}()
	}
	for i := 0; i < opts.Hibernated+opts.Paused; i++ {
		jobs <- i >= opts.Hibernated // hibernated ones first: paused ones rest the least
	}
	close(jobs)
	wg.Wait()
	close(errs)
	var setupErrs []error
	for err := range errs {
		setupErrs = append(setupErrs, err)
	}
	if err := errors.Join(setupErrs...); err != nil {
		return res, err
	}
	res.HibernatedSnapshotMiB = Summarize(snapMiB)

	// The pauses' snapshot commits end before the window starts.
	time.Sleep(time.Second)
	start := make(map[string]float64, len(paused))
	for _, id := range paused {
		m, err := c.SandboxMetrics(ctx, id)
		if err != nil {
			return res, fmt.Errorf("bench: metrics of paused %s: %w", id, err)
		}
		start[id] = m.CPUTimeS
	}
	fmt.Fprintf(opts.Progress, "resting %s…\n", opts.Window)
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(opts.Window):
	}
	var cpu, mem []float64
	for _, id := range paused {
		m, err := c.SandboxMetrics(ctx, id)
		if err != nil {
			return res, fmt.Errorf("bench: metrics of paused %s: %w", id, err)
		}
		if m.State != string(apiv1.StatePaused) {
			return res, fmt.Errorf("bench: %s is %s after resting, not paused (a standby budget demoted it, or something woke it)", id, m.State)
		}
		d := (m.CPUTimeS - start[id]) * 1000
		cpu = append(cpu, d)
		res.PausedCPUTotalMS += d
		mem = append(mem, float64(m.MemoryBytes)/(1<<20))
	}
	res.PausedCPUMS, res.PausedMemoryMiB = Summarize(cpu), Summarize(mem)
	for _, id := range hibern {
		if _, err := c.SandboxMetrics(ctx, id); err == nil {
			res.HibernatedWithInstance++
		} else if !client.IsConflict(err) {
			return res, fmt.Errorf("bench: metrics of hibernated %s: %w", id, err)
		}
	}
	res.HibernatedProcesses = processesNaming(hibern)
	if opts.JSON {
		b, err := json.Marshal(res)
		if err != nil {
			return res, err
		}
		_, err = fmt.Fprintf(opts.Out, "%s\n", b)
		return res, err
	}
	return res, WriteStandby(opts.Out, res)
}

// processesNaming counts the host processes whose command line contains one
// of ids, or returns -1 when /proc has no process to read.
func processesNaming(ids []string) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	if len(dirs) == 0 {
		return -1
	}
	self := fmt.Sprint(os.Getpid())
	n := 0
	for _, d := range dirs {
		if filepath.Base(d) == self {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		for _, id := range ids {
			if bytes.Contains(cmd, []byte(id)) {
				n++
				break
			}
		}
	}
	return n
}

// WriteStandby prints r as a table.
func WriteStandby(w io.Writer, r StandbyResult) error {
	var b strings.Builder
	fmt.Fprintf(&b, "standby tiers: %d paused, %d hibernated sandboxes (memory %d MiB, workload holding %d MiB), resting %.0f s\n",
		r.Paused, r.Hibernated, r.MemoryMiB, standbyWorkingSetMiB, r.WindowS)
	row := summaryTable(&b, "per sandbox", 44, 2)
	row("paused: CPU over the window (ms)", r.PausedCPUMS)
	row("paused: memory held (MiB)", r.PausedMemoryMiB)
	row("hibernated: snapshot (MiB; no memory)", r.HibernatedSnapshotMiB)
	fmt.Fprintf(&b, "paused: CPU of all %d over %.0f s: %.1f ms (%.4f%% of one core)\n", r.Paused, r.WindowS, r.PausedCPUTotalMS,
		r.PausedCPUTotalMS/(r.WindowS*1000)*100)
	procs := fmt.Sprint(r.HibernatedProcesses)
	if r.HibernatedProcesses < 0 {
		procs = "not counted (not on the server's host)"
	}
	fmt.Fprintf(&b, "hibernated: with an instance %d, host processes %s\n", r.HibernatedWithInstance, procs)
	_, err := io.WriteString(w, b.String())
	return err
}

// outputs fills in a benchmark's writers: out defaults to os.Stdout, progress
// to out for tables and to nothing for JSON.
func outputs(out, progress io.Writer, asJSON bool) (io.Writer, io.Writer) {
	if out == nil {
		out = os.Stdout
	}
	if progress == nil {
		if asJSON {
			progress = io.Discard
		} else {
			progress = out
		}
	}
	return out, progress
}
