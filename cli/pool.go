package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
)

// imagePoolCommand: torpor image pool [NAME] [--size N] (PUT
// /v1/images/{name}/pool; without --size it shows the pool, without NAME
// every pool).
func (a *app) imagePoolCommand() *cobra.Command {
	var (
		size   int
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "pool [NAME] [--size N]",
		Short: "Set or show an image's warm pool: N restored-and-paused clones kept ready for creates of the image with its default spec (0 ends it); without NAME, list every pool",
		Args:  usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 && cmd.Flags().Changed("size") {
				p, err := a.client().SetImagePool(cmd.Context(), args[0], size)
				if err != nil {
					return err
				}
				return a.printPools(asJSON, []apiv1.Pool{p}, false)
			}
			if cmd.Flags().Changed("size") {
				return usagef("--size needs an image NAME")
			}
			return a.showPools(cmd, "image", args, asJSON)
		},
	}
	cmd.Flags().IntVar(&size, "size", 0, "clones to keep ready (0 to 16; 0 ends the pool)")
	cmd.Flags().BoolVar(&asJSON, "json", false, `print the API's answer: the pool, or GET /v1/pools's {"pools": [pool…]}`)
	return cmd
}

// snapshotTemplateCommand: torpor snapshot template ID --pool N (PUT
// /v1/snapshots/{id}/pool).
func (a *app) snapshotTemplateCommand(offline func(*cobra.Command) bool) *cobra.Command {
	var size int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "template ID [--pool N]",
		Short: "Mark a snapshot a template with a warm pool of N restored-and-paused clones for forks of a sandbox hibernated on it (0 unmarks it); without --pool, show its pool",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if offline(cmd) {
				return usagef("snapshot template works through the server only; drop --data-dir and the store flags")
			}
			if !cmd.Flags().Changed("pool") {
				return a.showPools(cmd, "snapshot", args, asJSON)
			}
			p, err := a.client().SetSnapshotPool(cmd.Context(), args[0], size)
			if err != nil {
				return err
			}
			return a.printPools(asJSON, []apiv1.Pool{p}, false)
		},
	}
	cmd.Flags().IntVar(&size, "pool", 0, "clones to keep ready (0 to 16; 0: no longer a template)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the API's answer: the pool")
	return cmd
}

// showPools prints the pools of template kind named by args (all of that
// kind's with no args; every pool of any kind for images' listing).
func (a *app) showPools(cmd *cobra.Command, kind string, args []string, asJSON bool) error {
	all, err := a.client().ListPools(cmd.Context())
	if err != nil {
		return err
	}
	if len(args) == 0 {
		return a.printPools(asJSON, all, true)
	}
	for _, p := range all {
		if p.Template == kind && p.Name == args[0] {
			return a.printPools(asJSON, []apiv1.Pool{p}, false)
		}
	}
	if asJSON {
		return printJSON(a.stdout, apiv1.Pool{Template: kind, Name: args[0]})
	}
	_, err = fmt.Fprintf(a.stdout, "%s %s has no warm pool (size 0)\n", kind, args[0])
	return err
}

func (a *app) printPools(asJSON bool, pools []apiv1.Pool, list bool) error {
	if asJSON {
		if list {
			return printJSON(a.stdout, apiv1.ListPoolsResponse{Pools: nonNil(pools)})
		}
		return printJSON(a.stdout, pools[0])
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TEMPLATE\tNAME\tSIZE\tREADY\tSNAPSHOT\tUPDATED\tERROR")
	now := time.Now()
	for _, p := range pools {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\n", p.Template, p.Name, p.Size, p.Ready, dashIfEmpty(p.SnapshotID),
			humanAge(now.Sub(p.UpdatedAt)), p.Error)
	}
	return tw.Flush()
}

func dashIfEmpty(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
