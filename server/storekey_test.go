package server

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/torpor/torpor/snapshot/chunked"
)

// openStore with a snapshot key: refused with the plain store and for a key
// file others may read; a chunked store seals with the key.
func TestOpenStoreSnapshotKey(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	kf := filepath.Join(dir, "snapshot.key")
	if err := os.WriteFile(kf, []byte(strings.Repeat("ab", chunked.KeyBytes)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := openStore(ctx, dir, StoreConfig{Kind: "plain", KeyFile: kf}, nil, false); err == nil || !strings.Contains(err.Error(), "--snapshot-key needs --store chunked or s3") {
		t.Errorf("plain store with a key: %v", err)
	}
	s, closeFn, err := openStore(ctx, dir, StoreConfig{Kind: "chunked", KeyFile: kf}, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	k, _ := chunked.LoadKey(kf)
	if got := s.(*chunked.Store).KeyID(); got != k.ID() {
		t.Errorf("store key id %q, want %q", got, k.ID())
	}
	closeFn()
	os.Chmod(kf, 0o640)
	if _, _, err := openStore(ctx, dir, StoreConfig{Kind: "chunked", KeyFile: kf}, nil, false); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("key file readable by its group: %v", err)
	}
}
