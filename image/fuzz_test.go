package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// checkExtracted checks what an extraction left in base (which held only an
// empty root/): nothing beside root/, and no more bytes in its files (each
// inode counted once) than limit.
func checkExtracted(t *testing.T, base string, limit int64) {
	t.Helper()
	ents, err := os.ReadDir(base)
	if err != nil || len(ents) != 1 || ents[0].Name() != "root" {
		t.Fatalf("written beside the root: %v (%v)", ents, err)
	}
	var total int64
	seen := map[uint64]bool{}
	filepath.WalkDir(filepath.Join(base, "root"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && !seen[st.Ino] {
				seen[st.Ino] = true
				total += fi.Size()
			}
		}
		return nil
	})
	if total > limit {
		t.Fatalf("extracted %d bytes of files, more than the %d the archive can hold", total, limit)
	}
}

// checkExtractError checks that a refused archive says why: ErrInvalid (not a
// tar, an entry that escapes the root, …) or a named entry.
func checkExtractError(t *testing.T, err error) {
	t.Helper()
	if !errors.Is(err, ErrInvalid) && !strings.Contains(err.Error(), "entry ") {
		t.Fatalf("refused without ErrInvalid or the entry named: %v", err)
	}
}

// FuzzExtractTar unpacks any bytes as a root filesystem tarball (an imported
// image, or a layer). Whatever the archive says (.. names, absolute and
// escaping symlinks, hard links, devices), nothing is written outside the
// root, the files written hold no more bytes than the archive, and a refusal
// is ErrInvalid or names the entry.
func FuzzExtractTar(f *testing.F) {
	t := f
	f.Add(makeTar(t, []tarEntry{{name: "etc/", typ: tar.TypeDir}, {name: "etc/hostname", body: "box\n"}, {name: "bin/sh", body: "#!", mode: 0o4755},
		{name: "lib", typ: tar.TypeSymlink, link: "usr/lib"}, {name: "usr/lib/x.so", body: "elf"}, {name: "bin/sh2", typ: tar.TypeLink, link: "bin/sh"},
		{name: "dev/null", typ: tar.TypeChar}}))
	f.Add(makeTar(t, []tarEntry{{name: "../escape", body: "x"}}))
	f.Add(makeTar(t, []tarEntry{{name: "esc", typ: tar.TypeSymlink, link: "/tmp"}, {name: "esc/file", body: "x"}}))
	f.Add(makeTar(t, []tarEntry{{name: "up", typ: tar.TypeSymlink, link: "../.."}, {name: "up/x", body: "x"}}))
	f.Add(makeTar(t, []tarEntry{{name: "a", body: "file"}, {name: "a/b", body: "below a file"}}))
	f.Add(makeTar(t, []tarEntry{{name: "h", typ: tar.TypeLink, link: "../../etc/passwd"}}))
	f.Add([]byte("not a tar archive at all"))
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		root := filepath.Join(base, "root")
		if err := os.Mkdir(root, 0o755); err != nil {
			t.Fatal(err)
		}
		if _, err := extractTar(context.Background(), bytes.NewReader(data), root); err != nil {
			checkExtractError(t, err)
		}
		checkExtracted(t, base, int64(len(data)))
	})
}

// FuzzImportArchive runs Import's reading of an archive on any bytes: the
// spooling (gzip or plain), the kind (docker save, OCI layout, root
// filesystem) and the extraction of its image, as Import does before it
// stores the tree. The same properties as FuzzExtractTar hold, with the
// spooled (decompressed) size as the bound.
func FuzzImportArchive(f *testing.F) {
	t := f
	ref, _ := name.ParseReference("torpor.test/demo:1")
	var docker bytes.Buffer
	if err := tarball.Write(ref, testImage(t), &docker); err != nil {
		f.Fatal(err)
	}
	f.Add(docker.Bytes())
	f.Add(makeTar(t, []tarEntry{{name: "oci-layout", body: `{"imageLayoutVersion":"1.0.0"}`}, {name: "index.json", body: `{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":2}]}`}}))
	f.Add(makeTar(t, []tarEntry{{name: "manifest.json", body: `[{"Config":"c.json","RepoTags":["x:1"],"Layers":["../../l.tar"]}]`}}))
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(makeTar(t, []tarEntry{{name: "etc/os-release", body: "ID=test\n"}}))
	zw.Close()
	f.Add(gz.Bytes())
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		ctx := context.Background()
		work := t.TempDir()
		spool := filepath.Join(work, "input.tar")
		base := filepath.Join(work, "out")
		root := filepath.Join(base, "root")
		if err := os.MkdirAll(root, 0o755); err != nil {
			t.Fatal(err)
		}
		n, err := spoolTar(ctx, bytes.NewReader(data), spool)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("spool refused without ErrInvalid: %v", err)
			}
			return
		}
		kind, _, err := classify(spool)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("classify refused without ErrInvalid: %v", err)
			}
			return
		}
		limit := n
		switch kind {
		case kindRootfs:
			sf, err := os.Open(spool)
			if err != nil {
				t.Fatal(err)
			}
			_, err = extractTar(ctx, sf, root)
			sf.Close()
			if err != nil {
				checkExtractError(t, err)
			}
		case kindDocker:
			limit = n * 1100 // layers may be gzip-compressed (deflate expands 1032:1 at most)
			img, err := tarball.ImageFromPath(spool, nil)
			if err == nil {
				_, err = extractImage(ctx, img, root)
			}
			_ = err // go-containerregistry's errors name the archive's part
		case kindOCI:
			limit = n * 1100
			img, err := ociImage(ctx, spool, filepath.Join(work, "oci"))
			if err == nil {
				_, err = extractImage(ctx, img, root)
			}
			_ = err
		}
		checkExtracted(t, base, limit)
	})
}

// sparseTar is a tar holding one PAX (GNU 1.0) sparse file of size bytes
// whose only data is 512 bytes at offset 0: 2 KiB of archive whatever size is.
// archive/tar writes no sparse files (nor a PAX header by hand): the PAX
// header is written as a regular file whose type flag is then set to 'x'.
func sparseTar(t testing.TB, size int64) []byte {
	t.Helper()
	var pax []byte
	for _, kv := range [][2]string{{"GNU.sparse.major", "1"}, {"GNU.sparse.minor", "0"}, {"GNU.sparse.name", "big"},
		{"GNU.sparse.realsize", strconv.FormatInt(size, 10)}} {
		rec := " " + kv[0] + "=" + kv[1] + "\n"
		n := len(rec) + 1
		for len(strconv.Itoa(n))+len(rec) != n {
			n++
		}
		pax = append(pax, strconv.Itoa(n)+rec...)
	}
	data := append([]byte("1\n0\n512\n"), make([]byte, 504)...) // the map: one 512-byte region at 0
	data = append(data, bytes.Repeat([]byte{'x'}, 512)...)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range []struct {
		name string
		body []byte
	}{{"PaxHeaders/big", pax}, {"GNUSparseFile.0/big", data}} {
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(e.body)), Format: tar.FormatUSTAR}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	b[156] = tar.TypeXHeader
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b[:512] {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// A sparse file's holes read as zeros, so a 10 KiB archive claiming a 1 TiB
// file filled the disk on import (found by FuzzExtractTar). Import refuses
// sparse files, as the OCI image spec asks of layers, naming the entry.
func TestImportRefusesSparseFiles(t *testing.T) {
	s := newStore(t)
	_, err := s.Import(context.Background(), "sparse", bytes.NewReader(sparseTar(t, 1<<40)), nil)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `entry "big": a sparse file (1099511627776 bytes)`) {
		t.Fatalf("Import: %v, want ErrInvalid naming the sparse entry", err)
	}
	if _, _, err := s.Get(context.Background(), "sparse"); err == nil {
		t.Fatal("the refused import left an image")
	}
}

// A gzip stream whose deflate data is corrupt failed the import with an
// internal error ("receive archive: flate: corrupt input"), a 500, where every
// other bad upload is ErrInvalid, a 400 (found by FuzzImportArchive).
func TestImportCorruptDeflateIsInvalid(t *testing.T) {
	s := newStore(t)
	// A gzip header, then a deflate block of the reserved type 3.
	bad := []byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0x07, 0, 0, 0, 0}
	_, err := s.Import(context.Background(), "bad", bytes.NewReader(bad), nil)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "corrupt gzip data") {
		t.Fatalf("Import: %v, want ErrInvalid saying the gzip data is corrupt", err)
	}
}
