package cli

import (
	"context"
	"io"
	"os"

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
		// Progress lines go to stderr so that --json output stays clean.
		Progress: os.Stderr,
	})
}
