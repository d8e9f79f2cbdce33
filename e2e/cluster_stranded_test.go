package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/workload"
)

// TestClusterHibernateThroughOutage: node cl-c reaches PostgreSQL through a
// proxy the test cuts while cl-c hibernates a sandbox holding 192 MiB of
// memory (cut as soon as the record says hibernating, while the checkpoint
// is written). The checkpoint completes; its commit cannot take the
// collection lock (nor write the record). cl-c keeps the checkpoint instead
// of losing the sandbox, and the hibernate answers 503 saying so; cl-c
// fences itself and the other nodes declare it lost and put the sandbox in
// error (it had no snapshot). The proxy restored, cl-c commits the kept
// checkpoint and records the sandbox hibernated on it (nobody resumed it
// meanwhile), and a resume through cl-a continues its process with its
// counter. Before, the sandbox stayed in error ("it had no snapshot:
// delete it") and the checkpoint was gone.
func TestClusterHibernateThroughOutage(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	a, c := cl.nodes["cl-a"], cl.nodes["cl-c"]
	px := throughProxy(t, cl, c, a)
	id, before := workloadOn(t, ctx, c, a, 512, 192)

	answered := hibernateAsync(ctx, c, id)
	for {
		if s := get(t, a.c, id); s.State == apiv1.StateHibernating {
			break
		} else if s.State != apiv1.StateRunning {
			t.Fatalf("during the hibernate: %s %s", s.State, s.Error)
		}
		time.Sleep(20 * time.Millisecond)
	}
	px.cut()
	cut := time.Now()
	t.Logf("database cut off from %s while it hibernates %s", c.name, id)

	var ans hibernateAnswer
	select {
	case ans = <-answered:
	case <-time.After(3 * time.Minute):
		t.Fatalf("the hibernate did not answer within 3 minutes of the cut")
	}
	t.Logf("hibernate answered %v after the cut: %d %s %v", time.Since(cut).Round(100*time.Millisecond), ans.status, ans.body, ans.err)
	if ans.err == nil && ans.status == http.StatusServiceUnavailable {
		var eb apiv1.ErrorBody
		if json.Unmarshal([]byte(ans.body), &eb) != nil || !strings.Contains(eb.Error.Message, "kept on this node's disk") {
			t.Errorf("the hibernate's 503 does not say the checkpoint is kept: %s", ans.body)
		}
	} else if ans.err == nil && ans.status != http.StatusServiceUnavailable {
		t.Errorf("the hibernate answered %d %s; want 503 saying the checkpoint is kept", ans.status, ans.body)
	}

	// The others declare cl-c lost and fence the sandbox.
	for {
		s := get(t, a.c, id)
		if s.State == apiv1.StateError && s.Node == "" {
			t.Logf("fenced by the others: %s", s.Error)
			break
		}
		if time.Since(cut) > node.LeaseTime+6*node.HeartbeatInterval {
			t.Fatalf("%v after the cut %s is %s on %q (%s)", time.Since(cut).Round(time.Second), id, s.State, s.Node, s.Error)
		}
		time.Sleep(250 * time.Millisecond)
	}

	// The database back: cl-c commits and records the kept checkpoint.
	px.restore()
	resumesFromKept(t, ctx, a, c, id, before, "the database came back")
}

// hibernateAnswer is the answer to a hibernate (err: none came).
type hibernateAnswer struct {
	status int
	body   string
	err    error
}

// hibernateAsync sends a hibernate of sandbox id to node n and returns
// where its answer will come.
func hibernateAsync(ctx context.Context, n *clusterNode, id string) <-chan hibernateAnswer {
	answered := make(chan hibernateAnswer, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, n.proc.url+"/v1/sandboxes/"+id+"/hibernate", strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- hibernateAnswer{err: err}
			return
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		answered <- hibernateAnswer{status: res.StatusCode, body: string(b)}
	}()
	return answered
}

// resumesFromKept waits (3 minutes at most) until sandbox id, whose
// hibernate node n kept, is recorded hibernated with no error, then resumes
// it through node a and checks that its workload continues from before (the
// checkpoint's process and counter, plus this request). after says since
// when it waits.
func resumesFromKept(t *testing.T, ctx context.Context, a, n *clusterNode, id string, before workload.State, after string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	var hib apiv1.Sandbox
	for {
		hib = get(t, a.c, id)
		if hib.State == apiv1.StateHibernated {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(n.log)
			t.Fatalf("3 minutes after %s %s is %s (%s); %s's log ends:\n%s", after, id, hib.State, hib.Error, n.name, lastLines(log, 30))
		}
		time.Sleep(250 * time.Millisecond)
	}
	if hib.Snapshot == nil || hib.Node != "" || hib.Error != "" {
		t.Fatalf("recorded after %s: snapshot %+v node %q error %q; want hibernated on the kept checkpoint", after, hib.Snapshot, hib.Node, hib.Error)
	}
	// The node that kept the checkpoint may still be ending its fence (it
	// records the sandbox just before it serves again): its 503 is retried,
	// as a client would.
	var back apiv1.Sandbox
	for {
		var err error
		if back, err = a.c.Resume(ctx, id); err == nil {
			break
		}
		if !client.IsUnavailable(err) || time.Now().After(deadline) {
			t.Fatalf("resume through %s: %v", a.name, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	cnt, err := workload.Get(ctx, a.c, id, "/count")
	if err != nil || cnt.Pid != before.Pid || cnt.Count != before.Count+1 {
		t.Fatalf("resumed on %s: %+v %v; want pid %d count %d (the checkpoint's, plus this request)", back.Node, cnt, err, before.Pid, before.Count+1)
	}
}

// lastLines is the last n lines of b.
func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestClusterHibernateOwnerKilled: node cl-c is killed (-9) during a
// hibernate, once the checkpoint is complete (the instance's cgroup frozen
// for its teardown) and before its commit. The other nodes declare cl-c
// lost and put the sandbox in error; cl-c, started again, commits the
// checkpoint its hibernate left staged and records the sandbox hibernated on
// it (nobody resumed it meanwhile), and it resumes through cl-a with its
// process and counter. Before, the start threw the checkpoint away and the
// sandbox stayed in error ("it had no snapshot: delete it").
func TestClusterHibernateOwnerKilled(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	cl := startCluster(t, ctx)
	a, c := cl.nodes["cl-a"], cl.nodes["cl-c"]
	id, before := workloadOn(t, ctx, c, a, 512, 192)

	hibernateAsync(ctx, c, id)
	deadline := time.Now().Add(2 * time.Minute)
	for !frozen(id) {
		if time.Now().After(deadline) {
			t.Fatalf("the hibernate's checkpoint of %s did not end within 2 minutes", id)
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.proc.cmd.Process.Kill()
	<-c.proc.done
	c.proc.done = nil
	killed := time.Now()
	notes, _ := filepath.Glob(filepath.Join(c.dir, "chunks", "staging", "*.hibernate.json"))
	t.Logf("%s killed with its checkpoint complete; notes beside staged checkpoints: %v", c.name, notes)
	if len(notes) == 0 {
		t.Skip("the commit ended before the kill landed: nothing to recover")
	}

	for {
		s := get(t, a.c, id)
		if s.State == apiv1.StateError && s.Node == "" {
			t.Logf("fenced by the others: %s", s.Error)
			break
		}
		if s.State == apiv1.StateHibernated {
			t.Skipf("%s was hibernated before its node was lost", id)
		}
		if time.Since(killed) > node.LeaseTime+6*node.HeartbeatInterval {
			t.Fatalf("%v after the kill %s is %s on %q (%s)", time.Since(killed).Round(time.Second), id, s.State, s.Node, s.Error)
		}
		time.Sleep(250 * time.Millisecond)
	}

	cl.start(c)
	resumesFromKept(t, ctx, a, c, id, before, c.name+" started again")
}

// frozen says whether an instance of sandbox id has its cgroup frozen (the
// gVisor engine freezes a checkpointed instance until its teardown).
func frozen(id string) bool {
	for _, pat := range []string{"/sys/fs/cgroup/freezer/torpor-*/" + id + "-*/freezer.state", "/sys/fs/cgroup/torpor-*/" + id + "-*/cgroup.freeze"} {
		files, _ := filepath.Glob(pat)
		for _, f := range files {
			if b, err := os.ReadFile(f); err == nil && (strings.TrimSpace(string(b)) == "FROZEN" || strings.TrimSpace(string(b)) == "1") {
				return true
			}
		}
	}
	return false
}
