package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestServeStoreFlagsBeforeTheDisk: serve --store plain with a snapshot key
// is a wrong command line (exit 2) refused before the data directory is
// made; a key on a data directory recorded as plain (no --store) is a
// start-up error (exit 1) that leaves the directory as it was.
func TestServeStoreFlagsBeforeTheDisk(t *testing.T) {
	tmp := t.TempDir()
	kf := filepath.Join(tmp, "snapshot.key")
	if err := os.WriteFile(kf, []byte(strings.Repeat("ab", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(tmp, "data")
	for _, flag := range []string{"--snapshot-key", "--snapshot-old-key"} {
		r := runTorpor("serve", "--store", "plain", flag, kf, "--data-dir", dir, "--auth", "none", "--listen", "127.0.0.1:0")
		if r.code != 2 || !strings.Contains(r.stderr, "need --store chunked or s3") {
			t.Errorf("serve --store plain %s: %+v", flag, r)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("the refused serve made its data directory %s (%v)", dir, err)
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "store"), []byte("plain\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := runTorpor("serve", "--snapshot-key", kf, "--data-dir", dir, "--auth", "none", "--listen", "127.0.0.1:0")
	if r.code != 1 || !strings.Contains(r.stderr, "--snapshot-key needs --store chunked or s3") {
		t.Errorf("serve --snapshot-key on a plain data directory: %+v", r)
	}
	if ents, err := os.ReadDir(dir); err != nil || len(ents) != 1 {
		t.Errorf("the refused serve left %d entries in %s (%v), want only its store record", len(ents), dir, err)
	}
}

// TestServeNodeAndAdvertiseFlags: an explicitly empty --node, and an
// --advertise with a path, query, fragment or user info, are wrong command
// lines (exit 2, naming the flag) refused before the data directory is
// made (a trial's --node ” fell back to the host name, its
// --advertise http://127.0.0.1:47120/some/path?x=1 was accepted).
func TestServeNodeAndAdvertiseFlags(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--node", ""}, `--node: node name ""`},
		{[]string{"--node="}, `--node: node name ""`},
		{[]string{"--advertise", ""}, `--advertise "": want http://host:port`},
		{[]string{"--advertise", "http://127.0.0.1:47120/some/path?x=1"}, `--advertise "http://127.0.0.1:47120/some/path?x=1": want http://host:port or https://host:port (a path)`},
		{[]string{"--advertise", "http://127.0.0.1:47120?x=1"}, "(a query)"},
		{[]string{"--advertise", "http://127.0.0.1:47120/#f"}, "(a fragment)"},
		{[]string{"--advertise", "https://me:pw@127.0.0.1:47120"}, "(user info)"},
		{[]string{"--advertise", "127.0.0.1:47120"}, "want http://host:port"},
	} {
		r := runTorpor(append([]string{"serve", "--data-dir", dir, "--auth", "none", "--listen", "127.0.0.1:0"}, tc.args...)...)
		if r.code != 2 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("serve %q: %+v, want exit 2 saying %s", tc.args, r, tc.want)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("the refused serve %q made its data directory %s (%v)", tc.args, dir, err)
		}
	}
}
