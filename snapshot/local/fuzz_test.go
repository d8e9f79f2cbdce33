package local

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/torpor/torpor/snapshot"
)

// FuzzManifest replaces a committed snapshot's manifest.json with any bytes
// and opens the snapshot. A manifest that is refused is a
// *snapshot.CorruptError of the snapshot; one that is accepted names only
// files inside the snapshot's directory, encodes back to an equal manifest,
// and Open checks the files it names (or refuses them, naming one).
func FuzzManifest(f *testing.F) {
	ctx := context.Background()
	s, err := New(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	const id = "fuzz-snap"
	dir, err := s.Stage(ctx, id)
	if err != nil {
		f.Fatal(err)
	}
	for name, body := range map[string]string{"pages.img": strings.Repeat("page", 5000), "meta.json": `{"engine":"test"}`} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			f.Fatal(err)
		}
	}
	if _, err := s.Commit(ctx, id, snapshot.Manifest{ID: id, Engine: "test"}); err != nil {
		f.Fatal(err)
	}
	mpath := filepath.Join(s.final(id), "manifest.json")
	valid, err := os.ReadFile(mpath)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(valid)
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(mpath, data, 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := s.Manifest(ctx, id)
		var ce *snapshot.CorruptError
		if err != nil {
			if !errors.As(err, &ce) || ce.Snapshot != id {
				t.Fatalf("refused manifest: %v (want a CorruptError of %s)", err, id)
			}
			return
		}
		for _, fl := range m.Files {
			if fl.Name == "" || fl.Name == "." || fl.Name == ".." || strings.ContainsAny(fl.Name, "/\x00") {
				t.Fatalf("accepted a manifest naming file %q", fl.Name)
			}
		}
		enc, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(mpath, enc, 0o600); err != nil {
			t.Fatal(err)
		}
		m2, err := s.Manifest(ctx, id)
		if err != nil {
			t.Fatalf("re-encoded manifest refused: %v\n%s", err, enc)
		}
		if enc2, _ := json.Marshal(m2); !bytes.Equal(enc, enc2) {
			t.Fatalf("round trip changed the manifest:\n%s\n%s", enc, enc2)
		}
		if _, _, err := s.Open(ctx, id); err != nil && (!errors.As(err, &ce) || bytes.Equal(data, valid)) {
			t.Fatalf("Open: %v (want nil or a CorruptError, and the committed manifest to open)", err)
		}
	})
}

// A manifest naming "../other/pages.img" made Open and Verify hash a file
// outside the snapshot (and say its size in the error); "" or "." the
// directory itself (found by FuzzManifest's seeds). Such names are refused.
func TestManifestFileNamesStayInside(t *testing.T) {
	ctx := context.Background()
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"../other/pages.img", "a/b", "", ".", ".."} {
		t.Run(name, func(t *testing.T) {
			id := "snap-" + strings.NewReplacer(".", "d", "/", "s").Replace(name)
			if err := os.MkdirAll(s.final(id), 0o700); err != nil {
				t.Fatal(err)
			}
			b, _ := json.Marshal(snapshot.Manifest{ID: id, Files: []snapshot.File{{Name: name, Bytes: 1}}})
			if err := os.WriteFile(filepath.Join(s.final(id), "manifest.json"), b, 0o600); err != nil {
				t.Fatal(err)
			}
			_, _, err := s.Open(ctx, id)
			var ce *snapshot.CorruptError
			if !errors.As(err, &ce) || ce.File != "manifest.json" || !strings.Contains(ce.Reason, "is not a name in the snapshot's directory") {
				t.Fatalf("Open: %v, want the name refused", err)
			}
		})
	}
}
