package local

import (
	"context"
	"crypto/rand"
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
// with 16 MiB blocks, and a byte flipped in its second block is found and named.
func TestBlockVerification(t *testing.T) {
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
	m, err := s.Commit(ctx, "snap-big", snapshot.Manifest{ID: "snap-big"})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != 1 || len(m.Files[0].Blocks) != 3 || m.Files[0].BlockBytes != blockBytes {
		t.Fatalf("blocks not recorded: %+v", m.Files)
	}
	if _, _, err := s.Open(ctx, "snap-big"); err != nil {
		t.Fatalf("open of intact snapshot: %v", err)
	}
	p := filepath.Join(s.final("snap-big"), "pages.img")
	big[20<<20] ^= 0x80
	if err := os.WriteFile(p, big, 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err = s.Open(ctx, "snap-big")
	var ce *snapshot.CorruptError
	if !errors.As(err, &ce) || ce.File != "pages.img" || !strings.Contains(ce.Reason, "block 1") {
		t.Fatalf("open of corrupt snapshot: %v", err)
	}
}
