package image

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// Hostname is the host name every image is prepared for (/etc/hostname and a
// line in /etc/hosts).
const Hostname = "sandbox"

// AgentDir is the directory, relative to the image root, that every image has
// (empty, mode 0755) for the engine to bind-mount the guest agent on.
const AgentDir = "/.torpor"

// resolvConf names no nameserver: a sandbox has no DNS. Resolvers then try
// 127.0.0.1:53, where nothing listens, and fail at once; timeout and attempts
// bound the wait should a packet get lost instead.
const resolvConf = "# torpor: sandboxes have no DNS resolver.\noptions timeout:1 attempts:1\n"

// prepareTree makes the tree at dir fit to run as a sandbox root (see the
// package doc). All changes go through os.Root, so symlinks inside the image
// (e.g. /etc/resolv.conf -> /run/...) can never make us write outside dir; such
// symlinks are replaced by regular files.
func prepareTree(dir string) error {
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}
	r, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer r.Close()

	// /.torpor: an empty directory, 0755, owned by root.
	agent := strings.TrimPrefix(AgentDir, "/")
	if fi, err := r.Lstat(agent); err == nil && !fi.IsDir() {
		if err := r.Remove(agent); err != nil {
			return err
		}
	} else if err == nil {
		if err := r.RemoveAll(agent); err != nil {
			return err
		}
	}
	if err := r.Mkdir(agent, 0o755); err != nil {
		return err
	}
	if err := chownChmod(r, agent, 0o755); err != nil {
		return err
	}

	// /tmp: 1777.
	if fi, err := r.Lstat("tmp"); err == nil && !fi.IsDir() {
		if err := r.Remove("tmp"); err != nil {
			return err
		}
	}
	if err := r.MkdirAll("tmp", 0o755); err != nil {
		return err
	}
	if err := chownChmod(r, "tmp", 0o777|os.ModeSticky); err != nil {
		return err
	}

	// /etc/hostname, /etc/hosts, /etc/resolv.conf.
	if fi, err := r.Lstat("etc"); err == nil && !fi.IsDir() {
		return fmt.Errorf("/etc is not a directory (%s)", fi.Mode().Type())
	}
	if err := r.MkdirAll("etc", 0o755); err != nil {
		return err
	}
	old, _ := readRegular(r, "etc/hosts")
	if err := writeRegular(r, "etc/hosts", hostsFile(old)); err != nil {
		return err
	}
	if err := writeRegular(r, "etc/hostname", []byte(Hostname+"\n")); err != nil {
		return err
	}
	if err := writeRegular(r, "etc/resolv.conf", []byte(resolvConf)); err != nil {
		return err
	}
	return preparePython(r)
}

// PythonPath is the directory of torpor's Python SDK inside a sandbox (the
// manager writes it into the guest directory mounted at AgentDir).
const PythonPath = AgentDir + "/python"

// preparePython puts torpor's Python SDK on the system Python's path in images
// that have a Debian-style python3 (/usr/lib/python3/dist-packages): a .pth
// file naming PythonPath, so `import torpor.resume` works in every sandbox.
func preparePython(r *os.Root) error {
	fi, err := r.Lstat("usr/lib/python3/dist-packages")
	if err != nil || !fi.IsDir() {
		return nil // no Debian python3 here
	}
	return writeRegular(r, "usr/lib/python3/dist-packages/torpor.pth", []byte(PythonPath+"\n"))
}

// hostsFile returns old (an /etc/hosts) with the localhost and sandbox lines
// torpor needs added in front, unless already there.
func hostsFile(old []byte) []byte {
	want := [][2]string{{"127.0.0.1", "localhost"}, {"::1", "localhost"}, {"127.0.1.1", Hostname}}
	have := map[[2]string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(old))
	for sc.Scan() {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		f := strings.Fields(line)
		for i := 1; i < len(f); i++ {
			have[[2]string{f[0], f[i]}] = true
		}
	}
	var b bytes.Buffer
	for _, w := range want {
		if !have[w] {
			fmt.Fprintf(&b, "%s\t%s\n", w[0], w[1])
		}
	}
	b.Write(old)
	if len(old) > 0 && old[len(old)-1] != '\n' {
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// readRegular reads name if it is a regular file (not through a symlink).
func readRegular(r *os.Root, name string) ([]byte, error) {
	fi, err := r.Lstat(name)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", name)
	}
	return r.ReadFile(name)
}

// writeRegular replaces name by a regular file, mode 0644, owned by root.
func writeRegular(r *os.Root, name string, data []byte) error {
	if fi, err := r.Lstat(name); err == nil {
		if fi.IsDir() {
			err = r.RemoveAll(name)
		} else {
			err = r.Remove(name)
		}
		if err != nil {
			return err
		}
	}
	if err := r.WriteFile(name, data, 0o644); err != nil {
		return err
	}
	return chownChmod(r, name, 0o644)
}

func chownChmod(r *os.Root, name string, mode os.FileMode) error {
	if os.Geteuid() == 0 {
		if err := r.Lchown(name, 0, 0); err != nil {
			return err
		}
	}
	return r.Chmod(name, mode)
}

// runTool runs an external program, streaming its stdout and stderr to
// progress. On failure the error names the program, its exit status and the
// last lines it printed.
func runTool(ctx context.Context, progress io.Writer, name string, args ...string) error {
	tail := &tailBuffer{max: 4096}
	w := io.MultiWriter(progress, tail)
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout = w
	cmd.Stderr = w
	// Let the tool clean up (mmdebstrap unmounts /proc etc. on SIGTERM).
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", name, ctx.Err())
		}
		out := strings.TrimSpace(tail.String())
		if out != "" {
			return fmt.Errorf("%s %s: %w; last output:\n%s", name, strings.Join(args, " "), err, out)
		}
		return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.max {
		t.buf = append([]byte(nil), t.buf[len(t.buf)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.buf) }

// removeTree removes the directory tree at dir. It first lazily unmounts
// anything mounted below dir (an interrupted mmdebstrap can leave /proc or /sys
// mounted in its target), so that removal never descends into a host file
// system.
func removeTree(dir string) error {
	dir = filepath.Clean(dir)
	if mounts, err := mountsBelow(dir); err == nil && len(mounts) > 0 {
		sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
		for _, m := range mounts {
			if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
				return fmt.Errorf("unmount %s: %w", m, err)
			}
		}
		if still, err := mountsBelow(dir); err == nil && len(still) > 0 {
			return fmt.Errorf("remove %s: still mounted: %s", dir, strings.Join(still, ", "))
		}
	}
	err := os.RemoveAll(dir)
	if err != nil && errors.Is(err, fs.ErrPermission) {
		// Files marked immutable or dirs without write permission for a non-root run.
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				_ = os.Chmod(p, 0o700)
			}
			return nil
		})
		err = os.RemoveAll(dir)
	}
	return err
}

// mountsBelow lists the mount points strictly below dir.
func mountsBelow(dir string) ([]string, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out, nil
}

// unescapeMountinfo decodes the \ooo octal escapes of /proc/self/mountinfo.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			o := s[i+1 : i+4]
			var v int
			if _, err := fmt.Sscanf(o, "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
