package e2e

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/watchdog"
	"github.com/torpor/torpor/workload"
)

// clusterNode is one `torpor serve` of TestCluster.
type clusterNode struct {
	name, dir, log string
	// database is the URL the node's server is given ("": the cluster's).
	database string
	// env is added to the environment of the node's next server.
	env  []string
	proc *serveProcess
	c    *client.Client
}

// TestCluster: three `torpor serve` processes (own data directories and
// loopback ports) on one PostgreSQL database and one S3 bucket (versitygw).
// A sandbox made through node A is reached through the others (exec, the
// port proxy, hibernate: forwarded to its owner); hibernated, with A
// drained, two nodes asked to resume it at once resume it once, on the node
// placement picks, its process's counter and 64 MiB of memory intact. The
// owner killed (-9) is declared lost within the lease time and its sandbox
// put in state error saying what was lost; resumed through another node it
// continues from its last snapshot (its watchdog stopped its old instance
// before: TestClusterWatchdog). The lost node, back, runs no instance it no
// longer owns. Drained, the new owner hibernates the sandbox, which
// resumes on another node on its next request.
func TestCluster(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	nodes, order, start, bin, s3, bucket := cl.nodes, cl.order, cl.start, cl.bin, cl.s3, cl.bucket
	var id string
	t.Cleanup(func() {
		for _, n := range order {
			if n.proc != nil && n.proc.done != nil && id != "" {
				if err := n.c.DeleteSandbox(context.Background(), id); err != nil && !client.IsNotFound(err) {
					t.Errorf("delete %s through %s: %v", id, n.name, err)
				}
				id = ""
			}
		}
	})
	a, b, c := nodes["cl-a"], nodes["cl-b"], nodes["cl-c"]

	// Made through A, reached through B and C.
	sb := create(t, a.c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	id = sb.ID
	if sb.Node != "cl-a" {
		t.Fatalf("created through cl-a: node %q", sb.Node)
	}
	if err := workload.Start(ctx, a.c, id, 64); err != nil {
		t.Fatal(err)
	}
	sum0, err := workload.Get(ctx, a.c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	cnt, err := workload.Get(ctx, c.c, id, "/count") // the port proxy, through a node that does not own it
	if err != nil || cnt.Count != sum0.Count+1 {
		t.Fatalf("GET /count through cl-c: %+v %v, want count %d", cnt, err, sum0.Count+1)
	}
	pid := cnt.Pid
	if got := sh(t, b.c, id, "echo from $(hostname)"); !strings.HasPrefix(got, "from ") {
		t.Fatalf("exec through cl-b: %q", got)
	}
	direct, forwarded := execP50(t, a.c, b.c, id, 30)
	t.Logf("exec true p50: direct (cl-a, the owner) %v, forwarded (through cl-b) %v: %.2fx",
		direct, forwarded, float64(forwarded)/float64(direct))
	hib := hibernate(t, b.c, id) // forwarded to its owner
	if hib.Node != "" {
		t.Errorf("hibernated: node %q, want none", hib.Node)
	}

	// A drained: two nodes asked at once resume it once, elsewhere.
	if out, err := runTorpor(bin, "node", "drain", "cl-a", "--url", a.proc.url); err != nil || !strings.Contains(out, "cl-a: draining") {
		t.Fatalf("torpor node drain cl-a: %v: %s", err, out)
	}
	type answer struct {
		r   apiv1.ResumeResponse
		err error
	}
	answers := make(chan answer, 2)
	for _, n := range []*clusterNode{b, c} {
		go func() {
			r, err := n.c.ResumeCall(ctx, id)
			answers <- answer{r, err}
		}()
	}
	var resumed, unchanged int
	var owner string
	var gen int64
	for range 2 {
		ans := <-answers
		if ans.err != nil {
			t.Fatalf("concurrent resume: %v", ans.err)
		}
		if ans.r.Unchanged {
			unchanged++
		} else {
			resumed++
		}
		if owner != "" && (ans.r.Sandbox.Node != owner || ans.r.Sandbox.Generation != gen) {
			t.Errorf("the two answers disagree: node %q generation %d, and %q %d", owner, gen, ans.r.Sandbox.Node, ans.r.Sandbox.Generation)
		}
		owner, gen = ans.r.Sandbox.Node, ans.r.Sandbox.Generation
	}
	if resumed != 1 || unchanged != 1 {
		t.Fatalf("concurrent resumes through cl-b and cl-c: %d resumed, %d unchanged; want 1 and 1", resumed, unchanged)
	}
	if owner == "" || owner == "cl-a" {
		t.Fatalf("resumed on %q; want a node that is not draining", owner)
	}
	sum1, err := workload.Get(ctx, a.c, id, "/checksum")
	if err != nil || sum1.SHA256 != sum0.SHA256 || sum1.Count != sum0.Count+2 {
		t.Fatalf("after the move to %s: %+v %v; before %+v", owner, sum1, err, sum0)
	}
	t.Logf("resumed %s on %s (placement; cl-a draining): count %d → %d, 64 MiB sha256 %.12s… intact",
		id, owner, sum0.Count, sum1.Count, sum1.SHA256)

	// The owner dies: marked lost, its sandbox in error, resumed elsewhere
	// from its last snapshot.
	lost := nodes[owner]
	other := b
	if lost == b {
		other = c
	}
	lost.proc.cmd.Process.Kill()
	<-lost.proc.done
	lost.proc.done = nil
	killed := time.Now()
	var failed apiv1.Sandbox
	for {
		failed = get(t, other.c, id)
		if failed.State == apiv1.StateError {
			break
		}
		if time.Since(killed) > node.LeaseTime+4*node.HeartbeatInterval {
			t.Fatalf("%v after %s was killed its sandbox is %s (node %q)", time.Since(killed).Round(time.Second), owner, failed.State, failed.Node)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("%s marked lost %v after its kill: %s", owner, time.Since(killed).Round(time.Second), failed.Error)
	if failed.Node != "" || !strings.Contains(failed.Error, "node "+owner+" lost") || !strings.Contains(failed.Error, hib.Snapshot.ID) {
		t.Errorf("the lost node's sandbox: node %q error %q; want no node, the loss and snapshot %s named", failed.Node, failed.Error, hib.Snapshot.ID)
	}
	back, err := a.c.Resume(ctx, id)
	if err != nil || back.Node != other.name {
		t.Fatalf("resume after the loss through cl-a: node %q %v, want %s", back.Node, err, other.name)
	}
	cnt, err = workload.Get(ctx, a.c, id, "/count")
	if err != nil || cnt.Pid != pid || cnt.Count != sum0.Count+2 {
		t.Fatalf("after the loss: %+v %v; want pid %d count %d (the snapshot's, plus this request)", cnt, err, pid, sum0.Count+2)
	}

	// The lost node returns: it runs nothing it no longer owns. Its
	// watchdog stopped the old instance when its server had died
	// (TestClusterWatchdog); whatever was left, the returning server stops.
	start(lost)
	logb, _ := os.ReadFile(lost.log)
	wlog, _ := os.ReadFile(filepath.Join(lost.dir, watchdog.LogFile))
	if !(strings.Contains(string(logb), "stopping orphaned instance") && strings.Contains(string(logb), id)) &&
		!(strings.Contains(string(wlog), "the server is gone: stopped its instances") && strings.Contains(string(wlog), id)) {
		t.Errorf("%s back: neither its log nor its watchdog's says it stopped %s's old instance", lost.name, id)
	}
	if left := runscSandboxesOf(t, lost.dir, id); left != 0 {
		t.Errorf("%s back: %d instances of %s left on it", lost.name, left, id)
	}
	cnt, err = workload.Get(ctx, lost.c, id, "/count")
	if err != nil || cnt.Count != sum0.Count+3 {
		t.Fatalf("through the returned %s: %+v %v", lost.name, cnt, err)
	}

	// Drain the owner: it hibernates the sandbox, which resumes elsewhere.
	if _, err := a.c.DrainNode(ctx, "cl-a", false); err != nil {
		t.Fatal(err)
	}
	if _, err := a.c.DrainNode(ctx, other.name, true); err != nil {
		t.Fatal(err)
	}
	drained := time.Now()
	for get(t, a.c, id).State != apiv1.StateHibernated {
		if time.Since(drained) > 4*node.HeartbeatInterval+time.Minute {
			t.Fatalf("drained %s still holds %s", other.name, id)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("drain of %s hibernated %s in %v", other.name, id, time.Since(drained).Round(100*time.Millisecond))
	cnt, err = workload.Get(ctx, other.c, id, "/count")
	if err != nil || cnt.Count != sum0.Count+4 || cnt.Pid != pid {
		t.Fatalf("after the drain: %+v %v", cnt, err)
	}
	if now := get(t, other.c, id); now.Node == other.name || now.Node == "" {
		t.Errorf("after the drain of %s the sandbox is on %q", other.name, now.Node)
	}

	// Deleted, its snapshots' records go on every node, and their packs are
	// collected from the bucket: by one node at a time, under the store id's
	// advisory lock.
	if err := b.c.DeleteSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*clusterNode{a, b, other} {
		snaps, err := n.c.ListSnapshots(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, sn := range snaps {
			if sn.SandboxID == id {
				t.Errorf("%s still lists snapshot %s of the deleted sandbox", n.name, sn.ID)
			}
		}
	}
	bk, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket, AccessKey: s3.AccessKey,
		SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true})
	if err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	for {
		snaps, err := a.c.ListSnapshots(ctx)
		if err != nil {
			t.Fatal(err)
		}
		packs, err := bk.List(ctx, "packs/")
		if err != nil {
			t.Fatal(err)
		}
		if len(snaps) == 0 && len(packs) == 0 {
			break
		}
		if time.Since(deleted) > 3*time.Minute {
			t.Fatalf("3 min after the sandbox's deletion: %d snapshots listed, %d packs in the bucket", len(snaps), len(packs))
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("the deleted sandbox's packs were collected within %v", time.Since(deleted).Round(100*time.Millisecond))
}

// runTorpor runs the torpor binary with args and returns its output.
func runTorpor(bin string, args ...string) (string, error) {
	out, err := exec.Command(bin, args...).CombinedOutput()
	return string(out), err
}

// runscSandboxesOf counts the runsc sandboxes of sandbox id that the server of
// data directory dir has on the host (its engine's state directory).
func runscSandboxesOf(t *testing.T, dir, id string) int {
	t.Helper()
	all, err := instancesOn(t, dir)
	if err != nil {
		t.Log(err)
		return -1
	}
	n := 0
	for _, l := range all {
		if strings.HasPrefix(l, id+"-") {
			n++
		}
	}
	return n
}

// stopRunscOf force-deletes the runsc sandboxes left under data directory
// dir's engine root (a node killed by the test whose instances neither its
// watchdog nor a restart stopped), by id under that root only, and logs
// how many there were.
func stopRunscOf(t *testing.T, dir string) {
	t.Helper()
	root := filepath.Join(dir, "gvisor", "root")
	if _, err := os.Stat(root); err != nil {
		return
	}
	ids, err := runscList(t, dir)
	if err != nil {
		t.Log(err)
		return
	}
	scope := gvisor.Scope(filepath.Join(dir, "gvisor"))
	for _, id := range ids {
		if out, err := exec.Command(servertest.Runsc(t), "--root", root, "delete", "-force", id).CombinedOutput(); err != nil {
			t.Logf("runsc delete -force %s: %v: %s", id, err, out)
		}
		// Its network namespaces, which the node made under its scope.
		if err := sandboxnet.Delete(context.Background(), sandboxnet.For(scope, id)); err != nil {
			t.Logf("network namespaces of %s: %v", id, err)
		}
	}
	if len(ids) > 0 {
		t.Logf("%s: %d runsc sandboxes left after its server stopped, deleted: %v", dir, len(ids), ids)
	}
}

// runscList lists the ids of the runsc sandboxes the server of data
// directory dir has on the host.
func runscList(t *testing.T, dir string) ([]string, error) {
	out, err := exec.Command(servertest.Runsc(t), "--root", filepath.Join(dir, "gvisor", "root"), "list", "-quiet").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("runsc list: %v: %s", err, out)
	}
	return strings.Fields(string(out)), nil
}

// instancesOn lists the instances the runsc sandboxes of the server of data
// directory dir run: runscList with each prepared container an instance was
// restored into named by that instance, and the unclaimed prepared
// containers (no sandbox's; engine/gvisor/prepared.go) left out.
func instancesOn(t *testing.T, dir string) ([]string, error) {
	ids, err := runscList(t, dir)
	if err != nil {
		return nil, err
	}
	al := aliasesIn(dir)
	var out []string
	for _, id := range ids {
		switch n := hostName(id, al); {
		case strings.HasPrefix(n, unclaimedPrefix):
		case n != "":
			out = append(out, n)
		default:
			out = append(out, id)
		}
	}
	return out, nil
}

// execP50 runs `true` in sandbox id n times through each of two clients,
// alternating, and returns the median times of each.
func execP50(t *testing.T, first, second *client.Client, id string, n int) (time.Duration, time.Duration) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	var d [2][]time.Duration
	for i := range 2 * n {
		c := []*client.Client{first, second}[i%2]
		t0 := time.Now()
		if _, _, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"true"}}); err != nil || code != 0 {
			t.Fatalf("exec true: exit %d %v", code, err)
		}
		d[i%2] = append(d[i%2], time.Since(t0))
	}
	for _, s := range d {
		slices.Sort(s)
	}
	return d[0][n/2], d[1][n/2]
}

// cluster is three `torpor serve` nodes (cl-a, cl-b, cl-c) on one private
// PostgreSQL database and one versitygw bucket, started by startCluster.
type cluster struct {
	nodes  map[string]*clusterNode
	order  []*clusterNode
	start  func(n *clusterNode) // (re)starts n's server
	bin    string
	pg     *pgtest.Cluster
	dbURL  string
	s3     *s3test.Server
	bucket string
	// add makes another server's data directory (the cluster's store id)
	// for node name, stopped and removed with the others; start starts it.
	add func(name string) *clusterNode
}

// startCluster starts the three nodes of a cluster, each with serve's
// flags plus extra, and waits until all three are active. The nodes are
// stopped and their data directories removed when the test ends (their
// logs shown if it failed).
func startCluster(t *testing.T, ctx context.Context, extra ...string) *cluster {
	t.Helper()
	pg := pgtest.Start(t)
	dbURL := pg.NewDatabase(t)
	s3 := s3test.Start(t)
	const bucket = "torpor-e2e-cluster"
	if _, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket, AccessKey: s3.AccessKey,
		SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
		t.Fatal(err)
	}
	bin := buildTorpor(t)
	// The nodes are one store under the bucket's prefix: one store id.
	storeID := fmt.Sprintf("%032x", time.Now().UnixNano())
	cl := &cluster{nodes: map[string]*clusterNode{}, bin: bin, pg: pg, dbURL: dbURL, s3: s3, bucket: bucket}
	cl.add = func(name string) *clusterNode {
		dir, err := os.MkdirTemp("", "torpor-e2e-cluster-")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "store-id"), []byte(storeID+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		n := &clusterNode{name: name, dir: dir, log: filepath.Join(t.TempDir(), fmt.Sprintf("%s-%d.log", name, len(cl.order)))}
		cl.order = append(cl.order, n)
		return n
	}
	for _, name := range []string{"cl-a", "cl-b", "cl-c"} {
		cl.nodes[name] = cl.add(name)
	}
	cl.start = func(n *clusterNode) {
		db := cmp.Or(n.database, dbURL)
		n.proc = serveEnv(t, bin, n.log, n.env, append([]string{"--node", n.name, "--database", db, "--data-dir", n.dir,
			"--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t),
			"--store", "s3", "--s3-endpoint", s3.Endpoint, "--s3-bucket", bucket,
			"--s3-access-key", s3.AccessKey, "--s3-secret-key", s3.SecretKey, "--s3-region", s3.Region}, extra...)...)
		n.c = client.New(n.proc.url)
	}
	var wg sync.WaitGroup
	for _, n := range cl.order {
		wg.Add(1)
		go func() { defer wg.Done(); cl.start(n) }()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, n := range cl.order {
			if n.proc != nil {
				n.proc.stop(t)
			}
		}
		for _, n := range cl.order {
			if t.Failed() {
				log, _ := os.ReadFile(n.log)
				wlog, _ := os.ReadFile(filepath.Join(n.dir, watchdog.LogFile))
				t.Logf("%s's log:\n%s\n%s's watchdog log:\n%s", n.name, log, n.name, wlog)
			}
			stopRunscOf(t, n.dir)
			removeDataDir(n.dir)
		}
	})
	waitNodes(t, cl.order[0].c, func(ns []apiv1.Node) bool {
		active := 0
		for _, n := range ns {
			if n.State == "active" {
				active++
			}
		}
		return active == 3
	})
	return cl
}
