//go:build !torpor_quickstart

package cli

import (
	"context"
	"errors"
	"io"
)

// Until package quickstart exists, quickstart.go (build tag torpor_quickstart) is left out.
func runQuickstart(ctx context.Context, url string, out io.Writer) error {
	return errors.New("quickstart: quickstart package not built yet")
}
