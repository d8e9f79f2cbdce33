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
	kf := writeKeyFile(t, filepath.Join(dir, "snapshot.key"), 0o600)
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

// writeKeyFile writes a snapshot key (hex) to path with mode and returns path.
func writeKeyFile(t *testing.T, path string, mode os.FileMode) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Repeat("ab", chunked.KeyBytes)+"\n"), mode); err != nil {
		t.Fatal(err)
	}
	return path
}

// New refuses a store configuration it cannot serve before it makes or
// touches the data directory: a new directory is not created, an existing
// one gets no database, images or store (issue 18, D10).
func TestNewRefusesStoreFlagsBeforeTheDisk(t *testing.T) {
	ctx := context.Background()
	tmp := t.TempDir()
	kf := writeKeyFile(t, filepath.Join(tmp, "snapshot.key"), 0o600)
	loose := writeKeyFile(t, filepath.Join(tmp, "loose.key"), 0o644)
	recordedPlain := filepath.Join(tmp, "recorded-plain")
	if err := os.MkdirAll(recordedPlain, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(recordedPlain, storeKindFile), []byte("plain\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, dir string
		store     StoreConfig
		want      string
	}{
		{"plain with a key", filepath.Join(tmp, "new-1"), StoreConfig{Kind: "plain", KeyFile: kf}, "--snapshot-key needs --store chunked or s3"},
		{"plain with an old key", filepath.Join(tmp, "new-2"), StoreConfig{Kind: "plain", OldKeyFiles: []string{kf}}, "--snapshot-key needs --store chunked or s3"},
		{"plain with async upload", filepath.Join(tmp, "new-3"), StoreConfig{Kind: "plain", AsyncUpload: true}, "--async-upload needs"},
		{"a key file others may read", filepath.Join(tmp, "new-4"), StoreConfig{Kind: "chunked", KeyFile: loose}, "chmod 600"},
		{"a missing key file", filepath.Join(tmp, "new-5"), StoreConfig{KeyFile: filepath.Join(tmp, "none.key")}, "none.key"},
		{"a key on a directory recorded plain", recordedPlain, StoreConfig{KeyFile: kf}, "--snapshot-key needs --store chunked or s3"},
	} {
		_, err := New(ctx, Config{DataDir: tc.dir, Store: tc.store})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
		ents, statErr := os.ReadDir(tc.dir)
		switch {
		case tc.dir == recordedPlain && (statErr != nil || len(ents) != 1):
			t.Errorf("%s: the data directory holds %d entries (%v), want only its store record", tc.name, len(ents), statErr)
		case tc.dir != recordedPlain && !os.IsNotExist(statErr):
			t.Errorf("%s: data directory %s was made (%v)", tc.name, tc.dir, statErr)
		}
	}
}
