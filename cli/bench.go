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
		// Progress lines go to stderr so that --json output stays clean; the
		// server's data dir (for the raw runsc measurement's image file) comes
		// from $TORPOR_DATA_DIR, else /var/lib/torpor.
		Progress: os.Stderr,
	})
}
