package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
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
			w := create(t, srv.Client, apiv1.CreateSandboxRequest{IdleTimeoutS: new(int)})
			if err := workload.Start(ctx, srv.Client, w.ID, 16); err != nil {
				t.Fatal(err)
			}
			cmd := exec.CommandContext(ctx, node, filepath.Join("testdata", "e2b_sdk.mjs"), e2bsdk.Module(pkg))
			cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "E2B_API_KEY="+srv.APIKey,
				"TORPOR_WORKLOAD="+w.ID, "TORPOR_DOMAIN="+e2bDomain, "TORPOR_TAG="+strings.ReplaceAll(version, ".", "-"))
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
