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
