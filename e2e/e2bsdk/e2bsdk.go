// Package e2bsdk holds E2B's published JavaScript SDK at pinned versions, for the tests
// of torpor's E2B-compatible API (docs/e2b.md), and finds it for Go tests.
//
// package.json depends on `e2b` 2.51.0 and, under the npm alias `e2b-2.45`, on 2.45.0
// (the last version that creates with POST /sandboxes and connects with POST
// /sandboxes/{id}/connect); package-lock.json pins every package. `make setup` (its
// node-packages step) runs `npm ci` here; node_modules is not committed.
package e2bsdk

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// Packages maps each npm package name the SDK is installed under to the version
// package.json pins for it.
var Packages = map[string]string{
	"e2b":      "2.51.0",
	"e2b-2.45": "2.45.0",
}

// Dir is the absolute path of this directory (where package.json and node_modules
// are), found from this source file's location.
func Dir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		panic("e2bsdk: no caller information")
	}
	return filepath.Dir(file)
}

// Module is the absolute path of the ES module of the SDK installed as package (a key
// of Packages): node_modules/<package>/dist/index.mjs.
func Module(pkg string) string {
	return filepath.Join(Dir(), "node_modules", pkg, "dist", "index.mjs")
}

// Installed fails t when a pinned SDK is not installed in Dir (run `make
// node-packages`): a missing install is a set-up error, not a reason to skip.
func Installed(t testing.TB) {
	t.Helper()
	for name := range Packages {
		if _, err := os.Stat(Module(name)); err != nil {
			t.Fatalf("E2B SDK %s is not installed in %s (run `make node-packages`): %v", name, Dir(), err)
		}
	}
}

// Node returns the path of the node binary for a test that runs the SDK. It skips t
// when node is not installed and fails it when the SDK is not (Installed).
func Node(t testing.TB) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed: the E2B SDK tests need Node.js (Debian package nodejs)")
	}
	Installed(t)
	return node
}
