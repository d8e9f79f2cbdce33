package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
)

func (a *app) execCommand() *cobra.Command {
	var (
		envs      []string
		req       apiv1.ExecRequest
		withStdin bool
	)
	cmd := &cobra.Command{
		Use:   "exec ID [--env K=V] [--cwd DIR] [--timeout S] [--background] [--stdin] -- CMD [ARG...]",
		Short: "Run a command in a sandbox; its exit code becomes torpor's",
		Long: `Run a command in a sandbox, streaming its stdout and stderr to torpor's. torpor
exits with the command's exit code (127 if it could not be started).

With --stdin, torpor's standard input (when it is not a terminal) is given to the
command. With --background the command is started detached and its pid printed;
its output goes to /tmp/torpor-bg-<pid>.log inside the sandbox.`,
		Args: usageArgs(func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return errors.New("want a sandbox id and a command: exec ID -- CMD [ARG...]")
			}
			if d := cmd.ArgsLenAtDash(); d > 1 {
				return fmt.Errorf("want exactly one sandbox id before --, got %d arguments", d)
			}
			return nil
		}),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := args[0]
			req.Cmd = args[1:]
			env, err := parseEnv(envs)
			if err != nil {
				return err
			}
			req.Env = env
			if req.TimeoutS < 0 {
				return usagef("--timeout %g: want 0 or more seconds", req.TimeoutS)
			}
			if withStdin {
				if isTerminal(a.stdin) {
					return usagef("--stdin: standard input is a terminal; pipe or redirect the input")
				}
				b, err := io.ReadAll(a.stdin)
				if err != nil {
					return fmt.Errorf("reading stdin: %w", err)
				}
				req.Stdin = string(b)
			}
			c := a.client()
			if req.Background {
				pid, err := c.ExecBackground(cmd.Context(), id, req)
				if err != nil {
					return execErr(err)
				}
				_, err = fmt.Fprintln(a.stdout, pid)
				return err
			}
			code, err := c.ExecStream(cmd.Context(), id, req, a.stdout, a.stderr)
			if err != nil {
				return execErr(err)
			}
			if code != 0 {
				return exitStatus(code)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&envs, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringVarP(&req.Cwd, "cwd", "w", "", "working directory inside the sandbox")
	f.Float64Var(&req.TimeoutS, "timeout", 0, "kill the command this many seconds after the sandbox received the call, the wait to start it included (exit code 124; 0: none)")
	f.BoolVarP(&req.Background, "background", "d", false, "start detached and print the pid")
	f.BoolVarP(&withStdin, "stdin", "i", false, "give torpor's standard input to the command (when not a terminal)")
	return cmd
}

// execErr reports a process that could not start with exit code 127 (after printing
// why), like a shell.
// A stream cut before the exit status (the server stopped) exits 255, as ssh
// does for a lost connection: not 1, which the command itself may return.
func execErr(err error) error {
	var ee *client.ExecError
	if errors.As(err, &ee) {
		return &reportedExit{code: ee.ExitCode, err: err}
	}
	if errors.Is(err, client.ErrStreamBroken) {
		return &reportedExit{code: 255, err: err}
	}
	return err
}

// reportedExit prints err and exits with code.
type reportedExit struct {
	code int
	err  error
}

func (e *reportedExit) Error() string { return e.err.Error() }
func (e *reportedExit) Unwrap() error { return e.err }

// remoteSpec splits "ID:/abs/path"; ok is false for a local path.
func remoteSpec(s string) (id, p string, ok bool) {
	i := strings.IndexByte(s, ':')
	if i <= 0 || strings.ContainsAny(s[:i], `/\`) || !strings.HasPrefix(s[i+1:], "/") {
		return "", "", false
	}
	return s[:i], s[i+1:], true
}

func (a *app) cpCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file into or out of a sandbox (ID:/abs/path on one side, - for stdin/stdout)",
		Long: `Copy one file between this machine and a sandbox:

  torpor cp ./main.py ID:/work/main.py     upload
  torpor cp ID:/work/out.csv ./out.csv     download
  torpor cp - ID:/work/in.txt              upload standard input
  torpor cp ID:/etc/os-release -           download to standard output
  torpor cp A:/work/x B:/work/x            sandbox to sandbox

A destination ending in / (or an existing local directory) gets the source's base name.`,
		Args: usageArgs(cobra.ExactArgs(2)),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			c := a.client()
			src, dst := args[0], args[1]
			sid, spath, sRemote := remoteSpec(src)
			did, dpath, dRemote := remoteSpec(dst)
			switch {
			case !sRemote && !dRemote:
				for _, arg := range args {
					if i := strings.IndexByte(arg, ':'); i > 0 && !strings.ContainsAny(arg[:i], `/\`) {
						return usagef("%q: the path after %s: must be absolute (ID:/abs/path)", arg, arg[:i])
					}
				}
				return usagef("one of SRC and DST must be a sandbox path ID:/abs/path")
			case sRemote && dRemote:
				if strings.HasSuffix(dpath, "/") {
					dpath += path.Base(spath)
				}
				rc, err := c.ReadFile(ctx, sid, spath)
				if err != nil {
					return err
				}
				defer rc.Close()
				return c.WriteFile(ctx, did, dpath, rc)
			case dRemote:
				var r io.Reader = a.stdin
				if src == "-" {
					if strings.HasSuffix(dpath, "/") {
						return usagef("cp - %s: name the destination file", dst)
					}
				} else {
					f, err := os.Open(src)
					if err != nil {
						return err
					}
					defer f.Close()
					if st, err := f.Stat(); err == nil && st.IsDir() {
						return fmt.Errorf("%s is a directory (cp copies one file)", src)
					}
					r = f
					if strings.HasSuffix(dpath, "/") {
						dpath += filepath.Base(src)
					}
				}
				return c.WriteFile(ctx, did, dpath, r)
			default: // sandbox -> local
				rc, err := c.ReadFile(ctx, sid, spath)
				if err != nil {
					return err
				}
				defer rc.Close()
				if dst == "-" {
					_, err = io.Copy(a.stdout, rc)
					return err
				}
				if st, err := os.Stat(dst); (err == nil && st.IsDir()) || strings.HasSuffix(dst, string(os.PathSeparator)) {
					dst = filepath.Join(dst, path.Base(spath))
				}
				return writeLocal(dst, rc)
			}
		},
	}
}

// writeLocal writes r to name through a temporary file in the same directory, so a
// failed copy leaves no half-written file.
func writeLocal(name string, r io.Reader) error {
	tmp, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".torpor-*")
	if err != nil {
		return err
	}
	_, err = io.Copy(tmp, r)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		mode := os.FileMode(0o644)
		if st, serr := os.Stat(name); serr == nil {
			mode = st.Mode().Perm()
		}
		err = os.Chmod(tmp.Name(), mode)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), name)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return err
}
