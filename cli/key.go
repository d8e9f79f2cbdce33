package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/server"
)

// keyJSON is a key as `torpor key … --json` prints it. Key is set only in
// create's answer: nothing keeps it.
type keyJSON struct {
	ID         string     `json:"id"`
	Name       string     `json:"name"`
	Prefix     string     `json:"prefix"`
	Key        string     `json:"key,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	LastUsedAt *time.Time `json:"last_used_at"`
}

func wireKey(k metadata.APIKey) keyJSON {
	return keyJSON{ID: k.ID, Name: k.Name, Prefix: k.Prefix, CreatedAt: k.CreatedAt, LastUsedAt: k.LastUsedAt}
}

// keyCommand: API keys. They are made, listed and removed in the server's
// database directly (the data directory's SQLite file, or --database's
// PostgreSQL), not through the API: the first key must be
// makeable before any key exists, on the server's host, by whoever may read
// its data directory. SQLite (WAL, a busy timeout) lets this run beside a
// running server; the server sees a new key at once and refuses a removed
// one from its next request (apikey reads the key on every check).
func (a *app) keyCommand() *cobra.Command {
	var (
		dataDir, database string
		asJSON            bool
	)
	// open opens the metadata database: --database's PostgreSQL, else the
	// data directory's SQLite file; create makes the data directory if it is
	// missing (a first key before the first `torpor serve`).
	open := func(ctx context.Context, create bool) (metadata.Store, error) {
		if err := server.CheckDatabase(database); err != nil {
			return nil, usageError{err}
		}
		if database != "" {
			return server.OpenDatabase(ctx, "", database)
		}
		path := filepath.Join(dataDir, "torpor.db")
		if create {
			if err := os.MkdirAll(dataDir, 0o755); err != nil {
				return nil, fmt.Errorf("data dir %s: %w", dataDir, err)
			}
		} else if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("no torpor database at %s: is --data-dir (or TORPOR_DATA_DIR) the server's?", path)
		}
		return sqlite.Open(path)
	}
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Make, list and remove API keys (in the data directory's database, on the server's host)",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  func(cmd *cobra.Command, args []string) error { return cmd.Help() },
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&dataDir, "data-dir", envOr("TORPOR_DATA_DIR", "/var/lib/torpor"), "the server's data directory, whose database holds the keys")
	pf.StringVar(&database, "database", os.Getenv("TORPOR_DATABASE"), "the server's PostgreSQL database (postgres://…, as torpor serve --database; default $TORPOR_DATABASE), which holds the keys instead of the data directory")

	var name string
	create := &cobra.Command{
		Use:   "create [--name NAME]",
		Short: "Make a key and print it (shown this once; only its hash is kept)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !apikey.ValidName(name) {
				return usagef("--name %q: at most %d printable characters", name, apikey.MaxNameLen)
			}
			db, err := open(cmd.Context(), true)
			if err != nil {
				return err
			}
			defer db.Close()
			key, rec, err := apikey.Create(cmd.Context(), db, name, time.Now())
			if err != nil {
				return err
			}
			if asJSON {
				k := wireKey(rec)
				k.Key = key
				return printJSON(a.stdout, k)
			}
			fmt.Fprintln(a.stdout, key)
			named := ""
			if name != "" {
				named = fmt.Sprintf(" %q", name)
			}
			fmt.Fprintf(a.stderr, "made key %s%s (%s…). It is shown only this once: keep it now (clients read TORPOR_API_KEY).\n", rec.ID, named, rec.Prefix)
			return nil
		},
	}
	create.Flags().StringVar(&name, "name", "", "a name to tell the key by (e.g. who or what uses it)")
	create.Flags().BoolVar(&asJSON, "json", false, "print the key and its record as JSON")
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List keys: id, name, prefix, created, last used (never the keys)",
		Args:    usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			db, err := open(cmd.Context(), false)
			if err != nil {
				return err
			}
			defer db.Close()
			keys, err := db.ListAPIKeys(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				out := []keyJSON{}
				for _, k := range keys {
					out = append(out, wireKey(k))
				}
				return printJSON(a.stdout, map[string][]keyJSON{"keys": out})
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tNAME\tPREFIX\tCREATED\tLAST USED")
			for _, k := range keys {
				name, used := k.Name, "never"
				if name == "" {
					name = "-"
				}
				if k.LastUsedAt != nil {
					used = humanAge(time.Since(*k.LastUsedAt)) + " ago"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s…\t%s\t%s\n", k.ID, name, k.Prefix, k.CreatedAt.Local().Format("2006-01-02 15:04:05"), used)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, `print {"keys": […]}`)
	rm := &cobra.Command{
		Use:     "rm ID…",
		Aliases: []string{"delete"},
		Short:   "Remove keys (running servers refuse them from the next request)",
		Args:    usageArgs(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			db, err := open(cmd.Context(), false)
			if err != nil {
				return err
			}
			defer db.Close()
			// Every id is tried: a typo in one must not leave the keys after it
			// valid.
			failed := 0
			for _, id := range distinct(args) {
				if err := db.DeleteAPIKey(cmd.Context(), id); err != nil {
					failed++
					if errors.Is(err, metadata.ErrNotFound) {
						err = fmt.Errorf("no key %s (torpor key ls lists them)", id)
					}
					a.reportFor(id, err)
					continue
				}
				fmt.Fprintf(a.stdout, "removed %s\n", id)
			}
			if failed > 0 {
				return silentError{}
			}
			return nil
		},
	}
	cmd.AddCommand(create, ls, rm)
	return cmd
}
