package cli

import (
	"context"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/bench"
)

func runBenchResume(ctx context.Context, o benchResumeOptions, out io.Writer) error {
	return bench.Resume(ctx, bench.Options{
		URL:            o.URL,
		Cycles:         o.Cycles,
		WorkingSetsMiB: o.WorkingSetsMiB,
		JSON:           o.JSON,
		Out:            out,
		DataDir:        o.DataDir,
		RunscPath:      o.RunscPath,
		AgentPath:      o.AgentPath,
		Plot:           o.Plot,
		Wakes:          o.Wakes,
		ForkCycles:     o.ForkCycles,
		// Progress lines go to stderr so that --json output stays clean.
		Progress: os.Stderr,
	})
}

func (a *app) benchStandbyCommand() *cobra.Command {
	o := bench.StandbyOptions{}
	cmd := &cobra.Command{
		Use:   "standby [--paused 20] [--hibernated 100] [--window 60s] [--memory 256] [--json]",
		Short: "Measure what resting sandboxes cost in each tier: CPU and memory of paused ones, snapshot size and host footprint of hibernated ones",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.Paused < 0 || o.Hibernated < 0 || o.Paused+o.Hibernated == 0 {
				return usagef("--paused %d --hibernated %d: want counts of at least 0, not both 0", o.Paused, o.Hibernated)
			}
			if o.Window < time.Second {
				return usagef("--window %s: want at least 1s", o.Window)
			}
			if o.MemoryMiB < 128 {
				return usagef("--memory %d: want at least 128 (MiB)", o.MemoryMiB)
			}
			// 0 means "leave the tier out" here; the package reads it as its default.
			if o.Paused == 0 {
				o.Paused = -1
			}
			if o.Hibernated == 0 {
				o.Hibernated = -1
			}
			o.URL, o.Out, o.Progress = a.serverURL(), a.stdout, os.Stderr
			_, err := bench.Standby(cmd.Context(), o)
			return err
		},
	}
	cmd.Flags().IntVar(&o.Paused, "paused", bench.DefaultStandbyPaused, "paused sandboxes (0 = none)")
	cmd.Flags().IntVar(&o.Hibernated, "hibernated", bench.DefaultStandbyHibernated, "hibernated sandboxes (0 = none)")
	cmd.Flags().DurationVar(&o.Window, "window", bench.DefaultStandbyWindow, "how long they rest while measured")
	cmd.Flags().IntVar(&o.MemoryMiB, "memory", bench.DefaultStandbyMemoryMiB, "each sandbox's memory, MiB")
	cmd.Flags().BoolVar(&o.JSON, "json", false, "print the result as JSON")
	return cmd
}

// benchPoolCommand: torpor bench pool (bench.Pool).
func (a *app) benchPoolCommand() *cobra.Command {
	var o bench.PoolOptions
	cmd := &cobra.Command{
		Use:   "pool [--image base] [--size 2] [--samples 20] [--json]",
		Short: "Measure create -> first exec from an image's warm pool beside unpooled creates of the same image (the image's pool size is set back afterwards)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.Samples < 1 || o.PoolSize < 1 {
				return usagef("--samples and --size: want at least 1")
			}
			o.URL, o.Out, o.Progress = a.serverURL(), a.stdout, os.Stderr
			r, err := bench.Pool(cmd.Context(), o)
			if err != nil {
				return err
			}
			return bench.PrintPool(a.stdout, r, o.JSON)
		},
	}
	cmd.Flags().StringVar(&o.Image, "image", "base", "the template image")
	cmd.Flags().IntVar(&o.PoolSize, "size", 2, "the image's pool size during the run")
	cmd.Flags().IntVar(&o.Samples, "samples", 20, "timed creates of each kind")
	cmd.Flags().BoolVar(&o.JSON, "json", false, "print the result as JSON")
	return cmd
}
