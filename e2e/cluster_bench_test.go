package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/workload"
)

// TestClusterBench is a benchmark, not a test: it runs only with
// TORPOR_CLUSTER_BENCH set to the number of resume samples per working set
// (e.g. 8), on TestCluster's three nodes, and logs (docs/benchmarks/
// 2026-12-01-cluster.md):
//   - resume, time to first request (workload.Get through the port proxy of
//     a hibernated sandbox): on the node that committed the snapshot (its
//     local copy) and on a node that never saw the sandbox (the bucket),
//     for each working set in TORPOR_CLUSTER_BENCH_MIB (MiB, default "64");
//   - 30 concurrent creates (each with its first exec `true`) through one
//     node and spread over the three: wall time and p50/p99 per create;
//   - exec `true` p50 to the owner and forwarded through another node.
func TestClusterBench(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("TORPOR_CLUSTER_BENCH"))
	if n <= 0 {
		t.Skip("a benchmark: set TORPOR_CLUSTER_BENCH to the number of resume samples (e.g. 8)")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	sizes := []int{64}
	if s := os.Getenv("TORPOR_CLUSTER_BENCH_MIB"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			mib, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || mib <= 0 {
				t.Fatalf("TORPOR_CLUSTER_BENCH_MIB %q: want MiB, comma-separated", s)
			}
			sizes = append(sizes, mib)
		}
	}
	ctx := ctxFor(t, 40*time.Minute)
	cl := startCluster(t, ctx)
	a, b, c := cl.nodes["cl-a"], cl.nodes["cl-b"], cl.nodes["cl-c"]
	t.Logf("load average at start: %s", loadAvg())
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	del := func(id string) {
		if err := a.c.DeleteSandbox(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}

	// Resume: the snapshot's node vs a node that never saw the sandbox. Each
	// sample is a new sandbox (its working set random, so no node has its
	// chunks), made and hibernated on cl-a, resumed on cl-a, hibernated
	// again there, then resumed with cl-a draining through cl-b or cl-c
	// (placement then serves it there).
	for _, mib := range sizes {
		var local, cold []float64
		for i := range n {
			sb := create(t, a.c, apiv1.CreateSandboxRequest{MemoryMiB: max(256, 2*mib+128)})
			if sb.Node != a.name {
				t.Fatalf("created through %s on %q", a.name, sb.Node)
			}
			if err := workload.Start(ctx, a.c, sb.ID, mib); err != nil {
				t.Fatal(err)
			}
			first := func(via *clusterNode, want string) float64 {
				t0 := time.Now()
				if _, err := workload.Get(ctx, via.c, sb.ID, "/count"); err != nil {
					// Counted and the run goes on: a benchmark reports
					// what failed beside its figures.
					t.Errorf("BENCH FAILED first request through %s: %v", via.name, err)
					return -1
				}
				d := ms(time.Since(t0))
				if on := get(t, a.c, sb.ID).Node; on != want {
					t.Fatalf("resumed through %s on %q; want %s", via.name, on, want)
				}
				return d
			}
			hibernate(t, a.c, sb.ID)
			if d := first(a, a.name); d >= 0 {
				local = append(local, d)
			}
			hibernate(t, a.c, sb.ID)
			if _, err := a.c.DrainNode(ctx, a.name, true); err != nil {
				t.Fatal(err)
			}
			to := []*clusterNode{b, c}[i%2]
			if d := first(to, to.name); d >= 0 {
				cold = append(cold, d)
			}
			if _, err := a.c.DrainNode(ctx, a.name, false); err != nil {
				t.Fatal(err)
			}
			del(sb.ID)
		}
		if len(local) == 0 || len(cold) == 0 {
			continue
		}
		t.Logf("BENCH resume %d MiB, time to first request ms (p50 / p99; %d and %d of %d answered): snapshot's node %.0f / %.0f; node that never saw it (bucket) %.0f / %.0f; cold/local p50 %.2fx",
			mib, len(local), len(cold), n, percentile(local, 50), percentile(local, 99), percentile(cold, 50), percentile(cold, 99), percentile(cold, 50)/percentile(local, 50))
	}

	// 30 concurrent creates (and each one's first exec) through one node,
	// then spread over the three.
	const creates = 30
	burst := func(label string, via []*clusterNode) {
		lat := make([]float64, creates)
		ids := make([]string, creates)
		errs := make(chan error, creates)
		var wg sync.WaitGroup
		t0 := time.Now()
		for i := range creates {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cc := via[i%len(via)].c
				s0 := time.Now()
				sb, err := cc.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 256})
				if err != nil {
					errs <- fmt.Errorf("create %d: %w", i, err)
					return
				}
				ids[i] = sb.ID
				if _, _, code, err := cc.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"true"}}); err != nil || code != 0 {
					errs <- fmt.Errorf("first exec in %s: exit %d %v", sb.ID, code, err)
					return
				}
				lat[i] = ms(time.Since(s0))
			}()
		}
		wg.Wait()
		wall := time.Since(t0)
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		on := map[string]int{}
		for _, id := range ids {
			if id != "" {
				on[get(t, a.c, id).Node]++
				del(id)
			}
		}
		t.Logf("BENCH %d concurrent creates + first exec %s: wall %.1f s; per create ms p50 %.0f / p99 %.0f; placed %v",
			creates, label, wall.Seconds(), percentile(lat, 50), percentile(lat, 99), on)
	}
	burst("through cl-a", []*clusterNode{a})
	burst("spread over cl-a, cl-b, cl-c", []*clusterNode{a, b, c})

	// exec true: to the owner and forwarded.
	sb := create(t, a.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	direct, forwarded := execP50(t, a.c, b.c, sb.ID, 30)
	t.Logf("BENCH exec true p50: direct (cl-a, the owner) %v, forwarded (through cl-b) %v: %.2fx",
		direct, forwarded, float64(forwarded)/float64(direct))
	del(sb.ID)
	t.Logf("load average at end: %s", loadAvg())

	// What the nodes' stores did beside: chunk collections that deleted
	// chunks (on a shared database, under the store id's lock), opens that
	// met a chunk missing where their index placed it and tried again,
	// chunks found damaged or missing.
	for _, n := range []*clusterNode{a, b, c} {
		log, err := os.ReadFile(n.log)
		if err != nil {
			t.Fatal(err)
		}
		count := func(msg string) int { return strings.Count(string(log), msg) }
		t.Logf("BENCH %s's store: %d collections deleted chunks, %d opens tried again after a refresh, %d chunks reported damaged or missing",
			n.name, count("snapshot chunks collected"), count("trying again with the index refreshed"), count("damaged or missing chunk"))
	}
}

// loadAvg is the host's 1, 5 and 15 minute load averages (/proc/loadavg).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown: " + err.Error()
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}
