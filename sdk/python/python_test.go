package python

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestUnit runs the Python SDK's unit tests (a fake agent socket) with the
// host's python3.
func TestUnit(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	cmd := exec.Command(py, "-m", "unittest", "discover", "-s", "tests", "-v")
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python unit tests: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

func TestEmbedded(t *testing.T) {
	names, m, err := Package()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(names, ",") != "torpor/__init__.py,torpor/resume.py" {
		t.Errorf("embedded files %v", names)
	}
	disk, _ := os.ReadFile(filepath.Join("torpor", "resume.py"))
	if string(m["torpor/resume.py"]) != string(disk) {
		t.Error("embedded resume.py differs from the file")
	}
}

// TestPipInstall installs the package with pip into a temporary directory and
// imports it from there.
func TestPipInstall(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	// The interpreter itself, not a version manager's shim in front of it:
	// pyenv's shim runs a rehash after pip install, which waits up to 60 s
	// and fails on a lock another (killed) shell left behind.
	if out, err := exec.Command(py, "-c", "import sys; print(sys.executable)").Output(); err == nil && len(bytes.TrimSpace(out)) > 0 {
		py = string(bytes.TrimSpace(out))
	}
	if exec.Command(py, "-m", "pip", "--version").Run() != nil {
		t.Skip("no pip")
	}
	target := t.TempDir()
	src := t.TempDir() // pip writes build/ and *.egg-info next to the sources
	if err := os.CopyFS(src, os.DirFS(".")); err != nil {
		t.Fatal(err)
	}
	args := []string{"-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", target, src}
	if out, err := exec.Command(py, args...).CombinedOutput(); err != nil {
		t.Fatalf("pip install: %v\n%s", err, out)
	}
	cmd := exec.Command(py, "-c", "import torpor.resume as r, torpor; print(torpor.__file__, r.generation())")
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "PYTHONPATH="+target, "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), target) {
		t.Fatalf("import the installed package: %v\n%s", err, out)
	}
}
