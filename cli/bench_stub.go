//go:build !torpor_bench

package cli

import (
	"context"
	"errors"
	"io"
)

// Until package bench exists, bench.go (build tag torpor_bench) is left out.
func runBenchResume(ctx context.Context, o benchResumeOptions, out io.Writer) error {
	return errors.New("bench: bench package not built yet")
}
