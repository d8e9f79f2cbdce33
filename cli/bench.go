//go:build torpor_bench

package cli

import (
	"context"
	"io"

	"github.com/torpor/torpor/bench"
)

func runBenchResume(ctx context.Context, o benchResumeOptions, out io.Writer) error {
	return bench.Resume(ctx, bench.Options{
		URL:            o.URL,
		Cycles:         o.Cycles,
		WorkingSetsMiB: o.WorkingSetsMiB,
		JSON:           o.JSON,
		Out:            out,
	})
}
