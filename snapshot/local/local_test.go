package local

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) snapshot.Store {
		s, err := New(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// TestBlockVerification checks the parallel block path: a 40 MiB file is recorded
// with three 16 MiB XXH3 block sums, and a byte flipped in its second block is
// found and named by Open (block sums) and by Verify (whole-file sha256).
func TestBlockVerification(t *testing.T) {
	s, big, p := commitBig(t)
	m, err := s.Manifest(context.Background(), "snap-big")
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != 1 || len(m.Files[0].BlockXXH3) != 3 || m.Files[0].BlockBytes != snapshot.BlockSumBytes || len(m.Files[0].Blocks) != 0 {
		t.Fatalf("block sums not recorded: %+v", m.Files)
	}
	flipAndCheck(t, s, big, p, "xxh3 mismatch in block 1")
	if _, err := s.Verify(context.Background(), "snap-big"); err == nil || !strings.Contains(err.Error(), "sha256 mismatch") {
		t.Fatalf("verify of corrupt snapshot: %v", err)
	}
}

// TestLegacyBlockVerification: a manifest written before block_xxh3 (sha256
// block hashes only) is still verified by Open.
func TestLegacyBlockVerification(t *testing.T) {
	s, big, p := commitBig(t)
	mp := filepath.Join(s.final("snap-big"), "manifest.json")
	var m snapshot.Manifest
	b, err := os.ReadFile(mp)
	if err == nil {
		err = json.Unmarshal(b, &m)
	}
	if err != nil {
		t.Fatal(err)
	}
	f := &m.Files[0]
	f.BlockXXH3, f.Blocks = nil, nil
	for off := int64(0); off < f.Bytes; off += f.BlockBytes {
		h := sha256.Sum256(big[off:min(off+f.BlockBytes, f.Bytes)])
		f.Blocks = append(f.Blocks, hex.EncodeToString(h[:]))
	}
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	flipAndCheck(t, s, big, p, "sha256 mismatch in block 1")
}

// commitBig commits snapshot snap-big holding a random 40 MiB pages.img and
// returns the store, the file's bytes and its committed path.
func commitBig(t *testing.T) (*Store, []byte, string) {
	ctx := context.Background()
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir, err := s.Stage(ctx, "snap-big")
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 40<<20)
	rand.Read(big)
	if err := os.WriteFile(filepath.Join(dir, "pages.img"), big, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Commit(ctx, "snap-big", snapshot.Manifest{ID: "snap-big"}); err != nil {
		t.Fatal(err)
	}
	return s, big, filepath.Join(s.final("snap-big"), "pages.img")
}

// flipAndCheck opens the intact snapshot, flips a bit at 20 MiB (block 1) and
// wants Open to fail naming pages.img with reason.
func flipAndCheck(t *testing.T, s *Store, big []byte, p, reason string) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := s.Open(ctx, "snap-big"); err != nil {
		t.Fatalf("open of intact snapshot: %v", err)
	}
	if _, err := s.Verify(ctx, "snap-big"); err != nil {
		t.Fatalf("verify of intact snapshot: %v", err)
	}
	big[20<<20] ^= 0x80
	if err := os.WriteFile(p, big, 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := s.Open(ctx, "snap-big")
	var ce *snapshot.CorruptError
	if !errors.As(err, &ce) || ce.File != "pages.img" || !strings.Contains(ce.Reason, reason) {
		t.Fatalf("open of corrupt snapshot: %v, want a CorruptError with %q", err, reason)
	}
}
