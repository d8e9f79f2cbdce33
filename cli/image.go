package cli

import (
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
)

func (a *app) imageCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "image",
		Aliases: []string{"images"},
		Short:   "Build, import and list images",
		Args:    usageArgs(cobra.NoArgs),
		RunE:    func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	cmd.AddCommand(a.imageBuildCommand(), a.imageImportCommand(), a.imageLsCommand(), a.imageWarmCommand(), a.imagePoolCommand())
	return cmd
}

func (a *app) imageBuildCommand() *cobra.Command {
	var (
		packages []string
		asJSON   bool
	)
	cmd := &cobra.Command{
		Use:   "build NAME --packages a,b,c",
		Short: "Build an image: a Debian root filesystem with the given packages",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sp := a.newSpinner("building " + args[0])
			progress := func(line string) {
				if sp != nil {
					sp.describe("building " + args[0] + ": " + truncate(strings.TrimSpace(line), 60))
					return
				}
				fmt.Fprintln(a.stderr, line)
			}
			img, err := a.client().BuildImage(cmd.Context(), apiv1.BuildImageRequest{Name: args[0], Packages: packages}, progress)
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, img)
			}
			_, err = fmt.Fprintf(a.stdout, "%s %s %s\n", img.Name, img.Digest, mib(img.Bytes))
			return err
		},
	}
	cmd.Flags().StringSliceVarP(&packages, "packages", "p", nil, "Debian packages to install (comma-separated, repeatable)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the image as JSON")
	return cmd
}

func (a *app) imageImportCommand() *cobra.Command {
	var asJSON, replace bool
	cmd := &cobra.Command{
		Use:   "import NAME FILE.tar [--replace]",
		Short: "Import an image from a tar archive of a root filesystem (- for stdin)",
		Args:  usageArgs(cobra.ExactArgs(2)),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, file := args[0], args[1]
			var (
				r    io.Reader = a.stdin
				size int64     = -1
			)
			if file != "-" {
				f, err := os.Open(file)
				if err != nil {
					return err
				}
				defer f.Close()
				st, err := f.Stat()
				if err != nil {
					return err
				}
				if !st.Mode().IsRegular() {
					return fmt.Errorf("%s is not a regular file", file)
				}
				r, size = f, st.Size()
			}
			if bar := a.newBytesBar(size, "uploading "+name); bar != nil {
				pr := progressbar.NewReader(r, bar)
				r = &pr
				defer bar.Finish()
			}
			imp := a.client().ImportImage
			if replace {
				imp = a.client().ReplaceImage
			}
			img, err := imp(cmd.Context(), name, r, size)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, img)
			}
			_, err = fmt.Fprintf(a.stdout, "%s %s %s\n", img.Name, img.Digest, mib(img.Bytes))
			return err
		},
	}
	cmd.Flags().BoolVar(&replace, "replace", false, "replace an existing image of that name")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the image as JSON")
	return cmd
}

func (a *app) imageLsCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List images",
		Args:    usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			imgs, err := a.client().ListImages(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.ListImagesResponse{Images: nonNil(imgs)})
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tDIGEST\tSIZE\tSOURCE\tAGE")
			now := time.Now()
			for _, img := range imgs {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", img.Name, shortDigest(img.Digest), mib(img.Bytes), img.Source, humanAge(now.Sub(img.CreatedAt)))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, `print GET /v1/images's answer: {"images": [image…]}`)
	return cmd
}

// shortDigest keeps "sha256:" and 12 hex digits.
func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 && strings.HasPrefix(d, "sha256:") {
		return d[:len("sha256:")+12]
	}
	return d
}
