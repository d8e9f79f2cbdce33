package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/snapshot/chunked"
)

// TestRemoteImages: a store with a remote copies the images it stores
// there; another store on the same records (another node) that lacks the
// file fetches it, checked against its digest, by name or by digest; a
// damaged copy is refused.
func TestRemoteImages(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (ownership)")
	}
	ctx := context.Background()
	dir := t.TempDir()
	db, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	remote, err := chunked.NewFS(filepath.Join(dir, "bucket"))
	if err != nil {
		t.Fatal(err)
	}
	open := func(name string) *Store {
		s, err := Open(filepath.Join(dir, name), db)
		if err != nil {
			t.Fatal(err)
		}
		s.SetRemote(remote, nil)
		return s
	}
	a, b := open("a"), open("b")
	archive := makeTar(t, []tarEntry{{name: "./", typ: tar.TypeDir}, {name: "./etc/", typ: tar.TypeDir}, {name: "./etc/hostname", body: "shared\n"}})
	img, err := a.Import(ctx, "shared", bytes.NewReader(archive), nil)
	if err != nil {
		t.Fatal(err)
	}
	a.WaitRemote()
	if ok, err := remote.Exists(ctx, remoteKey(img.Digest)); !ok || err != nil {
		t.Fatalf("the remote has no copy of %s: %v", img.Digest, err)
	}
	got, p, err := b.Get(ctx, "shared")
	if err != nil || got.Digest != img.Digest {
		t.Fatalf("get on the other store: %+v %v", got, err)
	}
	if d, _, err := hashAndSync(p); err != nil || d != img.Digest {
		t.Errorf("fetched file hashes to %s (%v), want %s", d, err, img.Digest)
	}

	// A third store fetches by digest; a damaged copy is refused.
	c := open("c")
	if err := remote.Put(ctx, remoteKey(img.Digest), strings.NewReader("not the image"), 13); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Get(ctx, img.Digest); err == nil || !strings.Contains(err.Error(), "not used") {
		t.Errorf("get of a damaged copy: %v", err)
	}
	if _, err := os.Stat(c.Path(img.Digest)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a damaged copy was kept: %v", err)
	}
	// Nothing anywhere: not found.
	missing := "sha256:" + strings.Repeat("0", 64)
	if _, _, err := c.Get(ctx, missing); !errors.Is(err, ErrNotFound) {
		t.Errorf("get of an image nowhere: %v", err)
	}
}
