package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
)

func (a *app) createCommand() *cobra.Command {
	var (
		req     apiv1.CreateSandboxRequest
		envs    []string
		asJSON  bool
		created apiv1.Sandbox
		applyLC func(*apiv1.CreateSandboxRequest) error
	)
	cmd := &cobra.Command{
		Use:   "create [--image base] [--memory 512] [--cpus 1] [--env K=V ...]",
		Short: "Create and start a sandbox; prints its id",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			// 0 would be sent as "not given" and get the server's default: a
			// limit asked for must be one.
			if req.MemoryMiB <= 0 {
				return usagef("--memory %d: want a memory limit of at least 1 MiB", req.MemoryMiB)
			}
			if req.CPUs <= 0 {
				return usagef("--cpus %g: want a CPU limit above 0 cores", req.CPUs)
			}
			env, err := parseEnv(envs)
			if err != nil {
				return err
			}
			req.Env = env
			if err := applyLC(&req); err != nil {
				return err
			}
			sp := a.newSpinner("creating sandbox")
			created, err = a.client().CreateSandbox(cmd.Context(), req)
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, created)
			}
			_, err = fmt.Fprintln(a.stdout, created.ID)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Image, "image", "base", "image name or digest")
	f.IntVar(&req.MemoryMiB, "memory", 512, "memory limit in MiB")
	f.IntVar(&req.PidsLimit, "pids-limit", 0, "processes and threads each user may have in the sandbox (0: the default, one per 2 MiB of --memory up to the server's cap)")
	f.Float64Var(&req.CPUs, "cpus", 1, "CPU limit in cores")
	f.StringArrayVarP(&envs, "env", "e", nil, "environment variable KEY=VALUE for every process (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	applyLC = addLifecycleFlags(cmd)
	return cmd
}

func (a *app) lsCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list", "ps"},
		Short:   "List sandboxes",
		Args:    usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			sbs, err := a.client().ListSandboxes(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.ListSandboxesResponse{Sandboxes: nonNil(sbs)})
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSTATE\tIMAGE\tMEM\tGEN\tSNAPSHOT\tAGE")
			now := time.Now()
			for _, sb := range sbs {
				snap := "-"
				if sb.Snapshot != nil {
					snap = fmt.Sprintf("%s (%s)", sb.Snapshot.ID, size(sb.Snapshot.Bytes))
				}
				state := string(sb.State)
				if sb.State == apiv1.StateError && sb.Error != "" {
					state += ": " + truncate(sb.Error, 40)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%dMiB\t%d\t%s\t%s\n",
					sb.ID, state, shortDigest(sb.Image), sb.MemoryMiB, sb.Generation, snap, humanAge(now.Sub(sb.CreatedAt)))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, `print GET /v1/sandboxes's answer: {"sandboxes": [sandbox…]}`)
	return cmd
}

func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

func (a *app) inspectCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Print a sandbox as JSON",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sb, err := a.client().GetSandbox(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return printJSON(a.stdout, sb)
		},
	}
}

func (a *app) hibernateCommand() *cobra.Command {
	var asJSON, async bool
	cmd := &cobra.Command{
		Use:   "hibernate ID",
		Short: "Hibernate a running sandbox to a snapshot and release its compute",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sp := a.newSpinner("hibernating " + args[0])
			var req apiv1.HibernateRequest
			if cmd.Flags().Changed("async-upload") {
				req.AsyncUpload = &async
			}
			res, err := a.client().HibernateCall(cmd.Context(), args[0], req)
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, res)
			}
			sb := res.Sandbox
			if res.Unchanged {
				// Answered as it is: its last hibernate is not this call's.
				snap := "none"
				if sb.Snapshot != nil {
					snap = sb.Snapshot.ID
				}
				_, err = fmt.Fprintf(a.stdout, "%s was already hibernated (snapshot %s)\n", sb.ID, snap)
				return err
			}
			if sb.Snapshot == nil {
				_, err = fmt.Fprintf(a.stdout, "hibernated %s\n", sb.ID)
				return err
			}
			durable := ""
			if !sb.Snapshot.Durable {
				durable = " (not durable yet: uploading in the background)"
			}
			_, err = fmt.Fprintf(a.stdout, "hibernated %s: snapshot %s, %s, %d ms%s\n",
				sb.ID, sb.Snapshot.ID, size(sb.Snapshot.Bytes), sb.Snapshot.HibernateMS, durable)
			if err == nil && sb.ExpiresAt != nil && !sb.ExpiresAt.After(time.Now()) {
				fmt.Fprintf(a.stderr, "torpor: warning: %s expired at %s; retention deletes it and its snapshot within seconds (torpor set %s --expires-at never keeps it)\n",
					sb.ID, sb.ExpiresAt.UTC().Format(time.RFC3339), sb.ID)
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	cmd.Flags().BoolVar(&async, "async-upload", false, "answer once the snapshot is on local disk and upload it to the durable tier in the background (default: the server's --async-upload)")
	return cmd
}

func (a *app) resumeCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "resume ID",
		Short: "Resume a hibernated sandbox from its snapshot (a paused one is unpaused)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sp := a.newSpinner("resuming " + args[0])
			res, err := a.client().ResumeCall(cmd.Context(), args[0])
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, res)
			}
			sb := res.Sandbox
			if res.Unchanged {
				// Answered as it is: its last resume is not this call's.
				_, err = fmt.Fprintf(a.stdout, "%s was already running (generation %d)\n", sb.ID, sb.Generation)
				return err
			}
			return a.printResumed(sb)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	return cmd
}

// printResumed says how sb came back: unpaused (the same generation) or
// resumed from its snapshot.
func (a *app) printResumed(sb apiv1.Sandbox) error {
	if r := sb.LastResume; r != nil && r.Event == "unpaused" {
		_, err := fmt.Fprintf(a.stdout, "unpaused %s (generation %d; resume contract %.1f ms)\n", sb.ID, sb.Generation, r.AgentMS)
		return err
	}
	_, err := fmt.Fprintf(a.stdout, "resumed %s in %d ms (generation %d)\n", sb.ID, sb.ResumeMS, sb.Generation)
	return err
}

func (a *app) pauseCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "pause ID",
		Short: "Pause a running sandbox: its processes stop and its memory stays on the host (the next request unpauses it in milliseconds)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sp := a.newSpinner("pausing " + args[0])
			res, err := a.client().Pause(cmd.Context(), args[0])
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, res)
			}
			if res.Unchanged {
				_, err = fmt.Fprintf(a.stdout, "%s was already paused\n", res.ID)
				return err
			}
			snap := "none"
			if res.Snapshot != nil {
				snap = res.Snapshot.ID
			}
			_, err = fmt.Fprintf(a.stdout, "paused %s (snapshot of the paused state: %s)\n", res.ID, snap)
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	return cmd
}

func (a *app) unpauseCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "unpause ID",
		Short: "Let a paused sandbox's processes continue (the same as resume; any request does it too)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.client().ResumeCall(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, res)
			}
			if res.Unchanged {
				_, err = fmt.Fprintf(a.stdout, "%s was already running (generation %d)\n", res.ID, res.Generation)
				return err
			}
			return a.printResumed(res.Sandbox)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the sandbox as JSON")
	return cmd
}

func (a *app) forkCommand() *cobra.Command {
	var (
		count   int
		volumes string
		wait    string
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   "fork ID [--count N] [--volumes copy] [--wait all|first]",
		Short: "Start new sandboxes from a sandbox's snapshot; prints their ids",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 {
				return usagef("--count %d: want at least 1", count)
			}
			if volumes != "" && volumes != "copy" {
				return usagef("--volumes %q: want copy (the only option of the fork call's \"volumes\")", volumes)
			}
			if wait != apiv1.ForkWaitAll && wait != apiv1.ForkWaitFirst {
				return usagef("--wait %q: want all or first", wait)
			}
			sp := a.newSpinner("forking " + args[0])
			sbs, err := a.client().ForkWith(cmd.Context(), args[0], apiv1.ForkRequest{Count: count, Volumes: volumes, Wait: wait})
			sp.done()
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.ForkResponse{Sandboxes: nonNil(sbs)})
			}
			for _, sb := range sbs {
				if _, err := fmt.Fprintln(a.stdout, sb.ID); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.Flags().IntVarP(&count, "count", "n", 1, "number of clones")
	cmd.Flags().StringVar(&volumes, "volumes", "", "what clones of a sandbox with volumes get: copy (each clone a copy of every volume, named <volume>-<clone id suffix>); without it such a fork is refused, as clones never share a read-write volume")
	cmd.Flags().StringVar(&wait, "wait", apiv1.ForkWaitAll, "all: answer once every clone has started; first: once the first clone runs, the others still starting (state creating; a call to one waits for it)")
	cmd.Flags().BoolVar(&asJSON, "json", false, `print the fork call's answer: {"sandboxes": [sandbox…]}`)
	return cmd
}

func (a *app) rmCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Destroy sandboxes and their snapshots",
		Args:    usageArgs(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			failed := 0
			for _, id := range distinct(args) {
				if err := a.client().DeleteSandbox(cmd.Context(), id); err != nil {
					failed++
					a.reportFor(id, err)
					if err := cmd.Context().Err(); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintln(a.stdout, id)
			}
			if failed > 0 {
				return silentError{}
			}
			return nil
		},
	}
}
