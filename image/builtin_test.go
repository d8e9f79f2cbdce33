package image

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestBuiltinSources: base keeps the Source (and so the build cache key) it had
// before built-in recipes could carry hooks; e2b-base's Source names its
// packages and a digest of its hooks, which changes with any hook.
func TestBuiltinSources(t *testing.T) {
	if got := builtins[BaseName].source(); got != buildSource(slices.Sorted(slices.Values(BasePackages))) {
		t.Errorf("base source %q, want the plain package source", got)
	}
	if got := builtins[BaseName].source(); got != "mmdebstrap:ca-certificates,coreutils,procps,python3" {
		t.Errorf("base source %q changed: every host's cached base would be rebuilt", got)
	}
	e2b := builtins[E2BBaseName]
	want := regexp.MustCompile(`^` + regexp.QuoteMeta(buildSource(slices.Sorted(slices.Values(E2BBasePackages)))) + `;e2b-user@[0-9a-f]{12}$`)
	if got := e2b.source(); !want.MatchString(got) {
		t.Errorf("e2b-base source %q, want match %s", got, want)
	}
	changed := e2b
	changed.hooks = append(slices.Clone(e2b.hooks[:len(e2b.hooks)-1]), e2b.hooks[len(e2b.hooks)-1]+" ")
	if changed.source() == e2b.source() {
		t.Errorf("a changed hook kept the source %q", e2b.source())
	}
	for _, name := range Builtins() {
		if !IsBuiltin(name) || !ValidName(name) {
			t.Errorf("Builtins() has %q: IsBuiltin %v, ValidName %v", name, IsBuiltin(name), ValidName(name))
		}
		if _, err := normalizePackages(name, builtins[name].packages); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if IsBuiltin("tiny") {
		t.Error(`IsBuiltin("tiny")`)
	}
}

func TestEnsureBuiltinRejects(t *testing.T) {
	s := newStore(t)
	if _, err := s.EnsureBuiltin(context.Background(), "py-git", nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("EnsureBuiltin(py-git) = %v, want ErrInvalid", err)
	}
	if err := WarmBuildCache(context.Background(), t.TempDir(), []string{BaseName, "py-git"}, nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("WarmBuildCache(py-git) = %v, want ErrInvalid", err)
	}
	if err := WarmBuildCache(context.Background(), "", nil, nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("WarmBuildCache without a cache = %v, want ErrInvalid", err)
	}
}

// TestE2BBase builds e2b-base (from the host's build cache when `make setup`
// warmed it: seconds; else mmdebstrap, about a minute) and checks the E2B
// account and tools in the packed file system. e2e/e2b_image_test.go runs them.
func TestE2BBase(t *testing.T) {
	skipUnlessBuild(t)
	s := newStore(t)
	s.SetBuildCache(BuildCacheFromEnv())
	ctx := context.Background()
	var progress strings.Builder
	t0 := time.Now()
	img, err := s.EnsureE2BBase(ctx, &progress)
	if err != nil {
		t.Fatalf("EnsureE2BBase: %v\n%s", err, progress.String())
	}
	t.Logf("e2b-base %s (%d MiB) in %v", img.Digest, img.Bytes>>20, time.Since(t0).Round(100*time.Millisecond))
	if img.Name != E2BBaseName || img.Source != builtins[E2BBaseName].source() {
		t.Errorf("image %q source %q, want %q %q", img.Name, img.Source, E2BBaseName, builtins[E2BBaseName].source())
	}
	_, file, err := s.Get(ctx, E2BBaseName)
	if err != nil {
		t.Fatal(err)
	}
	root := openImage(t, file)
	checkPrepared(t, root)

	// The account, as E2B's template build makes it.
	passwd := readFile(t, filepath.Join(root, "etc/passwd"))
	if !slices.Contains(strings.Split(passwd, "\n"), "user:x:1000:1000::/home/user:/bin/bash") {
		t.Errorf("/etc/passwd has no user 1000 with home /home/user and bash:\n%s", passwd)
	}
	group := strings.Split(readFile(t, filepath.Join(root, "etc/group")), "\n")
	if !slices.Contains(group, "user:x:1000:") {
		t.Errorf("/etc/group has no group user 1000: %q", group)
	}
	if i := slices.IndexFunc(group, func(l string) bool { return strings.HasPrefix(l, "sudo:") }); i < 0 || !slices.Contains(strings.Split(strings.SplitN(group[i], ":", 4)[3], ","), "user") {
		t.Errorf("user is not in group sudo: %q", group)
	}
	shadow := strings.Split(readFile(t, filepath.Join(root, "etc/shadow")), "\n")
	if i := slices.IndexFunc(shadow, func(l string) bool { return strings.HasPrefix(l, "user:") }); i < 0 || strings.Split(shadow[i], ":")[1] != "" {
		t.Errorf("/etc/shadow: want user without a password, have %q", shadow)
	}
	sudoers := filepath.Join(root, "etc/sudoers.d/user")
	if got := readFile(t, sudoers); got != "user ALL=(ALL:ALL) NOPASSWD: ALL\n" {
		t.Errorf("sudoers.d/user = %q", got)
	}
	for _, c := range []struct {
		path string
		uid  uint32
		mode os.FileMode
		dir  bool
	}{
		{path: "home/user", uid: 1000, mode: 0o755, dir: true},
		{path: "home/user/.bashrc", uid: 1000, mode: 0o644},
		{path: "etc/sudoers.d/user", mode: 0o440},
		{path: "usr/local/bin", mode: 0o777, dir: true},
		{path: "code", mode: 0o777, dir: true},
	} {
		fi, err := os.Lstat(filepath.Join(root, c.path))
		if err != nil {
			t.Errorf("/%s: %v", c.path, err)
			continue
		}
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid != c.uid || st.Gid != c.uid || fi.Mode().Perm() != c.mode || fi.IsDir() != c.dir {
			t.Errorf("/%s: %d:%d %v, want %d:%d %v (directory %v)", c.path, st.Uid, st.Gid, fi.Mode(), c.uid, c.uid, c.mode, c.dir)
		}
	}
	// fsck.erofs extracts without the setuid bit: read the packed inode.
	if m, ok := erofsMode(t, s.Path(img.Digest), "/usr/bin/sudo"); ok && m&0o7777 != 0o4755 {
		t.Errorf("/usr/bin/sudo: mode %o, want 4755", m&0o7777)
	}
	for _, bin := range []string{"bash", "python3", "pip3", "node", "npm", "git", "curl", "sudo", "su", "runuser", "ps"} {
		found := false
		for _, dir := range []string{"usr/bin", "usr/sbin"} {
			if fi, err := os.Stat(filepath.Join(root, dir, bin)); err == nil && fi.Mode()&0o111 != 0 {
				found = true
			}
		}
		if !found {
			t.Errorf("image has no executable %s", bin)
		}
	}
	if m, _ := filepath.Glob(filepath.Join(root, "usr/lib/python3*/EXTERNALLY-MANAGED")); len(m) != 0 {
		t.Errorf("pip is refused outside a venv: %v", m)
	}

	// A second call returns the stored image.
	t1 := time.Now()
	again, err := s.EnsureE2BBase(ctx, nil)
	if err != nil || again.Digest != img.Digest {
		t.Errorf("second EnsureE2BBase = %s, %v; want %s", again.Digest, err, img.Digest)
	}
	if d := time.Since(t1); d > 5*time.Second {
		t.Errorf("second EnsureE2BBase took %v, want the stored image", d)
	}
}

// openImage returns a directory holding the tree of the EROFS file p: mounted
// read-only (the host kernel's erofs through a loop device: instant), or where
// that fails extracted with fsck.erofs (half a minute for e2b-base, and without
// setuid bits).
func openImage(t *testing.T, p string) string {
	t.Helper()
	dir := t.TempDir()
	out, err := exec.Command("mount", "-t", "erofs", "-o", "ro,loop", p, dir).CombinedOutput()
	if err == nil {
		t.Cleanup(func() {
			if err := syscall.Unmount(dir, 0); err != nil {
				syscall.Unmount(dir, syscall.MNT_DETACH)
			}
		})
		return dir
	}
	t.Logf("mount -t erofs %s: %v %s; extracting with fsck.erofs instead", p, err, strings.TrimSpace(string(out)))
	x := filepath.Join(dir, "x")
	if out, err := exec.Command("fsck.erofs", "--extract="+x, p).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs %s: %v\n%s", p, err, out)
	}
	return x
}

// TestEnsureBuiltinNewRecipe: a built-in image made from an older recipe (its
// Source differs from the current one) is kept while the build cache lacks
// the current recipe, and replaced by the cached build once it is there; the
// old image stays reachable by digest for the sandboxes made from it.
func TestEnsureBuiltinNewRecipe(t *testing.T) {
	s := newStore(t)
	s.SetBuildCache(t.TempDir())
	ctx := context.Background()
	file := func(content string) string {
		f, err := os.CreateTemp(s.tmpDir(), "fake-*.erofs")
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString(content)
		f.Close()
		return f.Name()
	}
	old, err := s.store(ctx, E2BBaseName, "mmdebstrap:bash;e2b-user@000000000000", file("old recipe"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var progress strings.Builder
	got, err := s.EnsureBuiltin(ctx, E2BBaseName, &progress)
	if err != nil || got.Digest != old.Digest {
		t.Fatalf("EnsureBuiltin without the new recipe cached = %s, %v; want the old image %s kept", got.Digest, err, old.Digest)
	}
	if !strings.Contains(progress.String(), "older recipe") || !strings.Contains(progress.String(), "torpor image warm "+E2BBaseName) {
		t.Errorf("progress %q does not say the image is from an older recipe and how to update it", progress.String())
	}

	src := builtins[E2BBaseName].source()
	if err := os.Rename(file("current recipe"), s.cachePath(src)); err != nil {
		t.Fatal(err)
	}
	got, err = s.EnsureBuiltin(ctx, E2BBaseName, io.Discard)
	if err != nil || got.Digest == old.Digest || got.Source != src {
		t.Fatalf("EnsureBuiltin with the new recipe cached = %+v, %v; want a new digest with Source %q", got, err, src)
	}
	if img, _, err := s.Get(ctx, E2BBaseName); err != nil || img.Digest != got.Digest {
		t.Errorf("Get(%s) = %s, %v; want %s", E2BBaseName, img.Digest, err, got.Digest)
	}
	if _, p, err := s.Get(ctx, old.Digest); err != nil || p == "" {
		t.Errorf("the old image by digest: %q, %v; want it kept", p, err)
	}
	again, err := s.EnsureBuiltin(ctx, E2BBaseName, io.Discard)
	if err != nil || again.Digest != got.Digest {
		t.Errorf("EnsureBuiltin again = %s, %v; want %s", again.Digest, err, got.Digest)
	}
}
