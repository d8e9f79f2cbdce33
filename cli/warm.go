package cli

import (
	"github.com/spf13/cobra"

	"github.com/torpor/torpor/image"
)

// imageWarmCommand builds the default image into the host's build cache without a
// server; `make setup` runs it so the first sandbox and the tests start fast.
func (a *app) imageWarmCommand() *cobra.Command {
	var cache string
	cmd := &cobra.Command{
		Use:   "warm",
		Short: "Build the default image into the host's image build cache (no server needed)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cache == "" {
				cache = image.BuildCacheFromEnv()
			}
			return image.WarmBuildCache(cmd.Context(), cache, a.stderr)
		},
	}
	cmd.Flags().StringVar(&cache, "cache", "", "build cache directory (default $TORPOR_IMAGE_CACHE or "+image.DefaultBuildCache+")")
	return cmd
}
