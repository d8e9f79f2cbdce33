package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
)

// addLifecycleFlags adds create's policy flags (docs/lifecycle.md) to cmd and returns the
// function that puts them into the request.
func addLifecycleFlags(cmd *cobra.Command) func(*apiv1.CreateSandboxRequest) error {
	var (
		idle      int
		pause     int
		timeout   int
		onTimeout string
		mode      string
		onResume  string
		volumes   []string
		expiresAt string
	)
	f := cmd.Flags()
	f.IntVar(&idle, "idle-timeout", -1, "hibernate after this many idle seconds; 0 = never (default: the server's, 15)")
	f.IntVar(&pause, "pause-after", -1, "pause (mode memory) after this many idle seconds, hibernate at --idle-timeout; 0 = never (default: 5 when the idle timeout is longer)")
	f.IntVar(&timeout, "timeout", 0, "longest running time in seconds (hibernated time does not count); 0 = none")
	f.StringVar(&onTimeout, "on-timeout", "", "what --timeout does: hibernate (default) or delete")
	f.StringVar(&mode, "mode", "", "hibernation mode: memory (default), filesystem or none")
	f.StringVar(&onResume, "on-resume", "", "shell command started after a filesystem-mode resume (run with sh -c)")
	f.StringArrayVar(&volumes, "volume", nil, "mount a named volume: NAME:/path (repeatable)")
	f.StringVar(&expiresAt, "expires-at", "", "retention: delete the sandbox and its snapshots once it is hibernated after this RFC 3339 time (default: never)")
	return func(req *apiv1.CreateSandboxRequest) error {
		if expiresAt != "" && expiresAt != "never" {
			t, err := parseExpiresAt(expiresAt)
			if err != nil {
				return err
			}
			req.ExpiresAt = &t
		}
		if idle >= 0 {
			req.IdleTimeoutS = &idle
		}
		if pause >= 0 {
			req.PauseAfterS = &pause
		}
		if timeout < 0 {
			return usagef("--timeout %d: must not be negative", timeout)
		}
		req.TimeoutS = timeout
		req.OnTimeout = onTimeout
		req.HibernationMode = mode
		if onResume != "" {
			req.OnResume = []string{"sh", "-c", onResume}
		}
		for _, v := range volumes {
			name, path, ok := strings.Cut(v, ":")
			if !ok || name == "" || path == "" {
				return usagef("--volume %q: want NAME:/path", v)
			}
			req.Volumes = append(req.Volumes, apiv1.VolumeMount{Name: name, Path: path})
		}
		return nil
	}
}

func (a *app) setCommand() *cobra.Command {
	var (
		req       apiv1.UpdateSandboxRequest
		idle      int
		pause     int
		timeout   int
		onTimeout string
		mode      string
		onResume  string
		expiresAt string
		asJSON    bool
	)
	cmd := &cobra.Command{
		Use:   "set ID [--idle-timeout S] [--pause-after S] [--timeout S] [--on-timeout hibernate|delete] [--mode memory|filesystem|none] [--on-resume CMD] [--expires-at RFC3339|never]",
		Short: "Change a sandbox's lifecycle policies",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			f := cmd.Flags()
			if f.Changed("idle-timeout") {
				req.IdleTimeoutS = &idle
			}
			if f.Changed("pause-after") {
				req.PauseAfterS = &pause
			}
			if f.Changed("timeout") {
				req.TimeoutS = &timeout
			}
			if f.Changed("on-timeout") {
				req.OnTimeout = &onTimeout
			}
			if f.Changed("mode") {
				req.HibernationMode = &mode
			}
			if f.Changed("on-resume") {
				cmdline := []string{}
				if onResume != "" {
					cmdline = []string{"sh", "-c", onResume}
				}
				req.OnResume = &cmdline
			}
			if f.Changed("expires-at") {
				if expiresAt == "never" || expiresAt == "" {
					req.ExpiresAt = apiv1.ExpireNever
				} else {
					t, err := parseExpiresAt(expiresAt)
					if err != nil {
						return err
					}
					req.ExpiresAt = apiv1.ExpireAt(t)
				}
			}
			sb, err := a.client().UpdateSandbox(cmd.Context(), args[0], req)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, sb)
			}
			_, err = fmt.Fprintf(a.stdout, "%s: idle_timeout_s %d, pause_after_s %d, timeout_s %d, on_timeout %s, mode %s, expires_at %s\n",
				sb.ID, sb.IdleTimeoutS, sb.PauseAfterS, sb.TimeoutS, sb.OnTimeout, sb.Hibernation.Mode, expiresText(sb.ExpiresAt))
			return err
		},
	}
	f := cmd.Flags()
	f.IntVar(&idle, "idle-timeout", 0, "hibernate after this many idle seconds; 0 = never")
	f.IntVar(&pause, "pause-after", 0, "pause (mode memory) after this many idle seconds; 0 = never")
	f.IntVar(&timeout, "timeout", 0, "longest running time in seconds from now; 0 = none")
	f.StringVar(&onTimeout, "on-timeout", "", "hibernate or delete")
	f.StringVar(&mode, "mode", "", "memory, filesystem or none")
	f.StringVar(&onResume, "on-resume", "", "shell command started after a filesystem-mode resume (\"\" = none)")
	f.StringVar(&expiresAt, "expires-at", "", "retention: an RFC 3339 time after which the hibernated sandbox and its snapshots are deleted, or never")
	f.BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	return cmd
}

// parseExpiresAt reads an --expires-at value (RFC 3339).
func parseExpiresAt(v string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return t, usagef("--expires-at %q: want an RFC 3339 time (2030-01-02T15:04:05Z) or never", v)
	}
	return t, nil
}

// expiresText shows an expires_at: the time, or "never".
func expiresText(t *time.Time) string {
	if t == nil {
		return "never"
	}
	return t.UTC().Format(time.RFC3339)
}

func (a *app) volumeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "volume",
		Short: "Named volumes: host directories mounted into sandboxes, kept across deletes",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "create NAME",
		Short: "Create an empty volume",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			v, err := a.client().CreateVolume(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(a.stdout, v.Name)
			return err
		},
	})
	var asJSON bool
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List volumes, the node holding each and the sandboxes that mount them",
		Args:    usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			vs, err := a.client().ListVolumes(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.ListVolumesResponse{Volumes: nonNil(vs)})
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tNODE\tUSED BY\tCOPIED FROM")
			for _, v := range vs {
				used, from, node := "-", "-", "-"
				if len(v.UsedBy) > 0 {
					used = strings.Join(v.UsedBy, ",")
				}
				if v.CopiedFrom != "" {
					from = v.CopiedFrom
				}
				if v.Node != "" {
					node = v.Node
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", v.Name, node, used, from)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, `print GET /v1/volumes's answer: {"volumes": [volume…]}`)
	cmd.AddCommand(ls)
	cmd.AddCommand(&cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"delete"},
		Short:   "Delete volumes and their data (refused while a sandbox mounts one)",
		Args:    usageArgs(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			failed := 0
			for _, n := range distinct(args) {
				if err := a.client().DeleteVolume(cmd.Context(), n); err != nil {
					failed++
					a.reportFor(n, err)
					continue
				}
				fmt.Fprintln(a.stdout, n)
			}
			if failed > 0 {
				return silentError{}
			}
			return nil
		},
	})
	return cmd
}

func (a *app) usageCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "usage [ID]",
		Short: "Show metered usage: running seconds and snapshot storage (byte-seconds)",
		Args:  usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			var sbs []apiv1.Sandbox
			if len(args) == 1 {
				sb, err := a.client().GetSandbox(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				if asJSON {
					return printJSON(a.stdout, sb)
				}
				sbs = []apiv1.Sandbox{sb}
			} else {
				var err error
				if sbs, err = a.client().ListSandboxes(cmd.Context()); err != nil {
					return err
				}
				if asJSON {
					return printJSON(a.stdout, apiv1.ListSandboxesResponse{Sandboxes: nonNil(sbs)})
				}
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSTATE\tRUNNING_S\tSNAPSHOT_BYTE_S\tSNAPSHOT_GIB_H")
			var run, bs float64
			for _, sb := range sbs {
				fmt.Fprintf(tw, "%s\t%s\t%.1f\t%.0f\t%.4f\n", sb.ID, sb.State, sb.Usage.RunningS, sb.Usage.SnapshotByteS,
					sb.Usage.SnapshotByteS/(1<<30)/3600)
				run += sb.Usage.RunningS
				bs += sb.Usage.SnapshotByteS
			}
			if len(sbs) > 1 {
				fmt.Fprintf(tw, "total\t\t%.1f\t%.0f\t%.4f\n", run, bs, bs/(1<<30)/3600)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, `print the API's answer, whose "usage" fields are the metering: with ID the sandbox, else {"sandboxes": [sandbox…]}`)
	return cmd
}

func (a *app) metricsCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "metrics ID",
		Short: "Show what a running or paused sandbox uses now: CPU seconds since its instance started, memory held (it wakes nothing)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := a.client().SandboxMetrics(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, m)
			}
			_, err = fmt.Fprintf(a.stdout, "%s %s: cpu %.3f s, memory %.1f MiB of %.0f MiB\n", args[0], m.State, m.CPUTimeS,
				float64(m.MemoryBytes)/(1<<20), float64(m.MemoryLimitBytes)/(1<<20))
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the API's answer")
	return cmd
}
