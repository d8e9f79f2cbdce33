package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
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

	type answer struct {
		status int
		body   string
		err    error
	}
	answered := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.proc.url+"/v1/sandboxes/"+id+"/hibernate", strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		answered <- answer{status: res.StatusCode, body: string(b)}
	}()
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

	var ans answer
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
	var hib apiv1.Sandbox
	deadline := time.Now().Add(2 * time.Minute)
	for {
		hib = get(t, a.c, id)
		if hib.State == apiv1.StateHibernated {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(c.log)
			t.Fatalf("2 minutes after the database came back %s is %s (%s); %s's log ends:\n%s", id, hib.State, hib.Error, c.name, lastLines(log, 30))
		}
		time.Sleep(250 * time.Millisecond)
	}
	if hib.Snapshot == nil || hib.Node != "" || hib.Error != "" {
		t.Fatalf("recorded after the outage: snapshot %+v node %q error %q; want hibernated on the kept checkpoint", hib.Snapshot, hib.Node, hib.Error)
	}
	back, err := a.c.Resume(ctx, id)
	if err != nil {
		t.Fatalf("resume through cl-a: %v", err)
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
