package cli

import (
	"context"
	"io"
	"os"

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
		// Progress lines go to stderr so that --json output stays clean.
		Progress: os.Stderr,
	})
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
