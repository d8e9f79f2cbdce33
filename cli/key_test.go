package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/metadata/sqlite"
)

// runTorpor runs torpor with args and no server.
func runTorpor(args ...string) result {
	var out, errb bytes.Buffer
	code := Run(context.Background(), args, strings.NewReader(""), &out, &errb)
	return result{code, out.String(), errb.String()}
}

// TestKeyCommands: create prints the key once (stdout: the key alone; stderr:
// its id), ls and ls --json show id, name, prefix, times and never the key,
// the key verifies against the database and its use shows in ls, rm removes
// it; errors for a missing database, an unknown id and a bad name.
func TestKeyCommands(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data") // made by the first create
	if r := runTorpor("key", "ls", "--data-dir", dir); r.code != 1 || !strings.Contains(r.stderr, "no torpor database at") {
		t.Fatalf("ls before any key: %+v", r)
	}
	r := runTorpor("key", "create", "--data-dir", dir, "--name", "ci runner")
	if r.code != 0 {
		t.Fatalf("create: %+v", r)
	}
	key := strings.TrimSuffix(r.stdout, "\n")
	if !apikey.Valid(key) || strings.Contains(key, "\n") {
		t.Fatalf("create printed %q, want the key alone", r.stdout)
	}
	id := regexp.MustCompile(`key_[0-9a-f]{12}`).FindString(r.stderr)
	if id == "" || !strings.Contains(r.stderr, "only this once") || !strings.Contains(r.stderr, key[:12]) || strings.Contains(r.stderr, key) {
		t.Fatalf("create's note %q: want the id, the prefix and not the key", r.stderr)
	}
	r2 := runTorpor("key", "create", "--data-dir", dir, "--json")
	var made keyJSON
	if r2.code != 0 || json.Unmarshal([]byte(r2.stdout), &made) != nil || !apikey.Valid(made.Key) || made.Prefix != made.Key[:12] || made.Name != "" {
		t.Fatalf("create --json: %+v %+v", r2, made)
	}

	// The key works against the database the server would open.
	db, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	v := apikey.NewVerifier(db, apikey.Config{})
	if rec, err := v.Verify(context.Background(), key); err != nil || rec.ID != id || rec.Name != "ci runner" {
		t.Fatalf("verify the printed key: %+v %v", rec, err)
	}
	db.Close()

	ls := runTorpor("key", "ls", "--data-dir", dir)
	lines := strings.Split(strings.TrimSpace(ls.stdout), "\n")
	if ls.code != 0 || len(lines) != 3 || !strings.HasPrefix(lines[0], "ID") {
		t.Fatalf("ls: %+v", ls)
	}
	if !strings.Contains(lines[1], id) || !strings.Contains(lines[1], "ci runner") || !strings.Contains(lines[1], key[:12]+"…") || !strings.Contains(lines[1], "s ago") {
		t.Errorf("ls line of the used key: %q", lines[1])
	}
	if !strings.Contains(lines[2], made.ID) || !strings.HasSuffix(lines[2], "never") {
		t.Errorf("ls line of the unused key: %q", lines[2])
	}
	lsj := runTorpor("key", "ls", "--data-dir", dir, "--json")
	var list struct{ Keys []map[string]any }
	if lsj.code != 0 || json.Unmarshal([]byte(lsj.stdout), &list) != nil || len(list.Keys) != 2 || list.Keys[0]["id"] != id ||
		list.Keys[0]["last_used_at"] == nil || list.Keys[1]["last_used_at"] != nil {
		t.Fatalf("ls --json: %+v", lsj)
	}
	if _, ok := list.Keys[0]["key"]; ok {
		t.Errorf("ls --json has a key field: %s", lsj.stdout)
	}
	for _, out := range []string{ls.stdout, lsj.stdout} {
		for _, k := range []string{key, made.Key} {
			if strings.Contains(out, k[12:]) {
				t.Errorf("ls shows key material past the prefix:\n%s", out)
			}
		}
	}

	// The same id twice removes it once, without failing on the repeat.
	if r := runTorpor("key", "rm", "--data-dir", dir, id, id); r.code != 0 || r.stdout != "removed "+id+"\n" {
		t.Fatalf("rm: %+v", r)
	}
	if r := runTorpor("key", "rm", "--data-dir", dir, id); r.code != 1 || !strings.Contains(r.stderr, "no key "+id) {
		t.Errorf("second rm: %+v", r)
	}
	db, _ = sqlite.Open(filepath.Join(dir, "torpor.db"))
	defer db.Close()
	if _, err := apikey.NewVerifier(db, apikey.Config{}).Verify(context.Background(), key); err == nil {
		t.Error("a removed key still verifies")
	}
	if ls := runTorpor("key", "ls", "--data-dir", dir); strings.Contains(ls.stdout, id) || !strings.Contains(ls.stdout, made.ID) {
		t.Errorf("ls after rm: %q", ls.stdout)
	}
	if r := runTorpor("key", "create", "--data-dir", dir, "--name", "two\nlines"); r.code != 2 {
		t.Errorf("create with a newline in the name: %+v", r)
	}
	if r := runTorpor("key", "rm", "--data-dir", dir); r.code != 2 {
		t.Errorf("rm without an id: %+v", r)
	}
	t.Setenv("TORPOR_DATA_DIR", dir)
	if r := runTorpor("key", "ls"); r.code != 0 || !strings.Contains(r.stdout, made.ID) {
		t.Errorf("ls with TORPOR_DATA_DIR: %+v", r)
	}
	// An unknown id first does not stop the removal of the ones after it.
	if r := runTorpor("key", "rm", "--data-dir", dir, "key_000000000000", made.ID); r.code != 1 ||
		r.stdout != "removed "+made.ID+"\n" || !strings.Contains(r.stderr, "no key key_000000000000") {
		t.Errorf("rm of an unknown id, then a real one: %+v", r)
	}
	if ls := runTorpor("key", "ls", "--data-dir", dir); strings.Contains(ls.stdout, made.ID) {
		t.Errorf("a key listed after an unknown id in rm is still there: %q", ls.stdout)
	}
}

// TestClientSendsAPIKey: client commands send TORPOR_API_KEY, and a 401 says
// how to give one.
func TestClientSendsAPIKey(t *testing.T) {
	f := newFakeServer(t)
	t.Setenv("TORPOR_API_KEY", "e2b_0123456789abcdef0123456789abcdef01234567")
	f.mustRun("ls")
	f.mu.Lock()
	got := f.lastReq.Header.Get("Authorization")
	f.mu.Unlock()
	if got != "Bearer e2b_0123456789abcdef0123456789abcdef01234567" {
		t.Errorf("Authorization %q", got)
	}
	deny := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 401, "unauthenticated", "invalid API key")
	}))
	defer deny.Close()
	r := runTorpor("--url", deny.URL, "ls")
	if r.code != 1 || !strings.Contains(r.stderr, "torpor: invalid API key") || !strings.Contains(r.stderr, "TORPOR_API_KEY") {
		t.Errorf("a 401: %+v", r)
	}
}

func TestServeAuthFlag(t *testing.T) {
	if r := runTorpor("serve", "--auth", "maybe"); r.code != 2 || !strings.Contains(r.stderr, "--auth \"maybe\"") {
		t.Errorf("serve --auth maybe: %+v", r)
	}
	// A wrong command line like --auth maybe: exit 2, nothing set up.
	dir := filepath.Join(t.TempDir(), "data")
	r := runTorpor("serve", "--auth", "none", "--listen", "0.0.0.0:0", "--data-dir", dir)
	if r.code != 2 || !strings.Contains(r.stderr, "--auth none on 0.0.0.0:0: refused") {
		t.Errorf("serve --auth none off loopback: %+v", r)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("the refused serve made its data directory %s", dir)
	}
}
