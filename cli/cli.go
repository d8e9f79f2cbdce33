package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
)

// Execute runs torpor with the process's arguments and standard streams and returns
// the exit code for os.Exit.
func Execute() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return Run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
}

// Run runs torpor with args (without the program name) and the given streams, and
// returns the exit code.
func Run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	return a.exitCode(cmd, err)
}

// app holds what every command shares.
type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	url            string // --url
	caCert         string // --ca-cert
}

// client is the Go client of the server at --url, trusting --ca-cert's
// certificates when given (else $TORPOR_CA_CERT's, client.New).
func (a *app) client() *client.Client {
	c := client.New(a.url)
	if a.caCert != "" {
		_ = c.TrustCA(a.caCert) // a bad file fails every call with its error
	}
	return c
}

// serverURL is the URL the client commands use.
func (a *app) serverURL() string { return a.client().BaseURL }

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "torpor",
		Short: "torpor runs AI-agent sandboxes under gVisor and hibernates and resumes them",
		Long: `torpor runs sandboxes for AI agents, hibernates idle ones to snapshots and
resumes them with their processes continuing where they stopped.

Client commands talk to the server at --url, else $TORPOR_URL, else ` + client.DefaultURL + `,
with the API key $TORPOR_API_KEY when it is set (torpor key create makes keys); an https
server's certificate must be signed by a system authority or one in --ca-cert
($TORPOR_CA_CERT).`,
		SilenceErrors: true,
		SilenceUsage:  true,
		Args:          usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			return cmd.Help()
		},
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.PersistentFlags().StringVar(&a.url, "url", "", "torpor server URL (default $TORPOR_URL or "+client.DefaultURL+")")
	root.PersistentFlags().StringVar(&a.caCert, "ca-cert", "", "PEM file of certificates to trust, besides the system's, for an https --url (default $TORPOR_CA_CERT)")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(
		a.serveCommand(),
		a.serveWatchdogCommand(),
		a.quickstartCommand(),
		a.benchCommand(),
		a.createCommand(),
		a.lsCommand(),
		a.inspectCommand(),
		a.execCommand(),
		a.cpCommand(),
		a.hibernateCommand(),
		a.resumeCommand(),
		a.pauseCommand(),
		a.unpauseCommand(),
		a.forkCommand(),
		a.rmCommand(),
		a.imageCommand(),
		a.volumeCommand(),
		a.usageCommand(),
		a.metricsCommand(),
		a.setCommand(),
		a.snapshotCommand(),
		a.keyCommand(),
		a.nodeCommand(),
	)
	return root
}

// usageError is a wrong command line: exit code 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// usageArgs makes an argument validator's errors usage errors, and refuses an
// empty argument (every command it guards takes ids, names and paths: `torpor
// rm ""` used to reach the API as DELETE /v1/sandboxes/ and answer "no route").
func usageArgs(v cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := v(cmd, args); err != nil {
			return usageError{err}
		}
		for i, a := range args {
			if strings.TrimSpace(a) == "" {
				return usagef("argument %d is empty; usage: %s", i+1, cmd.UseLine())
			}
		}
		return nil
	}
}

// exitStatus makes torpor exit with code without printing anything (exec passes the
// sandboxed process's exit code through).
type exitStatus int

func (e exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// silentError has already been reported; it only sets exit code 1.
type silentError struct{}

func (silentError) Error() string { return "failed" }

// exitCode reports err (from running cmd) and returns the exit code for it.
func (a *app) exitCode(cmd *cobra.Command, err error) int {
	if err == nil {
		return 0
	}
	var es exitStatus
	if errors.As(err, &es) {
		return int(es)
	}
	if errors.As(err, &silentError{}) {
		return 1
	}
	var re *reportedExit
	if errors.As(err, &re) {
		fmt.Fprintf(a.stderr, "torpor: %s\n", a.message(re.err))
		return re.code
	}
	var ue usageError
	msg := err.Error()
	if errors.As(err, &ue) || strings.HasPrefix(msg, "unknown command") || strings.HasPrefix(msg, "unknown flag") ||
		strings.HasPrefix(msg, "required flag") || strings.HasPrefix(msg, "unknown shorthand flag") {
		cmdPath := "torpor"
		if cmd != nil {
			cmdPath = cmd.CommandPath()
		}
		fmt.Fprintf(a.stderr, "torpor: %s\nRun '%s --help' for usage.\n", msg, cmdPath)
		return 2
	}
	fmt.Fprintf(a.stderr, "torpor: %s\n", a.message(err))
	if errors.Is(err, context.Canceled) {
		return 130
	}
	return 1
}

// message is what to print for err, without a "torpor: " prefix.
func (a *app) message(err error) string {
	var ae *client.APIError
	if errors.As(err, &ae) {
		msg := ae.Message
		if msg == "" {
			msg = ae.Code
		}
		if ae.Code == apiv1.CodeUnauthenticated {
			msg += " (the server requires an API key: set TORPOR_API_KEY to one that `torpor key create` made on its host)"
		}
		return msg
	}
	if errors.Is(err, context.Canceled) {
		return "interrupted"
	}
	var ue *url.Error
	var oe *net.OpError
	if errors.As(err, &ue) && strings.HasPrefix(ue.URL, a.serverURL()) {
		// The request went out and the connection ended without an answer (the
		// server crashed or was killed mid-call): what the call did is unknown.
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || (errors.As(err, &oe) && oe.Op == "read") {
			what := strings.ToUpper(ue.Op) + " " + strings.TrimPrefix(ue.URL, a.serverURL())
			return fmt.Sprintf("the torpor server at %s closed the connection before answering %s: the call may or may not have taken effect (check with `torpor ls` or `torpor inspect ID`)", a.serverURL(), what)
		}
		if errors.As(err, &oe) {
			return fmt.Sprintf("cannot reach the torpor server at %s (is `torpor serve` running? set --url or TORPOR_URL): %v", a.serverURL(), oe)
		}
	}
	return strings.TrimPrefix(err.Error(), "torpor: ")
}

// reportFor prints the error of one of several arguments (rm ID…): "torpor:
// <arg>: <message>", without the "<arg>: " when the message names arg already
// (the server's `sandbox "x": not found`).
func (a *app) reportFor(arg string, err error) {
	msg := a.message(err)
	if !strings.Contains(msg, arg) {
		msg = arg + ": " + msg
	}
	fmt.Fprintf(a.stderr, "torpor: %s\n", msg)
}

// distinct is args without repeats, in their first order (`torpor key rm X X`
// removes X once, and does not fail on the second).
func distinct(args []string) []string {
	seen := make(map[string]bool, len(args))
	out := args[:0:0]
	for _, s := range args {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// isTerminal reports whether f is an *os.File on a terminal.
func isTerminal(f any) bool {
	file, ok := f.(*os.File)
	return ok && term.IsTerminal(int(file.Fd()))
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// nonNil is s, or an empty slice for nil, so that a list prints as [] in JSON
// as the API's answers do, never as null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// parseEnv turns K=V strings into a map.
func parseEnv(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	env := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usagef("--env %q: want KEY=VALUE", kv)
		}
		env[k] = v
	}
	return env, nil
}

// spinner shows an indeterminate progress spinner on stderr when it is a terminal;
// otherwise it does nothing. A nil *spinner is valid.
type spinner struct{ bar *progressbar.ProgressBar }

func (a *app) newSpinner(desc string) *spinner {
	if !isTerminal(a.stderr) {
		return nil
	}
	return &spinner{bar: progressbar.NewOptions(-1,
		progressbar.OptionSetWriter(a.stderr),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionSetRenderBlankState(true),
	)}
}

func (s *spinner) describe(desc string) {
	if s != nil {
		s.bar.Describe(desc)
	}
}

func (s *spinner) done() {
	if s != nil {
		_ = s.bar.Finish()
		_ = s.bar.Clear()
	}
}

// newBytesBar is a byte progress bar of size bytes (-1: unknown) on stderr when it
// is a terminal, else nil.
func (a *app) newBytesBar(size int64, desc string) *progressbar.ProgressBar {
	if !isTerminal(a.stderr) {
		return nil
	}
	return progressbar.NewOptions64(size,
		progressbar.OptionSetWriter(a.stderr),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowTotalBytes(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(65*time.Millisecond),
		progressbar.OptionShowCount(),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(a.stderr) }),
		progressbar.OptionSetRenderBlankState(true),
	)
}

// humanAge formats d like docker: 5s, 3m, 2h, 4d.
func humanAge(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	default:
		return fmt.Sprintf("%dd", int(d.Hours()/24))
	}
}

func mib(bytes int64) string { return fmt.Sprintf("%.1f MiB", float64(bytes)/(1<<20)) }

// size is bytes in a unit that shows it: B under 1 KiB, KiB under 1 MiB (a
// filesystem-mode snapshot of a few files), else MiB.
func size(bytes int64) string {
	switch {
	case bytes < 1<<10:
		return fmt.Sprintf("%d B", bytes)
	case bytes < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(bytes)/(1<<10))
	}
	return mib(bytes)
}
