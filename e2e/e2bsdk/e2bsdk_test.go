package e2bsdk

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestInstalledVersions runs version.mjs, which imports every pinned copy of the SDK
// and prints the version each reports in its User-Agent: they must be the pinned ones.
func TestInstalledVersions(t *testing.T) {
	node := Node(t)
	cmd := exec.Command(node, filepath.Join(Dir(), "version.mjs"))
	cmd.Dir = Dir()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node version.mjs: %v\n%s", err, stderrOf(err))
	}
	var got map[string]string
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("version.mjs printed %q: %v", out, err)
	}
	if len(got) != len(Packages) {
		t.Errorf("version.mjs reports %v, want one entry per package in %v", got, Packages)
	}
	for name, want := range Packages {
		if got[name] != want {
			t.Errorf("%s reports version %q, package.json pins %q", name, got[name], want)
		}
	}
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
