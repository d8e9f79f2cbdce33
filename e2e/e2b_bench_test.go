package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/e2e/e2bsdk"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/server/servertest"
)

// TestE2BBench is a benchmark, not a test: it runs only with TORPOR_E2B_BENCH
// set (the runs of fast operations, e.g. 50; slow ones, create, pause and
// connect, get a fifth of that, at least 10). On one server and one sandbox
// of template base it times each operation through E2B's JavaScript SDK
// (testdata/e2b_bench.mjs, SDK 2.51.0), through torpor's own REST API from the
// same Node process with plain fetch (the same script, alternating with the
// SDK run by run), and then through torpor's REST API from Go (the Go
// client), and logs p50/p90/p99 of the three and the
// SDK's ratio to each baseline as a Markdown table. The SDK's
// commands.run("true") runs a login bash: the row "run bash -l -c true"
// compares it with torpor's exec of that same command, which alternates with
// it. docs/benchmarks/2026-12-01-e2b-node-baseline.md and
// 2026-12-01-e2b-speed.md have the command and figures.
func TestE2BBench(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("TORPOR_E2B_BENCH"))
	if n <= 0 {
		t.Skip("a benchmark: set TORPOR_E2B_BENCH to the number of runs (e.g. 50)")
	}
	slow := max(10, n/5)
	node := e2bsdk.Node(t)
	srv := startE2B(t, servertest.Options{})
	c := srv.Client
	ctx := ctxFor(t, 60*time.Minute)
	id := e2bCreate(t, srv, e2b.NewSandbox{TemplateID: "base", Timeout: i32(3600)}).SandboxID

	// The SDK and torpor's API from Node first, then from Go, on the same sandbox.
	cmd := exec.CommandContext(ctx, node, filepath.Join("testdata", "e2b_bench.mjs"), e2bsdk.Module("e2b"), id, strconv.Itoa(n), strconv.Itoa(slow))
	cmd.Env = append(cmd.Environ(), "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "E2B_API_KEY="+srv.APIKey, "TORPOR_API_URL="+srv.URL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("e2b_bench.mjs: %v\n%s", err, stderr.String())
	}
	var got struct{ SDK, Rest map[string][]float64 }
	if err := json.Unmarshal(out, &got); err != nil || len(got.SDK) == 0 || len(got.Rest) == 0 {
		t.Fatalf("e2b_bench.mjs printed %q: %v", out, err)
	}
	sdk, rest := got.SDK, got.Rest

	api := map[string][]float64{}
	timeOp := func(op string, runs int, fn func()) {
		for range runs {
			t0 := time.Now()
			fn()
			api[op] = append(api[op], float64(time.Since(t0).Microseconds())/1000)
		}
	}
	exec := func(id string, cmd ...string) {
		if _, errb, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: cmd}); err != nil || code != 0 {
			t.Fatalf("exec %q: %v exit %d %s", cmd, err, code, errb)
		}
	}
	exec(id, "true")
	timeOp("create → first command", slow, func() {
		sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: image.E2BBaseName})
		if err != nil {
			t.Fatal(err)
		}
		exec(sb.ID, "true")
		t.Cleanup(func() { c.DeleteSandbox(ctxFor(t, time.Minute), sb.ID) })
	})
	for range n {
		timeOp("run true", 1, func() { exec(id, "true") })
		timeOp("run bash -l -c true", 1, func() { exec(id, "bash", "-l", "-c", "true") })
	}
	mib := bytes.Repeat([]byte("torpor\n"), 1<<20/7+1)[:1<<20]
	timeOp("write 1 MiB", n, func() {
		if err := c.WriteFile(ctx, id, "/tmp/bench.bin", bytes.NewReader(mib)); err != nil {
			t.Fatal(err)
		}
	})
	timeOp("read 1 MiB", n, func() {
		rc, err := c.ReadFile(ctx, id, "/tmp/bench.bin")
		if err != nil {
			t.Fatal(err)
		}
		if n, err := io.Copy(io.Discard, rc); err != nil || n != 1<<20 {
			t.Fatalf("read %d bytes: %v", n, err)
		}
		rc.Close()
	})
	for range slow {
		timeOp("pause", 1, func() {
			if _, err := c.Hibernate(ctx, id); err != nil {
				t.Fatal(err)
			}
		})
		timeOp("connect → first command", 1, func() {
			if _, err := c.Resume(ctx, id); err != nil {
				t.Fatal(err)
			}
			exec(id, "true")
		})
	}

	var b strings.Builder
	fmt.Fprintf(&b, "| operation | E2B SDK p50 / p90 / p99 (ms) | torpor API from Node p50 / p90 / p99 (ms) | torpor API from Go p50 / p90 / p99 (ms) | SDK ÷ Node API at p50 | SDK ÷ Go API at p50 | runs |\n|---|---|---|---|---|---|---|\n")
	ratio := func(s, a []float64) string {
		if len(s) == 0 || len(a) == 0 {
			return "—"
		}
		return fmt.Sprintf("%.2f×", percentile(s, 50)/percentile(a, 50))
	}
	for _, op := range []string{"create → first command", "run true", "run bash -l -c true", "write 1 MiB", "read 1 MiB", "pause", "connect → first command"} {
		s, r, a := sdk[op], rest[op], api[op]
		label := op
		if op == "run bash -l -c true" {
			// What the SDK's commands.run("true") runs: its ratios to this row
			// compare the same work.
			s, label = sdk["run true"], op+" (the SDK: its run true)"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %d |\n", label, pcts(s), pcts(r), pcts(a), ratio(s, r), ratio(s, a), len(a))
	}
	t.Log("\n" + b.String())
}

// percentile is the p-th percentile of xs (nearest rank).
func percentile(xs []float64, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	k := int(float64(len(s))*p/100+0.999999) - 1
	return s[min(max(k, 0), len(s)-1)]
}

func pcts(xs []float64) string {
	if len(xs) == 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f / %.1f / %.1f", percentile(xs, 50), percentile(xs, 90), percentile(xs, 99))
}
