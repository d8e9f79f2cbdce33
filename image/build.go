package image

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/torpor/torpor/sandbox"
)

// Suite is the Debian release Build installs.
const Suite = "bookworm"

// BaseName is the name of the default image, built by EnsureBase.
const BaseName = "base"

// BasePackages are the packages of the default image "base" (on top of
// Debian's minbase variant, which already has coreutils and bash).
var BasePackages = []string{"ca-certificates", "coreutils", "procps", "python3"}

// debPackageRE is Debian's package name syntax (Debian Policy 5.6.1).
var debPackageRE = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+$`)

// buildSource is the Source of an image built from packages (sorted).
func buildSource(pkgs []string) string {
	return "mmdebstrap:" + strings.Join(pkgs, ",")
}

// normalizePackages validates, sorts and de-duplicates a package list.
func normalizePackages(name string, packages []string) ([]string, error) {
	pkgs := make([]string, 0, len(packages))
	for _, p := range packages {
		p = strings.TrimSpace(p)
		if !debPackageRE.MatchString(p) {
			return nil, invalidf("build image %q: invalid package name %q (want Debian syntax %s)", name, p, debPackageRE)
		}
		pkgs = append(pkgs, p)
	}
	slices.Sort(pkgs)
	return slices.Compact(pkgs), nil
}

// CheckBuild checks the arguments of Build without building anything (the API
// answers with it before its build stream starts). name must be valid (see
// ValidName) and not a built-in image (see Builtins): those are built from
// their fixed recipes on first use, and a build under their name would point
// every later default create at other packages. packages may be empty (Debian's
// minbase alone: bash, coreutils, apt; no python3); each must be a Debian
// package name. Errors wrap ErrInvalid for a bad name or package name; a
// built-in name is a sandbox.Conflict error.
func CheckBuild(name string, packages []string) error {
	_, err := checkBuild(name, packages)
	return err
}

// checkBuild is CheckBuild, returning the packages sorted and de-duplicated.
func checkBuild(name string, packages []string) ([]string, error) {
	if !ValidName(name) {
		return nil, invalidf("build image %q: invalid name (want %s)", name, nameRE)
	}
	if IsBuiltin(name) {
		return nil, sandbox.Errorf(sandbox.Conflict, "build image %q: %q is a built-in image, built by torpor from fixed packages on first use; build yours under another name (e.g. %s-custom) and create sandboxes with --image NAME", name, name, name)
	}
	return normalizePackages(name, packages)
}

// Build builds the image name from Debian bookworm (mmdebstrap
// --variant=minbase) plus packages, stores it and points name at it. The
// output of mmdebstrap and mkfs.erofs goes to progress (nil: discarded). A
// build takes some 20 to 60 seconds and needs root and the Debian mirror.
//
// If name already holds an image built from the same package set (order and
// duplicates do not matter), Build returns it without building. Otherwise the
// new image replaces the name's old digest; the old file stays in the store.
// Builds of the same name run one at a time.
//
// Errors are CheckBuild's (a bad name or package name, a built-in name); a
// failed mmdebstrap (e.g. an unknown package) is reported with its last output.
func (s *Store) Build(ctx context.Context, name string, packages []string, progress io.Writer) (sandbox.Image, error) {
	pkgs, err := checkBuild(name, packages)
	if err != nil {
		return sandbox.Image{}, err
	}
	if progress == nil {
		progress = io.Discard
	}
	unlock, err := s.lockName(ctx, name)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("build image %q: %w", name, err)
	}
	defer unlock()
	return s.build(ctx, name, recipe{packages: pkgs}, progress)
}

// build does Build's work with the name's lock held: an existing image of
// that name made from r is returned; else r is taken from the build cache or
// built, and name points at the result.
func (s *Store) build(ctx context.Context, name string, r recipe, progress io.Writer) (sandbox.Image, error) {
	source := r.source()
	if img, ok, err := s.lookup(ctx, name); err != nil {
		return sandbox.Image{}, err
	} else if ok && img.Source == source {
		if _, err := os.Stat(s.Path(img.Digest)); err == nil {
			fmt.Fprintf(progress, "image %s: up to date (%s)\n", name, img.Digest)
			return img, nil
		}
	}

	start := time.Now()
	if cached, err := s.fromCache(source); err != nil {
		fmt.Fprintf(progress, "image cache: %v\n", err)
	} else if cached != "" {
		defer os.Remove(cached)
		img, err := s.store(ctx, name, source, cached, progress)
		if err != nil {
			return sandbox.Image{}, fmt.Errorf("build: %w", err)
		}
		fmt.Fprintf(progress, "image %s: from the build cache %s\n", name, s.cacheDir)
		return img, nil
	}
	work, err := os.MkdirTemp(s.tmpDir(), "build-"+name+"-")
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("build image %q: %w", name, err)
	}
	defer removeTree(work)
	root := filepath.Join(work, "root")

	args := []string{
		"--variant=minbase",
		// The tree is temporary and the EROFS file is fsynced: let dpkg skip
		// its fsyncs (halves the build time).
		"--dpkgopt=force-unsafe-io",
		// Keep images small: no manuals or docs (copyright files stay).
		"--dpkgopt=path-exclude=/usr/share/man/*",
		"--dpkgopt=path-exclude=/usr/share/info/*",
		"--dpkgopt=path-exclude=/usr/share/doc/*",
		"--dpkgopt=path-include=/usr/share/doc/*/copyright",
	}
	if len(r.packages) > 0 {
		args = append(args, "--include="+strings.Join(r.packages, ","))
	}
	for _, h := range r.hooks {
		args = append(args, "--customize-hook="+h)
	}
	args = append(args, Suite, root)
	fmt.Fprintf(progress, "image %s: mmdebstrap %s\n", name, strings.Join(args, " "))
	if err := runTool(ctx, progress, "mmdebstrap", args...); err != nil {
		return sandbox.Image{}, fmt.Errorf("build image %q: %w", name, err)
	}
	img, err := s.commit(ctx, name, source, root, progress)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("build: %w", err)
	}
	s.toCache(source, s.Path(img.Digest), progress)
	fmt.Fprintf(progress, "image %s: built in %s\n", name, time.Since(start).Round(100*time.Millisecond))
	return img, nil
}
