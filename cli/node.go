package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
)

func (a *app) nodeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Nodes: the hosts whose servers share the metadata database",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	var asJSON bool
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List nodes: state (active, draining, lost), load and capacity, last heartbeat",
		Args:    usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			ns, err := a.client().ListNodes(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.ListNodesResponse{Nodes: nonNil(ns)})
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSTATE\tSANDBOXES\tMEMORY MiB\tOVERCOMMIT\tCPUS\tHEARTBEAT\tADVERTISE")
			for _, n := range ns {
				name := n.Name
				if n.Self {
					name += " *"
				}
				fmt.Fprintf(tw, "%s\t%s\t%d/%d\t%d/%d\t%gx\t%g/%g\t%s ago\t%s\n", name, n.State,
					n.Load.Sandboxes, n.Capacity.Sandboxes, n.Load.MemoryMiB, n.Capacity.MemoryMiB, n.MemoryOvercommit, n.Load.CPUs, n.Capacity.CPUs,
					humanAge(time.Since(n.HeartbeatAt)), n.Advertise)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, `print GET /v1/nodes's answer: {"nodes": [node…]}`)
	cmd.AddCommand(ls)
	for _, drain := range []bool{true, false} {
		use, short := "drain NAME", "Drain a node: it takes no new or resumed sandboxes and hibernates its own, which resume elsewhere on their next request"
		if !drain {
			use, short = "undrain NAME", "Undrain a node: it takes sandboxes again"
		}
		cmd.AddCommand(&cobra.Command{
			Use:   use,
			Short: short,
			Args:  usageArgs(cobra.ExactArgs(1)),
			RunE: func(cmd *cobra.Command, args []string) error {
				n, err := a.client().DrainNode(cmd.Context(), args[0], drain)
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "%s: %s\n", n.Name, n.State)
				return nil
			},
		})
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "rm NAME",
		Aliases: []string{"remove"},
		Short:   "Remove a lost node's record (one whose server stopped for good); refused while it is active or draining, owns sandboxes or holds volumes",
		Args:    usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.client().DeleteNode(cmd.Context(), args[0]); err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "%s: removed\n", args[0])
			return nil
		},
	})
	return cmd
}
