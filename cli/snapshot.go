package cli

import (
	"context"
	"fmt"
	"sort"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/snapshot"
)

// snapshotCommand: snapshots through the server's API (GET/DELETE
// /v1/snapshots…) by default; with --data-dir (or any store flag) the offline
// tools that open a data directory's store directly, read-only, next to a running
// server or without one.
func (a *app) snapshotCommand() *cobra.Command {
	var (
		dataDir string
		sc      server.StoreConfig
		asJSON  bool
	)
	// offline says the store flags ask for the data-directory mode.
	offline := func(cmd *cobra.Command) bool {
		for _, name := range append([]string{"data-dir"}, storeFlagNames...) {
			if cmd.Flags().Changed(name) {
				return true
			}
		}
		return false
	}
	open := func(ctx context.Context) (snapshot.Store, func() error, error) {
		fillS3Credentials(&sc)
		return server.OpenStore(ctx, dataDir, sc)
	}
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "List, inspect, verify and delete snapshots (through the server; --data-dir reads a data directory's store directly)",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&dataDir, "data-dir", envOr("TORPOR_DATA_DIR", "/var/lib/torpor"), "read this data directory's store directly instead of asking the server (offline mode; ls, inspect, verify, usage)")
	addStoreFlags(pf, &sc, "snapshot store: chunked, s3 or plain (default: the kind the data directory was set up with)")
	pf.BoolVar(&asJSON, "json", false, "print JSON in the API's shapes (offline ls and inspect: the store's manifests, which have no API shape)")

	ls := &cobra.Command{
		Use:   "ls",
		Short: "List committed snapshots with logical, stored and new bytes",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !offline(cmd) {
				return a.snapshotLs(cmd, asJSON)
			}
			st, closeFn, err := open(cmd.Context())
			if err != nil {
				return err
			}
			defer closeFn()
			ids, err := st.List(cmd.Context())
			if err != nil {
				return err
			}
			ms := []snapshot.Manifest{}
			for _, id := range ids {
				m, err := st.Manifest(cmd.Context(), id)
				if err != nil {
					return err
				}
				ms = append(ms, m)
			}
			sort.Slice(ms, func(i, j int) bool { return ms[i].CreatedAt.Before(ms[j].CreatedAt) })
			if asJSON {
				return printJSON(a.stdout, ms) // the manifests
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSANDBOX\tLOGICAL\tSTORED\tNEW\tDEDUP\tPARENT\tCREATED")
			for _, m := range ms {
				if m.StoredBytes == 0 && m.Chunks == 0 {
					// A plain-store manifest from before it recorded sizes:
					// every byte stored, once.
					m.StoredBytes, m.NewBytes = m.Bytes, m.Bytes
				}
				dedup := "-"
				if m.StoredBytes > 0 {
					dedup = fmt.Sprintf("%.2fx", float64(m.Bytes)/float64(m.StoredBytes))
				}
				parent := m.Parent
				if parent == "" {
					parent = "-"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.ID, m.SandboxID, mib(m.Bytes), mib(m.StoredBytes),
					mib(m.NewBytes), dedup, parent, m.CreatedAt.Format("2006-01-02 15:04:05"))
			}
			return tw.Flush()
		},
	}
	inspect := &cobra.Command{
		Use:   "inspect ID",
		Short: "Print a snapshot as JSON (offline: its manifest)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !offline(cmd) {
				snap, err := a.client().GetSnapshot(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				return printJSON(a.stdout, snap)
			}
			st, closeFn, err := open(cmd.Context())
			if err != nil {
				return err
			}
			defer closeFn()
			m, err := st.Manifest(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return printJSON(a.stdout, m)
		},
	}
	verify := &cobra.Command{
		Use:   "verify ID",
		Short: "Read every chunk of a snapshot from the durable store and check its sha256",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !offline(cmd) {
				r, err := a.client().VerifySnapshot(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				if asJSON {
					return printJSON(a.stdout, r)
				}
				_, err = fmt.Fprintf(a.stdout, "%s ok: %d files, %s verified\n", args[0], r.Files, mib(r.Bytes))
				return err
			}
			st, closeFn, err := open(cmd.Context())
			if err != nil {
				return err
			}
			defer closeFn()
			var m snapshot.Manifest
			if v, ok := st.(snapshot.Verifier); ok {
				m, err = v.Verify(cmd.Context(), args[0])
			} else {
				_, m, err = st.Open(cmd.Context(), args[0])
			}
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(a.stdout, apiv1.VerifySnapshotResponse{OK: true, Files: len(m.Files), Bytes: m.Bytes})
			}
			_, err = fmt.Fprintf(a.stdout, "%s ok: %d files, %s verified\n", m.ID, len(m.Files), mib(m.Bytes))
			return err
		},
	}
	rm := &cobra.Command{
		Use:   "rm ID",
		Short: "Delete a snapshot (refused while a sandbox resumes from it; through the server only)",
		Args:  usageArgs(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if offline(cmd) {
				return usagef("snapshot rm works through the server only (the server's database records the snapshot); drop --data-dir and the store flags")
			}
			if err := a.client().DeleteSnapshot(cmd.Context(), args[0]); err != nil {
				return err
			}
			_, err := fmt.Fprintf(a.stdout, "deleted %s\n", args[0])
			return err
		},
	}
	usage := &cobra.Command{
		Use:   "usage",
		Short: "Show the store's footprint: snapshots, logical and stored bytes, dedup ratio, chunks, packs, pending upload, local disk",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			var u apiv1.StoreUsage
			if !offline(cmd) {
				var err error
				if u, err = a.client().StoreUsage(cmd.Context()); err != nil {
					return err
				}
			} else {
				kind, kerr := server.ResolveStoreKind(dataDir, sc) // before open adds directories
				st, closeFn, err := open(cmd.Context())
				if err != nil {
					return err
				}
				defer closeFn()
				if kerr != nil {
					return kerr
				}
				if u, err = offlineUsage(cmd.Context(), st); err != nil {
					return err
				}
				u.Kind = kind
			}
			if asJSON {
				return printJSON(a.stdout, u)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			dedup := "-"
			if u.DedupRatio > 0 {
				dedup = fmt.Sprintf("%.2fx", u.DedupRatio)
			}
			for _, row := range [][2]string{
				{"store", u.Kind}, {"snapshots", fmt.Sprint(u.Snapshots)}, {"logical", mib(u.LogicalBytes)},
				{"stored", mib(u.StoredBytes)}, {"dedup", dedup}, {"chunks", fmt.Sprintf("%d (%s)", u.Chunks, mib(u.ChunkBytes))},
				{"packs", fmt.Sprint(u.Packs)}, {"pending upload", mib(u.PendingUploadBytes)}, {"local", mib(u.LocalBytes)},
			} {
				fmt.Fprintf(tw, "%s\t%s\n", row[0], row[1])
			}
			return tw.Flush()
		},
	}
	cmd.AddCommand(ls, inspect, verify, rm, usage, a.snapshotTemplateCommand(offline))
	return cmd
}

// offlineUsage is GET /v1/store computed from a store opened directly: the
// snapshots and logical bytes from its manifests, the rest from the store.
func offlineUsage(ctx context.Context, st snapshot.Store) (apiv1.StoreUsage, error) {
	ids, err := st.List(ctx)
	if err != nil {
		return apiv1.StoreUsage{}, err
	}
	var logical int64
	for _, id := range ids {
		m, err := st.Manifest(ctx, id)
		if err != nil {
			return apiv1.StoreUsage{}, err
		}
		if m.LogicalBytes > 0 {
			logical += m.LogicalBytes
		} else {
			logical += m.Bytes
		}
	}
	u, err := manager.UsageOf(ctx, st, len(ids), logical)
	return server.WireStoreUsage(u), err
}

// snapshotLs lists the server's snapshots.
func (a *app) snapshotLs(cmd *cobra.Command, asJSON bool) error {
	snaps, err := a.client().ListSnapshots(cmd.Context())
	if err != nil {
		return err
	}
	if asJSON {
		return printJSON(a.stdout, apiv1.ListSnapshotsResponse{Snapshots: snaps})
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSANDBOX\tLOGICAL\tSTORED\tNEW\tDEDUP\tPARENT\tDURABLE\tEXPIRES\tCREATED")
	for _, s := range snaps {
		dedup := "-"
		if s.DedupRatio > 0 {
			dedup = fmt.Sprintf("%.2fx", s.DedupRatio)
		}
		parent := "-"
		if s.Parent != nil {
			parent = *s.Parent
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%v\t%s\t%s\n", s.ID, s.SandboxID, mib(s.LogicalBytes), mib(s.StoredBytes),
			mib(s.NewBytes), dedup, parent, s.Durable, expiresText(s.ExpiresAt), s.CreatedAt.Local().Format("2006-01-02 15:04:05"))
	}
	return tw.Flush()
}
