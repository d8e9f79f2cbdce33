package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/sandbox"
)

func newStore(t *testing.T) *Store {
	t.Helper()
	dir := t.TempDir()
	db, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(filepath.Join(dir, "images"), db)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// tarEntry is one entry for makeTar.
type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
	uid, gid         int
}

func makeTar(t testing.TB, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid, Linkname: e.link, ModTime: mtime, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// checkStored checks the stored file of img: it exists, is 0444, its sha256 is
// the digest, and fsck.erofs accepts it. It returns the image extracted with
// fsck.erofs (if available) for content checks, or "".
func checkStored(t *testing.T, s *Store, img sandbox.Image) string {
	t.Helper()
	got, p, err := s.Get(context.Background(), img.Digest)
	if err != nil {
		t.Fatalf("Get(%s): %v", img.Digest, err)
	}
	if got.Digest != img.Digest || p != s.Path(img.Digest) {
		t.Fatalf("Get(%s) = %+v, %s", img.Digest, got, p)
	}
	if want := filepath.Join(s.Dir(), "sha256", strings.TrimPrefix(img.Digest, "sha256:")+".erofs"); p != want {
		t.Fatalf("path %s, want %s", p, want)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o444 {
		t.Errorf("%s: mode %v, want 0444", p, fi.Mode())
	}
	if fi.Size() != img.Bytes {
		t.Errorf("%s: %d bytes, record says %d", p, fi.Size(), img.Bytes)
	}
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if d := "sha256:" + hex.EncodeToString(sum[:]); d != img.Digest {
		t.Fatalf("file sha256 %s != digest %s", d, img.Digest)
	}
	if _, err := exec.LookPath("fsck.erofs"); err != nil {
		t.Log("fsck.erofs not installed; content not checked")
		return ""
	}
	out := filepath.Join(t.TempDir(), "x")
	if b, err := exec.Command("fsck.erofs", "--extract="+out, p).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs %s: %v\n%s", p, err, b)
	}
	checkPrepared(t, out)
	return out
}

// checkPrepared checks the tree at out (an image's root) is prepared for a
// sandbox (see the package doc).
func checkPrepared(t *testing.T, out string) {
	t.Helper()
	if fi, err := os.Lstat(filepath.Join(out, ".torpor")); err != nil || !fi.IsDir() {
		t.Errorf("/.torpor: %v %v", fi, err)
	} else if ents, _ := os.ReadDir(filepath.Join(out, ".torpor")); len(ents) != 0 {
		t.Errorf("/.torpor not empty: %v", ents)
	}
	hosts := readFile(t, filepath.Join(out, "etc/hosts"))
	for _, want := range []string{"127.0.0.1\tlocalhost", "::1\tlocalhost", "\tsandbox\n"} {
		if !strings.Contains(hosts, want) {
			t.Errorf("/etc/hosts lacks %q:\n%s", want, hosts)
		}
	}
	if h := readFile(t, filepath.Join(out, "etc/hostname")); h != "sandbox\n" {
		t.Errorf("/etc/hostname = %q", h)
	}
	if r := readFile(t, filepath.Join(out, "etc/resolv.conf")); strings.Contains(r, "nameserver") {
		t.Errorf("/etc/resolv.conf names a nameserver:\n%s", r)
	}
	if _, err := os.Stat(filepath.Join(out, "usr/lib/python3/dist-packages")); err == nil {
		if p := readFile(t, filepath.Join(out, "usr/lib/python3/dist-packages/torpor.pth")); p != PythonPath+"\n" {
			t.Errorf("torpor.pth = %q", p)
		}
	}
	if fi, err := os.Lstat(filepath.Join(out, "tmp")); err != nil || fi.Mode()&(fs.ModePerm|fs.ModeSticky) != 0o777|fs.ModeSticky {
		t.Errorf("/tmp: %v %v", fi.Mode(), err)
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	if !fi.Mode().IsRegular() {
		t.Fatalf("%s: not a regular file (%v)", p, fi.Mode())
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestValidation(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	for _, n := range []string{"", "Base", "-x", "a/b", "a b", "sha256:x", strings.Repeat("a", 64)} {
		if _, err := s.Build(ctx, n, nil, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("Build(%q): %v, want ErrInvalid", n, err)
		}
		if _, err := s.Import(ctx, n, strings.NewReader(""), nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("Import(%q): %v, want ErrInvalid", n, err)
		}
	}
	for _, p := range []string{"", "a", "Python3", "py thon", "--include=x", "x;rm"} {
		if _, err := s.Build(ctx, "ok", []string{"python3", p}, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("Build(packages %q): %v, want ErrInvalid", p, err)
		}
	}
	// A built-in image's name is taken: building it with other packages would
	// point every later default create at them (a new-user trial rebuilt base
	// with no packages, and python3 was gone). Nothing is stored.
	for _, n := range Builtins() {
		for _, pkgs := range [][]string{nil, {"git"}, BasePackages} {
			err := CheckBuild(n, pkgs)
			if sandbox.KindOf(err) != sandbox.Conflict || !strings.Contains(err.Error(), "built-in image") {
				t.Errorf("CheckBuild(%q, %q): %v, want a conflict naming the built-in image", n, pkgs, err)
			}
			if _, err := s.Build(ctx, n, pkgs, nil); sandbox.KindOf(err) != sandbox.Conflict {
				t.Errorf("Build(%q, %q): %v, want a conflict", n, pkgs, err)
			}
		}
		if _, _, err := s.Get(ctx, n); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q) after the refused builds: %v, want not found", n, err)
		}
	}
	if err := CheckBuild("mine", nil); err != nil {
		t.Errorf("CheckBuild(mine, no packages): %v; minbase alone is a valid image", err)
	}
	if _, _, err := s.Get(ctx, "nope"); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `image "nope" not found`) {
		t.Errorf("Get(nope): %v", err)
	}
	if _, _, err := s.Get(ctx, "sha256:"+strings.Repeat("0", 64)); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(unknown digest): %v", err)
	}
	if _, _, err := s.Get(ctx, "sha256:../../etc/passwd"); !errors.Is(err, ErrInvalid) {
		t.Errorf("Get(bad digest): %v", err)
	}
	if p := s.Path("sha256:../x"); p != "" {
		t.Errorf("Path(bad) = %q", p)
	}
	if l, err := s.List(ctx); err != nil || len(l) != 0 {
		t.Errorf("List = %v, %v", l, err)
	}
}

func TestImportRootfs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (ownership)")
	}
	s := newStore(t)
	ctx := context.Background()
	// A host file that a malicious symlink points at: prepare must not touch it.
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	archive := makeTar(t, []tarEntry{
		{name: "./", typ: tar.TypeDir},
		{name: "./bin/", typ: tar.TypeDir},
		{name: "./bin/hello", body: "#!/bin/sh\necho hi\n", mode: 0o4755},
		{name: "./bin/hi", typ: tar.TypeSymlink, link: "hello"},
		{name: "./bin/hello2", typ: tar.TypeLink, link: "bin/hello"},
		{name: "./home/u/notes.txt", body: "mine", uid: 1000, gid: 1000, mode: 0o600},
		{name: "./dev/null", typ: tar.TypeChar},
		{name: "./etc/hosts", typ: tar.TypeSymlink, link: victim},
		{name: "./etc/resolv.conf", typ: tar.TypeSymlink, link: "../run/systemd/resolve/stub-resolv.conf"},
		{name: "./etc/later", body: "first"},
		{name: "./etc/later", body: "second"},
	})
	var progress bytes.Buffer
	img, err := s.Import(ctx, "plain", bytes.NewReader(archive), &progress)
	if err != nil {
		t.Fatalf("Import: %v\n%s", err, progress.String())
	}
	t.Logf("progress:\n%s", progress.String())
	if img.Name != "plain" || img.Source != "import:rootfs-tar" || img.Bytes == 0 || img.CreatedAt.IsZero() {
		t.Errorf("image = %+v", img)
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Fatalf("host file written through a symlink: %q", b)
	}
	out := checkStored(t, s, img)
	if out != "" {
		if l, err := os.Readlink(filepath.Join(out, "bin/hi")); err != nil || l != "hello" {
			t.Errorf("symlink: %q %v", l, err)
		}
		if b := readFile(t, filepath.Join(out, "bin/hello2")); !strings.Contains(b, "echo hi") {
			t.Errorf("hard link content %q", b)
		}
		if b := readFile(t, filepath.Join(out, "etc/later")); b != "second" {
			t.Errorf("etc/later = %q", b)
		}
		if _, err := os.Lstat(filepath.Join(out, "dev/null")); err == nil {
			t.Errorf("device node extracted")
		}
	}
	// Ownership and modes, straight from the image.
	if b, err := exec.Command("dump.erofs", "--path=/home/u/notes.txt", s.Path(img.Digest)).CombinedOutput(); err != nil {
		t.Logf("dump.erofs: %v", err)
	} else if !strings.Contains(string(b), "Uid: 1000") {
		t.Errorf("/home/u/notes.txt: want uid 1000 in\n%s", b)
	}
	if m, ok := erofsMode(t, s.Path(img.Digest), "/bin/hello"); ok && m&0o7777 != 0o4755 {
		t.Errorf("/bin/hello: mode %o, want 4755", m)
	}

	got, p, err := s.Get(ctx, "plain")
	if err != nil || got.Digest != img.Digest || p != s.Path(img.Digest) {
		t.Errorf("Get(plain) = %+v, %s, %v", got, p, err)
	}
	// Same name again, gzip-compressed: replaces the record, keeps the old file.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(archive)
	zw.Close()
	img2, err := s.Import(ctx, "plain", &gz, nil)
	if err != nil {
		t.Fatalf("Import gzip: %v", err)
	}
	if _, err := os.Stat(s.Path(img.Digest)); err != nil {
		t.Errorf("old file removed: %v", err)
	}
	got, _, _ = s.Get(ctx, "plain")
	if got.Digest != img2.Digest {
		t.Errorf("name points at %s, want %s", got.Digest, img2.Digest)
	}
	list, err := s.List(ctx)
	if err != nil || len(list) != 1 || list[0].Name != "plain" {
		t.Errorf("List = %+v, %v", list, err)
	}
	// Temp files are gone.
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "tmp")); len(ents) != 0 {
		t.Errorf("tmp not empty: %v", ents)
	}
}

func TestImportRejects(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	cases := map[string][]byte{
		"escape":   makeTar(t, []tarEntry{{name: "ok", body: "x"}, {name: "../escape", body: "x"}}),
		"escape2":  makeTar(t, []tarEntry{{name: "a/../../escape", body: "x"}}),
		"hardlink": makeTar(t, []tarEntry{{name: "a", typ: tar.TypeLink, link: "../../etc/passwd"}}),
		// Out through a symlink the archive made (os.Root refuses; a new-user
		// trial got 500 "path escapes from parent" for it).
		"symlink-abs": makeTar(t, []tarEntry{{name: "esc", typ: tar.TypeSymlink, link: "/tmp"}, {name: "esc/file", body: "x"}}),
		"symlink-rel": makeTar(t, []tarEntry{{name: "esc", typ: tar.TypeSymlink, link: "../../.."}, {name: "esc/escape", body: "x"}}),
		"symlink-dir": makeTar(t, []tarEntry{{name: "esc", typ: tar.TypeSymlink, link: "/"}, {name: "esc/sub/", typ: tar.TypeDir}}),
		"notar":       []byte("this is just some text, not a tar archive at all\n"),
		"empty":       nil,
		"zstd":        {0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0},
	}
	for n, data := range cases {
		_, err := s.Import(ctx, n, bytes.NewReader(data), nil)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", n, err)
			continue
		}
		t.Logf("%s: %v", n, err)
		if n == "notar" && !strings.HasPrefix(err.Error(), "import notar: not a tar archive: ") {
			t.Errorf("%s: message %q", n, err)
		}
		if strings.HasPrefix(n, "symlink-") && !strings.Contains(err.Error(), "leads out of the image through a symlink") {
			t.Errorf("%s: message %q, want it to say the path leads out through a symlink", n, err)
		}
		if _, _, err := s.Get(ctx, n); !errors.Is(err, ErrNotFound) {
			t.Errorf("%s: Get after failed import: %v", n, err)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(s.Dir()), "escape")); err == nil {
		t.Errorf("escape written")
	}
}

// testImage is a two-layer image: the second layer deletes /a/old (whiteout)
// and adds /a/new.
func testImage(t testing.TB) v1.Image {
	t.Helper()
	layer := func(entries []tarEntry) v1.Layer {
		data := makeTar(t, entries)
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	img, err := mutate.AppendLayers(empty.Image,
		layer([]tarEntry{{name: "a/", typ: tar.TypeDir}, {name: "a/old", body: "old"}, {name: "a/keep", body: "keep"}, {name: "lib", typ: tar.TypeSymlink, link: "usr/lib"}, {name: "usr/lib/x.so", body: "elf"}}),
		layer([]tarEntry{{name: "a/.wh.old", body: ""}, {name: "a/new", body: "new"}}),
	)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func checkTestImage(t *testing.T, out string) {
	t.Helper()
	if out == "" {
		return
	}
	if b := readFile(t, filepath.Join(out, "a/keep")); b != "keep" {
		t.Errorf("a/keep = %q", b)
	}
	if b := readFile(t, filepath.Join(out, "a/new")); b != "new" {
		t.Errorf("a/new = %q", b)
	}
	if _, err := os.Lstat(filepath.Join(out, "a/old")); err == nil {
		t.Errorf("a/old survived its whiteout")
	}
	if _, err := os.Lstat(filepath.Join(out, "a/.wh.old")); err == nil {
		t.Errorf("whiteout file extracted")
	}
	if b := readFile(t, filepath.Join(out, "usr/lib/x.so")); b != "elf" {
		t.Errorf("usr/lib/x.so = %q", b)
	}
}

func TestImportDockerSave(t *testing.T) {
	s := newStore(t)
	ref, err := name.ParseReference("torpor.test/demo:1")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := tarball.Write(ref, testImage(t), &buf); err != nil {
		t.Fatal(err)
	}
	img, err := s.Import(context.Background(), "demo", &buf, nil)
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	if img.Source != "import:docker-save:torpor.test/demo:1" {
		t.Errorf("source %q", img.Source)
	}
	checkTestImage(t, checkStored(t, s, img))
}

func TestImportOCILayout(t *testing.T) {
	s := newStore(t)
	dir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(testImage(t)); err != nil {
		t.Fatal(err)
	}
	// Tar the layout, gzip-compressed.
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	tw.Close()
	zw.Close()
	img, err := s.Import(context.Background(), "oci", &buf, nil)
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	if img.Source != "import:oci-layout" {
		t.Errorf("source %q", img.Source)
	}
	checkTestImage(t, checkStored(t, s, img))
}

// skipUnlessBuild skips a test that may run mmdebstrap where it cannot: with
// -short, without root, without mmdebstrap.
func skipUnlessBuild(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: no image build")
	}
	if os.Geteuid() != 0 {
		t.Skip("mmdebstrap needs root")
	}
	if _, err := exec.LookPath("mmdebstrap"); err != nil {
		t.Skip("mmdebstrap not installed")
	}
}

// TestBuild runs mmdebstrap once (40 to 90 s) and checks the cache makes the
// second build of the same name and packages instant.
func TestBuild(t *testing.T) {
	skipUnlessBuild(t)
	s := newStore(t)
	ctx := context.Background()
	var progress bytes.Buffer
	start := time.Now()
	img, err := s.Build(ctx, "tiny", nil, &progress)
	if err != nil {
		t.Fatalf("Build: %v\n%s", err, progress.String())
	}
	t.Logf("built %s (%d bytes) in %s", img.Digest, img.Bytes, time.Since(start).Round(time.Second))
	if img.Source != "mmdebstrap:" {
		t.Errorf("source %q", img.Source)
	}
	out := checkStored(t, s, img)
	if out != "" {
		for _, f := range []string{"bin/sh", "usr/bin/ls", "usr/bin/dpkg"} {
			if _, err := os.Stat(filepath.Join(out, f)); err != nil {
				t.Errorf("image lacks /%s: %v", f, err)
			}
		}
		if ents, err := os.ReadDir(filepath.Join(out, "usr/share/man")); err == nil && len(ents) > 0 {
			t.Logf("note: /usr/share/man has %d entries", len(ents))
		}
	}

	// Same name, same (empty) package set: cached, concurrently.
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			again, err := s.Build(ctx, "tiny", []string{}, nil)
			if err != nil || again.Digest != img.Digest {
				t.Errorf("second Build = %+v, %v", again, err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("second Build took %s, want cached", d)
			}
		}()
	}
	wg.Wait()
}

// erofsMode reads the raw i_mode of path in the EROFS image (dump.erofs shows
// only the permission bits). ok is false if dump.erofs is missing.
func erofsMode(t *testing.T, img, path string) (mode uint16, ok bool) {
	t.Helper()
	sb, err := exec.Command("dump.erofs", "-s", img).CombinedOutput()
	if err != nil {
		t.Logf("dump.erofs: %v", err)
		return 0, false
	}
	in, err := exec.Command("dump.erofs", "--path="+path, img).CombinedOutput()
	if err != nil {
		t.Fatalf("dump.erofs --path=%s: %v\n%s", path, err, in)
	}
	var meta, nid int64
	for _, l := range strings.Split(string(sb), "\n") {
		if strings.HasPrefix(l, "Filesystem inode metadata start block:") {
			fmt.Sscan(strings.TrimSpace(strings.TrimPrefix(l, "Filesystem inode metadata start block:")), &meta)
		}
	}
	for _, l := range strings.Split(string(in), "\n") {
		if strings.HasPrefix(l, "NID:") {
			fmt.Sscan(strings.TrimPrefix(l, "NID:"), &nid)
		}
	}
	data, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	off := meta*4096 + nid*32 + 4 // i_format (2), i_xattr_icount (2), i_mode (2)
	if nid == 0 || off+2 > int64(len(data)) {
		t.Fatalf("cannot find inode of %s (meta %d, nid %d)", path, meta, nid)
	}
	return binary.LittleEndian.Uint16(data[off:]), true
}
