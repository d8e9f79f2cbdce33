package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/torpor/torpor/sandbox"
)

// Archive kinds Import recognizes.
const (
	kindDocker = "docker-save" // has manifest.json
	kindOCI    = "oci-layout"  // has oci-layout and index.json
	kindRootfs = "rootfs-tar"  // anything else that is a tar
)

// Import reads an image archive from r, stores it and points name at it. r may
// be (a) a "docker save" archive (has manifest.json; one image), (b) an OCI
// image-layout archive (has oci-layout and index.json; the image for this
// machine's platform, or the only one), or (c) a plain root-filesystem tarball
// (e.g. "docker export"); each may be gzip-compressed. Image layers are
// flattened with their whiteouts applied. The tree is prepared like a built
// image (see the package doc). Device nodes and fifos are skipped; extended
// attributes (e.g. file capabilities) are not kept. Progress messages go to
// progress (nil: discarded). The image's Source is "import:<kind>" with kind
// docker-save, oci-layout or rootfs-tar (followed by ":<tag>" when a docker
// archive names one).
//
// Errors wrap ErrInvalid for a bad name, for input that is not a tar archive
// ("import foo: not a tar archive: …"), and for archives with entries that
// would escape the root (".." components), are sparse files or are otherwise
// unusable. Imports of the same name run one at a time; the name's old image
// file stays in the store.
func (s *Store) Import(ctx context.Context, name string, r io.Reader, progress io.Writer) (sandbox.Image, error) {
	if !ValidName(name) {
		return sandbox.Image{}, invalidf("import %q: invalid name (want %s)", name, nameRE)
	}
	if progress == nil {
		progress = io.Discard
	}
	start := time.Now()
	work, err := os.MkdirTemp(s.tmpDir(), "import-"+name+"-")
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
	}
	defer removeTree(work)

	// Spool the input: archives are read more than once, and the caller's
	// reader (an HTTP body) must be drained before the long work starts.
	spool := filepath.Join(work, "input.tar")
	n, err := spoolTar(ctx, r, spool)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
	}
	kind, tag, err := classify(spool)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
	}
	fmt.Fprintf(progress, "image %s: received %d bytes, a %s archive\n", name, n, kind)

	unlock, err := s.lockName(ctx, name)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
	}
	defer unlock()

	root := filepath.Join(work, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
	}
	var st extractStats
	switch kind {
	case kindRootfs:
		f, err := os.Open(spool)
		if err != nil {
			return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
		}
		st, err = extractTar(ctx, f, root)
		f.Close()
		if err != nil {
			return sandbox.Image{}, fmt.Errorf("import %s: %w", name, err)
		}
	case kindDocker, kindOCI:
		var img v1.Image
		if kind == kindDocker {
			img, err = tarball.ImageFromPath(spool, nil)
		} else {
			img, err = ociImage(ctx, spool, filepath.Join(work, "oci"))
		}
		if err != nil {
			return sandbox.Image{}, fmt.Errorf("import %s: %w", name, invalidf("%s archive: %v", kind, err))
		}
		st, err = extractImage(ctx, img, root)
		if err != nil {
			return sandbox.Image{}, fmt.Errorf("import %s: %s archive: %w", name, kind, err)
		}
		if kind == kindOCI {
			_ = removeTree(filepath.Join(work, "oci"))
		}
	}
	_ = os.Remove(spool)
	fmt.Fprintf(progress, "image %s: extracted %d entries\n", name, st.Entries)
	if len(st.Skipped) > 0 {
		fmt.Fprintf(progress, "image %s: skipped %d device nodes/fifos/other entries (e.g. %s)\n", name, len(st.Skipped), st.Skipped[0])
	}

	source := "import:" + kind
	if tag != "" {
		source += ":" + tag
	}
	img, err := s.commit(ctx, name, source, root, progress)
	if err != nil {
		return sandbox.Image{}, fmt.Errorf("import: %w", err)
	}
	fmt.Fprintf(progress, "image %s: imported in %s\n", name, time.Since(start).Round(100*time.Millisecond))
	return img, nil
}

// spoolTar copies r to the file at dst, decompressing gzip. Input that is
// compressed in a way Import does not read, or too short to be a tar, is
// rejected with ErrInvalid.
func spoolTar(ctx context.Context, r io.Reader, dst string) (int64, error) {
	br := bufio.NewReaderSize(ctxReader{ctx, r}, 1<<16)
	magic, _ := br.Peek(6)
	var src io.Reader = br
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return 0, invalidf("not a tar archive: bad gzip data: %v", err)
		}
		defer zr.Close()
		src = zr
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return 0, invalidf("not a tar archive: zstd-compressed input is not supported (decompress it, or use gzip)")
	case bytes.HasPrefix(magic, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return 0, invalidf("not a tar archive: xz-compressed input is not supported (decompress it, or use gzip)")
	case bytes.HasPrefix(magic, []byte("BZh")):
		return 0, invalidf("not a tar archive: bzip2-compressed input is not supported (decompress it, or use gzip)")
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(f, src)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		var corrupt flate.CorruptInputError
		if errors.Is(err, gzip.ErrChecksum) || errors.Is(err, gzip.ErrHeader) || errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &corrupt) {
			return n, invalidf("not a tar archive: corrupt gzip data: %v", err)
		}
		return n, fmt.Errorf("receive archive: %w", err)
	}
	return n, nil
}

// classify reads the tar headers of the file at p and says which kind of
// archive it is. For docker archives it also returns the first repo tag.
func classify(p string) (kind, tag string, err error) {
	f, err := os.Open(p)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	top := map[string]bool{}
	entries := 0
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if entries == 0 {
				return "", "", invalidf("not a tar archive: %v", err)
			}
			return "", "", invalidf("corrupt tar archive after %d entries: %v", entries, err)
		}
		entries++
		n := strings.TrimPrefix(path.Clean("/"+hdr.Name), "/")
		if hdr.Typeflag == tar.TypeReg || hdr.Typeflag == tar.TypeRegA {
			top[n] = true
		}
	}
	if entries == 0 {
		return "", "", invalidf("not a tar archive: no entries")
	}
	switch {
	case top["manifest.json"]:
		if m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(p) }); err == nil && len(m) > 0 && len(m[0].RepoTags) > 0 {
			tag = m[0].RepoTags[0]
		}
		return kindDocker, tag, nil
	case top["oci-layout"] && top["index.json"]:
		return kindOCI, "", nil
	default:
		return kindRootfs, "", nil
	}
}

// ociImage unpacks the OCI layout archive at p into dir and returns its image:
// the only one, or the one for this machine's platform.
func ociImage(ctx context.Context, p, dir string) (v1.Image, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	_, err = extractTar(ctx, f, dir)
	f.Close()
	if err != nil {
		return nil, err
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, err
	}
	return pickImage(idx, 0)
}

// pickImage finds the image in idx: the only one, else the one matching
// linux/GOARCH, descending into nested indexes.
func pickImage(idx v1.ImageIndex, depth int) (v1.Image, error) {
	if depth > 4 {
		return nil, errors.New("image indexes nested too deeply")
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	want := v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
	var candidates []v1.Descriptor
	for _, d := range im.Manifests {
		if d.MediaType.IsImage() || d.MediaType.IsIndex() {
			candidates = append(candidates, d)
		}
	}
	if len(candidates) == 0 {
		return nil, errors.New("index.json lists no image")
	}
	pick := -1
	if len(candidates) == 1 {
		pick = 0
	} else {
		for i, d := range candidates {
			if d.Platform != nil && d.Platform.OS == want.OS && d.Platform.Architecture == want.Architecture {
				pick = i
				break
			}
		}
		if pick < 0 {
			return nil, fmt.Errorf("index.json lists %d images and none for %s/%s", len(candidates), want.OS, want.Architecture)
		}
	}
	d := candidates[pick]
	if d.MediaType.IsIndex() {
		sub, err := idx.ImageIndex(d.Digest)
		if err != nil {
			return nil, err
		}
		return pickImage(sub, depth+1)
	}
	return idx.Image(d.Digest)
}

// extractImage flattens img's layers (whiteouts applied) into dir.
func extractImage(ctx context.Context, img v1.Image, dir string) (extractStats, error) {
	if _, err := img.Layers(); err != nil {
		return extractStats{}, invalidf("read layers: %v", err)
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	return extractTar(ctx, rc, dir)
}
