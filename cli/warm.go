package cli

import (
	"strings"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/image"
)

// imageWarmCommand builds the built-in images into the host's build cache without
// a server; `make setup` runs it so the first sandbox and the tests start fast.
func (a *app) imageWarmCommand() *cobra.Command {
	var cache string
	cmd := &cobra.Command{
		Use:       "warm [NAME...]",
		Short:     "Build the built-in images (" + strings.Join(image.Builtins(), ", ") + "; default: all) into the host's image build cache (no server needed)",
		Args:      usageArgs(cobra.OnlyValidArgs),
		ValidArgs: image.Builtins(),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cache == "" {
				cache = image.BuildCacheFromEnv()
			}
			var names []string // nil: every built-in image
			if len(args) > 0 {
				names = args
			}
			return image.WarmBuildCache(cmd.Context(), cache, names, a.stderr)
		},
	}
	cmd.Flags().StringVar(&cache, "cache", "", "build cache directory (default $TORPOR_IMAGE_CACHE or "+image.DefaultBuildCache+")")
	return cmd
}
