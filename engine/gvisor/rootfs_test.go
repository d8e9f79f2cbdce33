package gvisor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRootfsLinks: an image named by its digest boots from the same path on
// every host (a symlink under rootfsLinkDir, re-made when it dangles); other
// files boot from their own path; a restore uses the path its checkpoint
// recorded, or the image's own path for snapshots without a record.
func TestRootfsLinks(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (writes under /run)")
	}
	const digest = "00000000000000000000000000000000000000000000000000000000000000ff"
	mk := func(dir string) string {
		p := filepath.Join(dir, "images", "sha256", digest+".erofs")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("image"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	link := filepath.Join(rootfsLinkDir, digest+".erofs")
	t.Cleanup(func() { os.Remove(link) })

	a := mk(t.TempDir())
	got, err := stableRootfs(a)
	if err != nil || got != link {
		t.Fatalf("stableRootfs(%s) = %s, %v; want %s", a, got, err, link)
	}
	if b, err := os.ReadFile(got); err != nil || string(b) != "image" {
		t.Fatalf("reading through the link: %q %v", b, err)
	}
	other := filepath.Join(t.TempDir(), "rootfs.erofs")
	if got, err := stableRootfs(other); err != nil || got != other {
		t.Fatalf("a file not named by digest: %s %v", got, err)
	}

	// The data directory moves: the old target is gone, the link follows.
	bDir := t.TempDir()
	b := mk(bDir)
	os.RemoveAll(filepath.Dir(filepath.Dir(filepath.Dir(a))))
	ckpt := t.TempDir()
	if got, err := restoreRootfs(ckpt, b); err != nil || got != b {
		t.Fatalf("restore without a record: %s %v; want the image's own path", got, err)
	}
	if err := os.WriteFile(filepath.Join(ckpt, rootfsRecord), []byte(link+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := restoreRootfs(ckpt, b); err != nil || got != link {
		t.Fatalf("restore with a record: %s %v", got, err)
	}
	if target, err := os.Readlink(link); err != nil || target != b {
		t.Fatalf("link after the move: %s %v; want %s", target, err, b)
	}
	wrong := filepath.Join(t.TempDir(), "images", "sha256", strings.Repeat("a", 64)+".erofs")
	if _, err := restoreRootfs(ckpt, wrong); err == nil {
		t.Fatal("restore with another image than the checkpoint's: no error")
	}
}
