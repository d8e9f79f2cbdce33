package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/e2e/e2bsdk"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// sdkCheck is one check of testdata/e2b_sdk.mjs.
type sdkCheck struct {
	Name  string
	OK    bool
	Error string
}

// TestE2BSDK runs testdata/e2b_sdk.mjs with each pinned version of E2B's
// JavaScript SDK against a real server: E2B_API_URL and E2B_SANDBOX_URL are
// the server's URL, E2B_API_KEY its key. Every check of the script must pass;
// the log says how many ran for each version.
func TestE2BSDK(t *testing.T) {
	node := e2bsdk.Node(t)
	srv := startE2B(t, servertest.Options{Lifecycle: true, LifecycleInterval: 200 * time.Millisecond})
	for pkg, version := range e2bsdk.Packages {
		t.Run(version, func(t *testing.T) {
			ctx := ctxFor(t, 10*time.Minute)
			// Made through E2B's API: its ports are public on E2B's routing, as
			// a sandbox made through torpor's own API's are not.
			w := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(900)})
			if err := workload.Start(ctx, srv.Client, w.SandboxID, 16); err != nil {
				t.Fatal(err)
			}
			cmd := exec.CommandContext(ctx, node, filepath.Join("testdata", "e2b_sdk.mjs"), e2bsdk.Module(pkg))
			cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "E2B_API_KEY="+srv.APIKey,
				"TORPOR_WORKLOAD="+w.SandboxID, "TORPOR_DOMAIN="+e2bDomain, "TORPOR_TAG="+strings.ReplaceAll(version, ".", "-"))
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("e2b_sdk.mjs: %v\n%s", err, stderr.String())
			}
			var got struct{ Checks []sdkCheck }
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("e2b_sdk.mjs printed %q: %v\n%s", out, err, stderr.String())
			}
			passed := 0
			for _, c := range got.Checks {
				if c.OK {
					passed++
				} else {
					t.Errorf("SDK %s: %s: %s", version, c.Name, c.Error)
				}
			}
			if len(got.Checks) == 0 {
				t.Fatal("the script ran no check")
			}
			t.Log(fmt.Sprintf("SDK %s: %d of %d checks passed", version, passed, len(got.Checks)))
		})
	}
}

// readmeSection is the README section whose examples TestE2BReadmeExample runs.
const readmeSection = "## Using E2B's SDKs with torpor"

// readmeTS is the first ```ts block of the README's readmeSection.
func readmeTS(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\n"+readmeSection+"\n")
	if !ok {
		t.Fatalf("README.md has no section %q", readmeSection)
	}
	if next := strings.Index(sec, "\n## "); next >= 0 {
		sec = sec[:next]
	}
	_, code, ok := strings.Cut(sec, "\n```ts\n")
	if !ok {
		t.Fatalf("README.md section %q has no ```ts block", readmeSection)
	}
	code, _, ok = strings.Cut(code, "\n```\n")
	if !ok {
		t.Fatal("README.md: the ```ts block does not end")
	}
	return code + "\n"
}

// TestE2BReadmeExample runs the TypeScript example of the README (plain
// JavaScript, an ES module) with each pinned SDK against a real server, and
// checks what it prints: the command's output, the exit code, the file kept
// across the pause, the background process still counting, the list.
func TestE2BReadmeExample(t *testing.T) {
	node := e2bsdk.Node(t)
	code := readmeTS(t)
	const imp = `from "e2b";`
	if !strings.Contains(code, imp) {
		t.Fatalf("the README's example does not import %s", imp)
	}
	srv := startE2B(t, servertest.Options{})
	for pkg, version := range e2bsdk.Packages {
		t.Run(version, func(t *testing.T) {
			script := filepath.Join(t.TempDir(), "readme.mjs")
			mod := (&url.URL{Scheme: "file", Path: e2bsdk.Module(pkg)}).String()
			if err := os.WriteFile(script, []byte(strings.Replace(code, imp, `from "`+mod+`";`, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.CommandContext(ctxFor(t, 5*time.Minute), node, script)
			cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "E2B_API_KEY="+srv.APIKey)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("the README's example: %v\n%s\n%s", err, out, stderr.String())
			}
			t.Logf("the README's example printed:\n%s", out)
			for _, want := range []string{
				"hello from user in /home/user\n", "exit code 3\n", "[ '/home/user/notes/todo.txt' ]\n",
				"kept across a pause\n", "still counting: true\n", " running' ]\n",
			} {
				if !strings.Contains(string(out), want) {
					t.Errorf("the README's example printed\n%s\nwithout %q", out, want)
				}
			}
			if n := countSandboxes(t, srv); n != 0 {
				t.Errorf("%d sandboxes left after the example, want 0 (it kills its own)", n)
			}
		})
	}
}
