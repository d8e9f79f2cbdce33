package agent

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestUserCache: lookups are answered from the cache while the watched files
// stay as they were, and read again once one of them changes (its size, its
// modification time, or a new file in its place).
func TestUserCache(t *testing.T) {
	f := filepath.Join(t.TempDir(), "passwd")
	if err := os.WriteFile(f, []byte("a\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := &userCache{files: []string{f}}
	first, err := c.user("root")
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := c.user("root"); again != first {
		t.Fatal("a second lookup with the file unchanged was read again")
	}
	for _, change := range []func() error{
		func() error { return os.WriteFile(f, []byte("ab\n"), 0o644) },                // size
		func() error { return os.Chtimes(f, time.Now(), time.Now().Add(-time.Hour)) }, // mtime
		func() error { os.Remove(f); return os.WriteFile(f, []byte("ab\n"), 0o644) },  // replaced
	} {
		before, _ := c.user("root")
		if err := change(); err != nil {
			t.Fatal(err)
		}
		if after, _ := c.user("root"); after == before {
			t.Fatal("a lookup after the file changed was answered from the cache")
		}
	}
	os.Remove(f)
	u1, _ := c.user("root")
	if u2, _ := c.user("root"); u1 == u2 {
		t.Fatal("with the file gone, a lookup was cached")
	}
	o1, g1 := c.names(0, 0)
	if o2, g2 := readNames(0, 0); o1 != o2 || g1 != g2 {
		t.Fatalf("names(0, 0) = %s %s, want %s %s", o1, g1, o2, g2)
	}
}

// TestDirWatch: a watch says changed once after each change in its
// directory (a new file, a write, a rename into it) and not otherwise, and
// always once its directory is gone; the user cache asked right after a
// change made through a watched directory reads the file again.
func TestDirWatch(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "passwd")
	w := watchDirs([]string{f})
	t.Cleanup(func() {
		if w.fd >= 0 {
			w.stop()
		}
	})
	if w.fd < 0 {
		t.Fatal("no inotify watch of a temporary directory")
	}
	if w.changed() {
		t.Fatal("changed before any change")
	}
	// In this order: a map's would be random, and "write" needs the file.
	for _, c := range []struct {
		name   string
		change func() error
	}{
		{"create", func() error { return os.WriteFile(f, []byte("a\n"), 0o644) }},
		{"write", func() error {
			fh, err := os.OpenFile(f, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				return err
			}
			defer fh.Close()
			_, err = fh.Write([]byte("b\n"))
			return err
		}},
		{"rename", func() error {
			tmp := filepath.Join(dir, "passwd+")
			if err := os.WriteFile(tmp, []byte("c\n"), 0o644); err != nil {
				return err
			}
			return os.Rename(tmp, f)
		}},
	} {
		name := c.name
		if err := c.change(); err != nil {
			t.Fatal(err)
		}
		if !w.changed() {
			t.Fatalf("%s: not changed", name)
		}
		if w.changed() {
			t.Fatalf("%s: changed twice", name)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if !w.changed() || !w.changed() {
		t.Fatal("not changed, and for good, with the directory gone")
	}
}
