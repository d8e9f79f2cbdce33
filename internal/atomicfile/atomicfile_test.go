package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteFileReplaces(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "id")
	for _, want := range []string{"first\n", "second, longer\n", ""} {
		if err := WriteFile(p, []byte(want), 0o640); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil || string(got) != want {
			t.Fatalf("read %q, %v; want %q", got, err, want)
		}
		fi, _ := os.Stat(p)
		if fi.Mode().Perm() != 0o640 {
			t.Fatalf("mode %v, want 0640", fi.Mode().Perm())
		}
	}
	assertOnly(t, dir, "id")
}

type failingReader struct{ n int }

func (r *failingReader) Read(b []byte) (int, error) {
	if r.n == 0 {
		return 0, errors.New("source broke")
	}
	n := copy(b, strings.Repeat("x", r.n))
	r.n -= n
	return n, nil
}

func TestWriteFromFailureLeavesOldContent(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "manifest")
	if err := WriteFile(p, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := WriteFrom(p, &failingReader{n: 10}, 0o600)
	if err == nil || !strings.Contains(err.Error(), "source broke") || !strings.Contains(err.Error(), p) {
		t.Fatalf("err = %v, want the reader's error naming %s", err, p)
	}
	got, _ := os.ReadFile(p)
	if string(got) != "old" {
		t.Fatalf("content %q after a failed write, want old", got)
	}
	assertOnly(t, dir, "manifest")
}

func TestWriteFileMissingDir(t *testing.T) {
	p := filepath.Join(t.TempDir(), "no", "such", "file")
	if err := WriteFile(p, []byte("x"), 0o600); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("err = %v, want not exist", err)
	}
}

func TestWriteFromStreams(t *testing.T) {
	p := filepath.Join(t.TempDir(), "big")
	const n = 3 << 20
	if err := WriteFrom(p, io.LimitReader(zeros{}, n), 0o600); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Size() != n {
		t.Fatalf("size %v, %v; want %d", fi.Size(), err, n)
	}
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) { clear(b); return len(b), nil }

func assertOnly(t *testing.T, dir string, names ...string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if strings.Join(got, ",") != strings.Join(names, ",") {
		t.Fatalf("dir holds %v, want %v (a temporary file was left)", got, names)
	}
}
