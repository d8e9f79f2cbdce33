// Package python embeds torpor's Python SDK (the `torpor` package in this
// directory, installable with `pip install ./sdk/python`) so the server can put
// it into every sandbox: the manager writes it next to the guest agent, under
// /.torpor/python, and the default image's torpor.pth puts that on sys.path.
package python

import (
	"crypto/sha256"
	"embed"
	"io/fs"
	"sort"
)

//go:embed pyproject.toml torpor/*.py
var files embed.FS

// Files returns the SDK's files: pyproject.toml and torpor/*.py.
func Files() fs.FS { return files }

// Package returns the Python package's files (path relative to the sys.path
// entry, e.g. "torpor/resume.py") with their contents, sorted by path.
func Package() ([]string, map[string][]byte, error) {
	out := map[string][]byte{}
	err := fs.WalkDir(files, "torpor", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(files, p)
		if err != nil {
			return err
		}
		out[p] = b
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	names := make([]string, 0, len(out))
	for n := range out {
		names = append(names, n)
	}
	sort.Strings(names)
	return names, out, nil
}

// Digest is a sha256 over the package's paths and contents.
func Digest() [32]byte {
	names, m, err := Package()
	if err != nil {
		panic(err) // embedded files are always readable
	}
	h := sha256.New()
	for _, n := range names {
		h.Write([]byte(n))
		h.Write([]byte{0})
		h.Write(m[n])
		h.Write([]byte{0})
	}
	var d [32]byte
	copy(d[:], h.Sum(nil))
	return d
}
