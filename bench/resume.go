package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/workload"
)

// Defaults of Options.
const (
	DefaultCycles      = 20
	DefaultExecSamples = 30
	DefaultDataDir     = "/var/lib/torpor"
	// execWarmup execs are run and not counted before the exec samples.
	execWarmup = 3
)

// DefaultWorkingSetsMiB are the working-set sizes measured when none are given.
var DefaultWorkingSetsMiB = []int{64, 512}

// Targets the benchmark checks.
const (
	TargetResumeRatio = 1.3 // torpor time to first request p50 ≤ 1.3 × raw restore p50
	// TargetFastRatio: resume p50 ≤ 0.7 × raw restore p50 (the restore's
	// set-up off the request's path: prepared containers); TargetSizeRatio:
	// the largest working set's resume p50 ≤ 1.3 × the smallest's.
	TargetFastRatio   = 0.7
	TargetSizeRatio   = 1.3
	TargetExecP50MS   = 20.0
	TargetPausedP50MS = 10.0 // paused -> first request p50
)

// pausedRest is how long a paused sandbox rests before its first request in
// the paused cycles: the pause's snapshot commit and its disk writes are done
// by then, as they are for a sandbox paused by its idle policy.
const pausedRest = time.Second

// hibernateRest is how long a hibernated sandbox rests before its first
// request in the hibernate cycles, as one hibernated by its idle policy
// does before a user comes back: the engine prepares the next resume's
// container in that time (gvisor.Config.PreparedContainers). The raw
// baseline rests as long between its checkpoint and its restore.
const hibernateRest = time.Second

// Options configure Resume and Measure.
type Options struct {
	// URL is the torpor server ("" = $TORPOR_URL, else client.DefaultURL).
	URL string
	// Cycles is the number of hibernate/resume cycles per working set (default 20);
	// the raw runsc measurement runs as many checkpoint/restore cycles.
	Cycles int
	// WorkingSetsMiB are the sizes of the workload's data, one measurement each
	// (default 64 and 512).
	WorkingSetsMiB []int
	// JSON prints the results as JSON instead of tables.
	JSON bool
	// Out receives the results (nil = os.Stdout).
	Out io.Writer
	// Progress receives one line per phase (nil = Out for tables, nothing for JSON).
	Progress io.Writer

	// ExecSamples is the number of timed `true` execs per working set (default 30),
	// after a few untimed ones.
	ExecSamples int

	// The raw runsc measurement needs root, runsc, the guest agent binary and the
	// server's image file; without any of them it is skipped with a reason.
	//
	// DataDir is the server's data directory, where the image file of "base" is
	// (default $TORPOR_DATA_DIR, else /var/lib/torpor).
	DataDir string
	// RunscPath is runsc (default $TORPOR_RUNSC, else runsc in PATH).
	RunscPath string
	// AgentPath is the torpor-agent binary (default $TORPOR_AGENT, else
	// torpor-agent next to the running executable).
	AgentPath string
	// ScratchDir holds the raw engine's state and checkpoint images (default the
	// system's temporary directory).
	ScratchDir string
	// SkipRaw leaves the raw runsc measurement out.
	SkipRaw bool
	// Wakes is how many hibernated sandboxes are woken at once, at the first
	// working set only, in DefaultWakeRounds rounds; 0 leaves the case out
	// (the CLI's default is DefaultWakes).
	Wakes int
	// ForkCycles is how many forks of count 1 and of count 4 of the running
	// sandbox are measured per working set; 0 leaves the case out (the CLI's
	// default is DefaultForkCycles).
	ForkCycles int
	// Plot, when set, is a PNG file that Resume draws the latency distributions
	// into (WritePlot: one panel per working set, each tier beside raw runsc).
	Plot string
}

// Result is the measurement of one working set. Times are in milliseconds.
type Result struct {
	WorkingSetMiB int
	MemoryMiB     int
	Cycles        int
	// Resume is the time to first request: a proxied GET /count to a hibernated
	// sandbox, until its answer.
	Resume    Summary
	Hibernate Summary
	Exec      Summary
	// Paused is the time to first request from the paused tier: a proxied GET
	// /count to a paused sandbox (paused pausedRest before), until its answer.
	// Pause is the pause call, with its snapshot of the paused state.
	// UnpauseWindow is the resume contract's window of the unpause.
	Paused        Summary
	Pause         Summary
	UnpauseWindow Summary
	// Window is the resume contract's window (last_resume.window_ms, measured by the
	// server): how long user processes ran after the restore before they were
	// notified of it.
	Window Summary
	// SnapshotBytes is the median snapshot size.
	SnapshotBytes int64
	// Raw is runsc alone; nil when skipped (RawSkipped says why).
	RawCheckpoint *Summary
	RawRestore    *Summary
	RawSkipped    string
	// Wakes is, for Wakes hibernated sandboxes woken at once, each one's time
	// from the round's start to its first answer (N = 0 when not measured).
	Wakes Summary
	// Fork1 is a fork (count 1) of the running sandbox until its clone's first
	// answer; Fork4First and Fork4All a fork of 4 until its first clone
	// answers and until all have (N = 0 when not measured).
	Fork1, Fork4First, Fork4All Summary
}

// WakesRatio is Wakes.P99 / Resume.P50: concurrent wakes against one wake
// (0 when not measured).
func (r Result) WakesRatio() float64 {
	if r.Wakes.N == 0 || r.Resume.P50 == 0 {
		return 0
	}
	return r.Wakes.P99 / r.Resume.P50
}

// Fork4Ratio is Fork4First.P50 / Fork1.P50 (0 when not measured).
func (r Result) Fork4Ratio() float64 {
	if r.Fork1.N == 0 || r.Fork1.P50 == 0 {
		return 0
	}
	return r.Fork4First.P50 / r.Fork1.P50
}

// RatioP50 is Resume.P50 / RawRestore.P50 (0 without a raw measurement).
func (r Result) RatioP50() float64 {
	if r.RawRestore == nil || r.RawRestore.P50 == 0 {
		return 0
	}
	return r.Resume.P50 / r.RawRestore.P50
}

func (o *Options) defaults() {
	if o.Cycles <= 0 {
		o.Cycles = DefaultCycles
	}
	if len(o.WorkingSetsMiB) == 0 {
		o.WorkingSetsMiB = DefaultWorkingSetsMiB
	}
	o.Out, o.Progress = outputs(o.Out, o.Progress, o.JSON)
	if o.ExecSamples <= 0 {
		o.ExecSamples = DefaultExecSamples
	}
	if o.DataDir == "" {
		o.DataDir = os.Getenv("TORPOR_DATA_DIR")
	}
	if o.DataDir == "" {
		o.DataDir = DefaultDataDir
	}
	if o.RunscPath == "" {
		o.RunscPath = os.Getenv("TORPOR_RUNSC")
	}
	if o.RunscPath == "" {
		if p, err := exec.LookPath("runsc"); err == nil {
			o.RunscPath = p
		}
	}
	if o.AgentPath == "" {
		o.AgentPath = os.Getenv("TORPOR_AGENT")
	}
	if o.AgentPath == "" {
		if exe, err := os.Executable(); err == nil {
			if r, err := filepath.EvalSymlinks(exe); err == nil {
				exe = r
			}
			o.AgentPath = filepath.Join(filepath.Dir(exe), "torpor-agent")
		}
	}
}

// Resume runs the resume benchmark and prints its results (tables, or JSON with
// opts.JSON).
func Resume(ctx context.Context, opts Options) error {
	opts.defaults()
	results, err := Measure(ctx, opts)
	if len(results) > 0 {
		var perr error
		if opts.JSON {
			perr = WriteJSON(opts.Out, results)
		} else {
			perr = WriteTables(opts.Out, results)
		}
		if err == nil {
			err = perr
		}
		if opts.Plot != "" {
			perr = WritePlot(opts.Plot, Panels(results))
			if perr == nil {
				fmt.Fprintf(opts.Progress, "plot written to %s\n", opts.Plot)
			}
			if err == nil {
				err = perr
			}
		}
	}
	return err
}

// Measure runs the benchmark and returns one result per working set. A failure of
// the raw part is returned as an error together with all results.
func Measure(ctx context.Context, opts Options) ([]Result, error) {
	opts.defaults()
	c := client.New(opts.URL)
	if err := c.Health(ctx); err != nil {
		return nil, fmt.Errorf("bench: no torpor server answers at %s: %w", c.BaseURL, err)
	}
	var (
		results []Result
		rawErrs []error
		raw     *rawEngine
		rawWhy  string
	)
	defer func() {
		if raw != nil {
			raw.close()
		}
	}()
	for i, ws := range opts.WorkingSetsMiB {
		r, script, digest, err := measureTorpor(ctx, c, opts, ws)
		if err != nil {
			return results, err
		}
		if i == 0 && opts.Wakes > 0 {
			fmt.Fprintf(opts.Progress, "%d MiB: %d hibernated sandboxes woken at once, %d rounds…\n", ws, opts.Wakes, DefaultWakeRounds)
			w, err := measureWakes(ctx, c, ws, r.MemoryMiB, opts.Wakes, DefaultWakeRounds)
			if err != nil {
				return results, err
			}
			r.Wakes = Summarize(w)
		}
		switch {
		case opts.SkipRaw:
			r.RawSkipped = "not asked for"
		case raw == nil && rawWhy == "":
			raw, rawWhy = newRawEngine(opts, c, digest)
			if raw != nil {
				raw.rest = hibernateRest
			}
		}
		if raw == nil && r.RawSkipped == "" {
			r.RawSkipped = rawWhy
			fmt.Fprintf(opts.Progress, "%d MiB: raw runsc measurement skipped: %s\n", ws, rawWhy)
		}
		if raw != nil {
			fmt.Fprintf(opts.Progress, "%d MiB: raw runsc checkpoint/restore, %d cycles…\n", ws, opts.Cycles)
			ck, rs, err := raw.measure(ctx, ws, r.MemoryMiB, script, opts.Cycles)
			if err != nil {
				if ctx.Err() != nil {
					return results, ctx.Err()
				}
				r.RawSkipped = "failed: " + err.Error()
				rawErrs = append(rawErrs, fmt.Errorf("bench: raw runsc measurement at %d MiB: %w", ws, err))
			} else {
				cks, rss := Summarize(ck), Summarize(rs)
				r.RawCheckpoint, r.RawRestore = &cks, &rss
			}
		}
		results = append(results, r)
	}
	return results, errors.Join(rawErrs...)
}

// memoryFor is the sandbox memory for a working set: twice the data (the workload
// briefly holds it twice while it starts: os.urandom's bytes and the bytearray
// copy) plus 256 MiB of headroom, rounded up to a multiple of 512 MiB: 512 MiB
// for 64 MiB, 1536 MiB for 512 MiB. With only the data plus 256 MiB (1024 MiB for
// 512 MiB) the sandbox dies while the workload starts.
func memoryFor(wsMiB int) int {
	m := 2*wsMiB + 256
	return (m + 511) / 512 * 512
}

// measureTorpor runs the torpor side for one working set. It also returns the
// workload script as it is in the sandbox and the sandbox's image digest, for the
// raw measurement.
func measureTorpor(ctx context.Context, c *client.Client, opts Options, ws int) (r Result, script []byte, digest string, err error) {
	r = Result{WorkingSetMiB: ws, MemoryMiB: memoryFor(ws), Cycles: opts.Cycles}
	fmt.Fprintf(opts.Progress, "%d MiB: creating a sandbox (memory %d MiB) and starting the workload…\n", ws, r.MemoryMiB)
	// No idle timeout: the benchmark's pauses and hibernates are its own.
	never := 0
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: r.MemoryMiB, IdleTimeoutS: &never})
	if err != nil {
		return r, nil, "", fmt.Errorf("bench: create sandbox: %w", err)
	}
	id := sb.ID
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if derr := c.DeleteSandbox(dctx, id); derr != nil && err == nil {
			err = fmt.Errorf("bench: delete sandbox %s: %w", id, derr)
		}
	}()
	if err := workload.Start(ctx, c, id, ws); err != nil {
		return r, nil, "", err
	}
	st, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		return r, nil, "", err
	}
	count := st.Count
	rc, err := c.ReadFile(ctx, id, workload.ScriptPath)
	if err != nil {
		return r, nil, "", fmt.Errorf("bench: read workload script: %w", err)
	}
	script, err = io.ReadAll(rc)
	rc.Close()
	if err != nil {
		return r, nil, "", fmt.Errorf("bench: read workload script: %w", err)
	}

	fmt.Fprintf(opts.Progress, "%d MiB: %d hibernate / resume-on-request cycles on %s…\n", ws, opts.Cycles, id)
	var hib, res, snap, win []float64
	for i := 0; i < opts.Cycles; i++ {
		t0 := time.Now()
		h, err := c.Hibernate(ctx, id)
		if err != nil {
			return r, nil, "", fmt.Errorf("bench: cycle %d: hibernate: %w", i+1, err)
		}
		hms := msOf(time.Since(t0))
		if h.Snapshot != nil {
			if h.Snapshot.HibernateMS > 0 {
				hms = float64(h.Snapshot.HibernateMS)
			}
			snap = append(snap, float64(h.Snapshot.Bytes))
		}
		hib = append(hib, hms)
		time.Sleep(hibernateRest)

		t0 = time.Now()
		st, err := workload.Get(ctx, c, id, "/count")
		d := time.Since(t0)
		if err != nil {
			return r, nil, "", fmt.Errorf("bench: cycle %d: first request after hibernate: %w", i+1, err)
		}
		if st.Count != count+1 {
			return r, nil, "", fmt.Errorf("bench: cycle %d: the counter did not continue: %d before hibernate, %d after", i+1, count, st.Count)
		}
		count = st.Count
		res = append(res, msOf(d))
		if sb, err := c.GetSandbox(ctx, id); err == nil && sb.LastResume != nil {
			win = append(win, sb.LastResume.WindowMS)
		}
	}
	r.Hibernate, r.Resume, r.Window = Summarize(hib), Summarize(res), Summarize(win)
	r.SnapshotBytes = int64(Percentile(snap, 50))

	fmt.Fprintf(opts.Progress, "%d MiB: %d pause / unpause-on-request cycles on %s…\n", ws, opts.Cycles, id)
	if count, err = measurePaused(ctx, c, id, count, opts.Cycles, &r); err != nil {
		return r, nil, "", err
	}

	if opts.ForkCycles > 0 {
		fmt.Fprintf(opts.Progress, "%d MiB: %d forks of 1 and of 4 clones of %s…\n", ws, opts.ForkCycles, id)
		one, first, all, err := measureFork(ctx, c, id, opts.ForkCycles)
		if err != nil {
			return r, nil, "", err
		}
		r.Fork1, r.Fork4First, r.Fork4All = Summarize(one), Summarize(first), Summarize(all)
	}

	fmt.Fprintf(opts.Progress, "%d MiB: exec latency of `true`, %d samples…\n", ws, opts.ExecSamples)
	var ex []float64
	for i := 0; i < execWarmup+opts.ExecSamples; i++ {
		t0 := time.Now()
		_, stderr, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"true"}})
		d := time.Since(t0)
		if err != nil {
			return r, nil, "", fmt.Errorf("bench: exec true: %w", err)
		}
		if code != 0 {
			return r, nil, "", fmt.Errorf("bench: exec true: exit code %d: %s", code, bytes.TrimSpace(stderr))
		}
		if i >= execWarmup {
			ex = append(ex, msOf(d))
		}
	}
	r.Exec = Summarize(ex)
	return r, script, sb.ImageDigest, nil
}

// measurePaused runs cycles pause / first-request cycles on running sandbox
// id, whose workload's counter is at count, into r's Paused, Pause and
// UnpauseWindow. It returns the counter.
func measurePaused(ctx context.Context, c *client.Client, id string, count int64, cycles int, r *Result) (int64, error) {
	var paused, pause, win []float64
	for i := 0; i < cycles; i++ {
		t0 := time.Now()
		p, err := c.Pause(ctx, id)
		if err != nil {
			return count, fmt.Errorf("bench: cycle %d: pause: %w", i+1, err)
		}
		if p.State != apiv1.StatePaused {
			return count, fmt.Errorf("bench: cycle %d: pause answered state %s", i+1, p.State)
		}
		pause = append(pause, msOf(time.Since(t0)))
		time.Sleep(pausedRest)
		t0 = time.Now()
		st, err := workload.Get(ctx, c, id, "/count")
		d := time.Since(t0)
		if err != nil {
			return count, fmt.Errorf("bench: cycle %d: first request after pause: %w", i+1, err)
		}
		if st.Count != count+1 {
			return count, fmt.Errorf("bench: cycle %d: the counter did not continue: %d before the pause, %d after", i+1, count, st.Count)
		}
		count = st.Count
		paused = append(paused, msOf(d))
		if sb, err := c.GetSandbox(ctx, id); err == nil && sb.LastResume != nil && sb.LastResume.Event == "unpaused" {
			win = append(win, sb.LastResume.WindowMS)
		}
	}
	r.Paused, r.Pause, r.UnpauseWindow = Summarize(paused), Summarize(pause), Summarize(win)
	return count, nil
}

// summaryTable writes the header of a table of Summaries (first column
// label, width characters wide) to b and returns the function that writes one
// row, its figures with prec decimals.
func summaryTable(b *strings.Builder, label string, width, prec int) func(name string, s Summary) {
	fmt.Fprintf(b, "  %-*s %9s %9s %9s %9s %4s\n", width, label, "p50", "p90", "p99", "max", "n")
	return func(name string, s Summary) {
		fmt.Fprintf(b, "  %-*s %9.*f %9.*f %9.*f %9.*f %4d\n", width, name, prec, s.P50, prec, s.P90, prec, s.P99, prec, s.Max, s.N)
	}
}

// WriteTables prints one table per result.
func WriteTables(w io.Writer, results []Result) error {
	var b strings.Builder
	for i, r := range results {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "working set %d MiB (sandbox memory %d MiB, %d cycles, snapshot %.1f MiB)\n",
			r.WorkingSetMiB, r.MemoryMiB, r.Cycles, float64(r.SnapshotBytes)/(1<<20))
		row := summaryTable(&b, "metric (ms)", 34, 1)
		row("time to first request (resume)", r.Resume)
		row("resume contract window", r.Window)
		row("hibernate", r.Hibernate)
		row("time to first request (paused)", r.Paused)
		row("unpause contract window", r.UnpauseWindow)
		row("pause (with its snapshot)", r.Pause)
		row("exec true", r.Exec)
		if r.Wakes.N > 0 {
			row(fmt.Sprintf("%d concurrent wakes, each", r.Wakes.N/DefaultWakeRounds), r.Wakes)
		}
		if r.Fork1.N > 0 {
			row("fork 1 → clone answers", r.Fork1)
			row("fork 4 → first clone answers", r.Fork4First)
			row("fork 4 → all clones answer", r.Fork4All)
		}
		if r.RawRestore != nil {
			row("raw runsc restore to first answer", *r.RawRestore)
			row("raw runsc checkpoint", *r.RawCheckpoint)
		}
		if r.RawRestore != nil {
			ratio := r.RatioP50()
			fmt.Fprintf(&b, "ratio_p50 (torpor resume / raw restore): %.2f\n", ratio)
			fmt.Fprintf(&b, "target: resume p50 within %.1f× raw: %s (%.2f×)\n", TargetResumeRatio, passMiss(ratio <= TargetResumeRatio), ratio)
			fmt.Fprintf(&b, "target: resume p50 ≤ %.1f× raw (restore off the critical path): %s (%.2f×)\n", TargetFastRatio, passMiss(ratio <= TargetFastRatio), ratio)
		} else {
			fmt.Fprintf(&b, "raw runsc measurement skipped: %s\n", r.RawSkipped)
			fmt.Fprintf(&b, "target: resume p50 within %.1f× raw: not measured\n", TargetResumeRatio)
		}
		fmt.Fprintf(&b, "target: exec p50 ≤ %.0f ms: %s (%.1f ms)\n", TargetExecP50MS, passMiss(r.Exec.P50 <= TargetExecP50MS), r.Exec.P50)
		if r.Paused.N > 0 {
			fmt.Fprintf(&b, "target: paused -> first request p50 ≤ %.0f ms: %s (%.1f ms)\n", TargetPausedP50MS, passMiss(r.Paused.P50 <= TargetPausedP50MS), r.Paused.P50)
		}
		if r.Wakes.N > 0 {
			fmt.Fprintf(&b, "target: concurrent wakes p99 ≤ %.0f× one resume's p50: %s (%.2f×)\n", TargetWakesRatio, passMiss(r.WakesRatio() <= TargetWakesRatio), r.WakesRatio())
		}
		if r.Fork1.N > 0 {
			fmt.Fprintf(&b, "target: fork → clone answers p50 ≤ %.0f ms: %s (%.1f ms)\n", TargetForkMS, passMiss(r.Fork1.P50 <= TargetForkMS), r.Fork1.P50)
			fmt.Fprintf(&b, "target: fork of 4 ≤ %.1f× fork of 1 (first clone, p50): %s (%.2f×)\n", TargetFork4Ratio, passMiss(r.Fork4Ratio() <= TargetFork4Ratio), r.Fork4Ratio())
		}
	}
	if lo, hi, ok := sizeSpan(results); ok {
		ratio := hi.Resume.P50 / lo.Resume.P50
		fmt.Fprintf(&b, "\nresume p50 %d MiB / %d MiB: %.2f×", hi.WorkingSetMiB, lo.WorkingSetMiB, ratio)
		if lo.RawRestore != nil && hi.RawRestore != nil {
			fmt.Fprintf(&b, " (raw restore: %.2f×)", hi.RawRestore.P50/lo.RawRestore.P50)
		}
		fmt.Fprintf(&b, "\ntarget: resume p50 of the largest working set ≤ %.1f× the smallest's: %s (%.2f×)\n", TargetSizeRatio, passMiss(ratio <= TargetSizeRatio), ratio)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// sizeSpan returns the results of the smallest and the largest working set,
// when there are two sizes with resumes measured.
func sizeSpan(results []Result) (lo, hi Result, ok bool) {
	for i, r := range results {
		if r.Resume.N == 0 {
			continue
		}
		if !ok || r.WorkingSetMiB < lo.WorkingSetMiB {
			lo = results[i]
		}
		if !ok || r.WorkingSetMiB > hi.WorkingSetMiB {
			hi = results[i]
		}
		ok = true
	}
	return lo, hi, ok && lo.WorkingSetMiB < hi.WorkingSetMiB && lo.Resume.P50 > 0
}

func passMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

// jsonResult is the JSON form of a Result (field names are part of the CLI's
// interface). Raw fields are null when the raw measurement was skipped.
type jsonResult struct {
	WorkingSetMiB      int      `json:"working_set_mib"`
	ResumeP50MS        float64  `json:"resume_p50_ms"`
	ResumeP90MS        float64  `json:"resume_p90_ms"`
	ResumeP99MS        float64  `json:"resume_p99_ms"`
	ResumeMaxMS        float64  `json:"resume_max_ms"`
	RawRestoreP50MS    *float64 `json:"raw_restore_p50_ms"`
	RawRestoreP90MS    *float64 `json:"raw_restore_p90_ms"`
	RawCheckpointP50MS *float64 `json:"raw_checkpoint_p50_ms"`
	RatioP50           *float64 `json:"ratio_p50"`
	HibernateP50MS     float64  `json:"hibernate_p50_ms"`
	HibernateP90MS     float64  `json:"hibernate_p90_ms"`
	HibernateP99MS     float64  `json:"hibernate_p99_ms"`
	SnapshotBytes      int64    `json:"snapshot_bytes"`
	ExecP50MS          float64  `json:"exec_p50_ms"`
	ExecP90MS          float64  `json:"exec_p90_ms"`
	ExecP99MS          float64  `json:"exec_p99_ms"`
	WindowP50MS        float64  `json:"window_p50_ms"`
	WindowP99MS        float64  `json:"window_p99_ms"`
	PausedP50MS        float64  `json:"paused_p50_ms"`
	PausedP90MS        float64  `json:"paused_p90_ms"`
	PausedP99MS        float64  `json:"paused_p99_ms"`
	PauseP50MS         float64  `json:"pause_p50_ms"`
	UnpauseWindowP50MS float64  `json:"unpause_window_p50_ms"`
	WakesP50MS         *float64 `json:"wakes_p50_ms"`
	WakesP99MS         *float64 `json:"wakes_p99_ms"`
	WakesRatio         *float64 `json:"wakes_ratio"`
	Fork1P50MS         *float64 `json:"fork1_p50_ms"`
	Fork4FirstP50MS    *float64 `json:"fork4_first_p50_ms"`
	Fork4AllP50MS      *float64 `json:"fork4_all_p50_ms"`
	Cycles             int      `json:"cycles"`
}

// WriteJSON prints {"results":[…]} on one line.
func WriteJSON(w io.Writer, results []Result) error {
	out := struct {
		Results []jsonResult `json:"results"`
	}{Results: []jsonResult{}}
	for _, r := range results {
		j := jsonResult{
			WorkingSetMiB: r.WorkingSetMiB,
			ResumeP50MS:   round3(r.Resume.P50), ResumeP90MS: round3(r.Resume.P90),
			ResumeP99MS: round3(r.Resume.P99), ResumeMaxMS: round3(r.Resume.Max),
			HibernateP50MS: round3(r.Hibernate.P50), HibernateP90MS: round3(r.Hibernate.P90),
			HibernateP99MS: round3(r.Hibernate.P99),
			SnapshotBytes:  r.SnapshotBytes,
			ExecP50MS:      round3(r.Exec.P50), ExecP90MS: round3(r.Exec.P90), ExecP99MS: round3(r.Exec.P99),
			WindowP50MS: round3(r.Window.P50), WindowP99MS: round3(r.Window.P99),
			PausedP50MS: round3(r.Paused.P50), PausedP90MS: round3(r.Paused.P90), PausedP99MS: round3(r.Paused.P99),
			PauseP50MS: round3(r.Pause.P50), UnpauseWindowP50MS: round3(r.UnpauseWindow.P50),
			Cycles: r.Cycles,
		}
		if r.RawRestore != nil {
			j.RawRestoreP50MS = ptr(round3(r.RawRestore.P50))
			j.RawRestoreP90MS = ptr(round3(r.RawRestore.P90))
			j.RawCheckpointP50MS = ptr(round3(r.RawCheckpoint.P50))
			j.RatioP50 = ptr(round3(r.RatioP50()))
		}
		if r.Wakes.N > 0 {
			j.WakesP50MS, j.WakesP99MS, j.WakesRatio = ptr(round3(r.Wakes.P50)), ptr(round3(r.Wakes.P99)), ptr(round3(r.WakesRatio()))
		}
		if r.Fork1.N > 0 {
			j.Fork1P50MS, j.Fork4FirstP50MS, j.Fork4AllP50MS = ptr(round3(r.Fork1.P50)), ptr(round3(r.Fork4First.P50)), ptr(round3(r.Fork4All.P50))
		}
		out.Results = append(out.Results, j)
	}
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

func round3(v float64) float64 { return math.Round(v*1000) / 1000 }

func ptr(v float64) *float64 { return &v }
