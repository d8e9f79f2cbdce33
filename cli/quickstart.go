package cli

import (
	"context"
	"io"

	"github.com/torpor/torpor/quickstart"
)

func runQuickstart(ctx context.Context, url string, out io.Writer) error {
	return quickstart.Run(ctx, quickstart.Options{URL: url, Out: out})
}
