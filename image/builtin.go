package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/torpor/torpor/sandbox"
)

// E2BBaseName is the name of the image that stands for E2B's "base" template (the
// template an E2B SDK gets when it names none), built by EnsureE2BBase. torpor's
// own default image stays BaseName.
const E2BBaseName = "e2b-base"

// E2BUser, E2BUID and E2BHome describe the account the E2B image has: the user
// E2B's envd runs commands as when the caller names none, with passwordless sudo
// (E2B's template build gives every template the same account).
const (
	E2BUser = "user"
	E2BUID  = 1000
	E2BHome = "/home/user"
)

// E2BBasePackages are the packages of E2BBaseName on top of Debian's minbase
// variant: what E2B's base template offers a program (bash, Python 3 with pip,
// Node.js with npm, git, curl, sudo) plus what every torpor image has.
var E2BBasePackages = []string{
	"bash", "ca-certificates", "coreutils", "curl", "git", "nodejs", "npm",
	"procps", "python3", "python3-pip", "sudo",
}

// e2bSetup are the mmdebstrap customize hooks of E2BBaseName (run by sh with the
// tree's root as $1, after the packages are installed). Like E2B's template
// build they create the account E2BUser (uid and gid E2BUID, home E2BHome from
// /etc/skel, shell bash, group sudo, no password), let it use sudo without a
// password, and make /usr/local and /code writable by everyone. pip may install
// outside Debian's packages (E2B's Python is not Debian's), so the
// EXTERNALLY-MANAGED marker goes.
//
// E2B's envd runs every command as a login shell (bash -l -c CMD), so the
// login start-up is on the path of every call, and each process a profile
// forks costs several milliseconds under gVisor. Debian's profiles fork two:
// /etc/profile's $(id -u), which bash answers from its own $EUID instead
// (sh, which has no EUID, still runs id: the same uid either way), and root's
// ~/.profile's `mesg n`, which only does anything on a terminal and now runs
// only when the shell has one. PATH, HOME, USER, PS1 and the rest of the
// login environment are what Debian's files give. Each edit is checked: a
// Debian release whose files differ fails the build rather than silently
// keeping the slow profile. Every command also runs with LANG=C.UTF-8 (the
// agent's default), for which glibc opens and maps the twelve files of
// /usr/lib/locale/C.utf8 in each process that sets its locale (bash,
// Python), about 2 ms under gVisor; from a locale archive it maps one file.
var e2bSetup = []string{
	fmt.Sprintf(`chroot "$1" useradd --create-home --home-dir %s --uid %d --user-group --groups sudo --shell /bin/bash %s`, E2BHome, E2BUID, E2BUser),
	fmt.Sprintf(`chroot "$1" passwd --delete %s`, E2BUser),
	fmt.Sprintf(`printf '%%s\n' '%s ALL=(ALL:ALL) NOPASSWD: ALL' > "$1/etc/sudoers.d/%s" && chmod 0440 "$1/etc/sudoers.d/%s"`, E2BUser, E2BUser, E2BUser),
	`mkdir -p "$1/code" && find "$1/usr/local" "$1/code" -type d -exec chmod 0777 {} +`,
	`rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED`,
	`sed -i 's/"$(id -u)"/"${EUID:-$(id -u)}"/' "$1/etc/profile" && ! grep -q '"$(id -u)"' "$1/etc/profile" && grep -q 'EUID:-' "$1/etc/profile"`,
	`chroot "$1" localedef --add-to-archive /usr/lib/locale/C.utf8 && chroot "$1" localedef --list-archive | grep -qx C.utf8`,
	`sed -i 's/^mesg n 2> \/dev\/null || true$/if [ -t 0 ] || [ -t 1 ] || [ -t 2 ]; then mesg n 2> \/dev\/null || true; fi/' "$1/root/.profile" && grep -q '^if \[ -t 0 \]' "$1/root/.profile"`,
}

// recipe is what a build installs: Debian packages (sorted, without
// duplicates) and, optionally, mmdebstrap customize hooks named setup.
type recipe struct {
	packages []string
	setup    string   // names hooks in the image's Source; "" when there are none
	hooks    []string // --customize-hook commands, run in order
}

// source is the image's Source: "mmdebstrap:<packages>", and with hooks
// ";<setup>@<12 hex of the hooks' sha256>", so that changing a hook changes
// the Source and thus the build cache's key. ';' is never in a package name.
func (r recipe) source() string {
	s := buildSource(r.packages)
	if len(r.hooks) > 0 {
		sum := sha256.Sum256([]byte(strings.Join(r.hooks, "\n")))
		s += ";" + r.setup + "@" + hex.EncodeToString(sum[:6])
	}
	return s
}

// builtins are the images torpor builds on first use, by name.
var builtins = map[string]recipe{
	BaseName:    {packages: slices.Sorted(slices.Values(BasePackages))},
	E2BBaseName: {packages: slices.Sorted(slices.Values(E2BBasePackages)), setup: "e2b-user", hooks: e2bSetup},
}

// Builtins returns the names of the built-in images: BaseName, then
// E2BBaseName.
func Builtins() []string { return []string{BaseName, E2BBaseName} }

// IsBuiltin reports whether name is a built-in image (see Builtins).
func IsBuiltin(name string) bool {
	_, ok := builtins[name]
	return ok
}

// EnsureBuiltin returns the built-in image name (see Builtins), building it on
// first use (from the build cache when it holds the recipe: seconds; else
// mmdebstrap: a minute or two); concurrent callers wait for the one build.
//
// An existing image of that name made from another recipe (an older torpor's,
// whose Source differs) is replaced by the current recipe's build when the
// build cache holds it (`torpor image warm`, which `make setup` runs, puts it
// there); sandboxes made from the old one keep it (they name its digest).
// Without a cached build the existing image is returned as it is, so that an
// upgrade never makes a create wait for mmdebstrap, and progress says how to
// update it. Errors wrap ErrInvalid when name is no built-in image; a failed
// build is reported as Build reports it.
func (s *Store) EnsureBuiltin(ctx context.Context, name string, progress io.Writer) (sandbox.Image, error) {
	r, ok := builtins[name]
	if !ok {
		return sandbox.Image{}, invalidf("ensure image %q: not a built-in image (want one of %s)", name, strings.Join(Builtins(), ", "))
	}
	if progress == nil {
		progress = io.Discard
	}
	unlock, err := s.lockName(ctx, name)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("ensure image %q: %w", name, err)
	}
	defer unlock()
	source := r.source()
	if img, ok, err := s.lookup(ctx, name); err != nil {
		return sandbox.Image{}, fmt.Errorf("ensure image %q: %w", name, err)
	} else if ok && img.Source != source && !s.inCache(source) {
		if _, err := os.Stat(s.Path(img.Digest)); err == nil {
			fmt.Fprintf(progress, "image %s: made from an older recipe (%s); `torpor image warm %s` puts the current one (%s) in the build cache, and the next use takes it\n",
				name, img.Source, name, source)
			return img, nil
		}
	}
	img, err := s.build(ctx, name, r, progress)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("ensure image %q: %w", name, err)
	}
	return img, nil
}

// EnsureBase returns the default image "base" (BasePackages), building it on
// first use: EnsureBuiltin(ctx, BaseName, progress).
func (s *Store) EnsureBase(ctx context.Context, progress io.Writer) (sandbox.Image, error) {
	return s.EnsureBuiltin(ctx, BaseName, progress)
}

// EnsureE2BBase returns the image E2BBaseName (E2BBasePackages and the E2B
// account), building it on first use: EnsureBuiltin(ctx, E2BBaseName,
// progress). The E2B API maps the template "base" to it.
func (s *Store) EnsureE2BBase(ctx context.Context, progress io.Writer) (sandbox.Image, error) {
	return s.EnsureBuiltin(ctx, E2BBaseName, progress)
}
