package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/postgres"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
)

// TestPlace: placement takes active nodes with room by admission control's
// rule (committed + need ≤ memory × the node's overcommit ratio, its
// record's load or, for the asking node, its committed memory now); the
// snapshot's node first, then the asking node, then the most room, by name
// on a tie; with none, a 503 refusal with Retry-After; a sandbox that
// mounts a volume on the volume's node only, else a 503 naming the volume,
// its node and why (lost, draining, unknown, full); a sandbox that mounts
// volumes of two nodes nowhere: a 409 naming both volumes and their nodes
// (volumeNode). On SQLite and on PostgreSQL (a private cluster).
func TestPlace(t *testing.T) {
	t.Run("SQLite", func(t *testing.T) {
		db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		testPlace(t, db)
	})
	t.Run("PostgreSQL", func(t *testing.T) {
		c := pgtest.Start(t)
		db, err := postgres.Open(context.Background(), c.NewDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		testPlace(t, db)
	})
}

func testPlace(t *testing.T, db interface {
	metadata.Nodes
	metadata.Volumes
}) {
	ctx := context.Background()
	now := time.Now()
	put := func(name string, capMiB, loadMiB int64, overcommit float64, beat time.Time, draining bool) {
		t.Helper()
		n := metadata.Node{Name: name, Advertise: "http://" + name, Capacity: metadata.NodeResources{MemoryMiB: capMiB},
			Load: metadata.NodeResources{MemoryMiB: loadMiB}, MemoryOvercommit: overcommit, StartedAt: beat, HeartbeatAt: beat}
		if err := db.PutNode(ctx, n); err != nil {
			t.Fatal(err)
		}
		if err := db.SetNodeDraining(ctx, name, draining); err != nil {
			t.Fatal(err)
		}
	}
	put("a", 4096, 0, 1, now, true)                    // draining
	put("b", 4096, 3900, 1, now, false)                // no room for 512
	put("c", 4096, 1024, 1, now, false)                // room: 3072
	put("d", 2048, 1024, 2, now, false)                // room by its ratio (admits 4096): 3072, as c
	put("e", 8192, 0, 1, now.Add(-time.Minute), false) // lost
	put("f", 2048, 0, 1, now, false)                   // room: 2048
	put("g", 8192, 3700, 0.5, now, false)              // no room by its ratio (admits 4096) though its memory has
	put("h", 1024, 512, 0, now, false)                 // a record without a ratio: 1; room: exactly 512
	committed := func(mib int64) func(context.Context) (int64, error) {
		return func(context.Context) (int64, error) { return mib, nil }
	}
	for _, tc := range []struct {
		mib          int
		prefer, self string
		selfNow      func(context.Context) (int64, error)
		want         string
	}{
		{512, "", "", nil, "c"},              // most room (3072 for c and d): by name
		{512, "f", "", nil, "f"},             // the snapshot's node
		{512, "h", "", nil, "h"},             // the snapshot's node, full to the MiB
		{513, "h", "", nil, "c"},             // one MiB more than h has
		{512, "g", "", nil, "c"},             // the snapshot's node is over its ratio
		{512, "a", "d", nil, "d"},            // the snapshot's node drains: the asking node
		{512, "e", "", nil, "c"},             // the snapshot's node is lost
		{512, "b", "b", nil, "c"},            // neither has room
		{512, "", "f", nil, "f"},             // the asking node
		{512, "", "f", committed(1600), "c"}, // the asking node's committed memory now: full
		{512, "", "b", committed(0), "b"},    // the asking node's committed memory now: room
		{3072, "", "", nil, "c"},
		{3073, "", "f", nil, ""}, // nobody has room
	} {
		n, err := Place(ctx, db, Placement{Op: "resume", SandboxID: "sbx-1", MiB: tc.mib, Prefer: tc.prefer, Self: tc.self,
			SelfCommitted: tc.selfNow, RetryAfter: 7 * time.Second}, now)
		got := ""
		if n != nil {
			got = n.Name
		}
		if tc.want == "" {
			var ae *manager.AdmissionError
			if n != nil || !errors.As(err, &ae) || !ae.Placement || ae.Nodes != 6 || sandbox.KindOf(err) != sandbox.Unavailable ||
				manager.RetryAfterSeconds(err) != 7 || !strings.Contains(err.Error(), "host memory full on every node") {
				t.Errorf("Place(%d MiB) with no room = %q %v; want a refusal of 6 active nodes, retry after 7 s", tc.mib, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("Place(%d MiB, prefer %q, self %q) = %q %v, want %q", tc.mib, tc.prefer, tc.self, got, err, tc.want)
		}
	}
	// A sandbox that mounts a volume goes to the volume's node or nowhere.
	for _, tc := range []struct {
		mib                  int
		prefer, self, volume string
		want, refused        string
	}{
		{512, "c", "c", "f", "f", ""},  // the volume's node over the snapshot's and the asking one
		{512, "", "", "h", "h", ""},    // full to the MiB
		{513, "", "", "h", "", "full"}, // one MiB more than h has: not elsewhere
		{512, "", "c", "a", "", "draining"},
		{512, "", "c", "e", "", "lost"},
		{512, "", "c", "zz", "", "unknown"}, // no record
		{512, "", "c", "b", "", "full"},
	} {
		n, err := Place(ctx, db, Placement{Op: "resume", SandboxID: "sbx-1", MiB: tc.mib, Prefer: tc.prefer, Self: tc.self,
			Volume: "data", VolumeNode: tc.volume, RetryAfter: 7 * time.Second}, now)
		got := ""
		if n != nil {
			got = n.Name
		}
		if tc.refused != "" {
			var ae *manager.AdmissionError
			want := "volume data is on node " + tc.volume + ", which is " + tc.refused
			if n != nil || !errors.As(err, &ae) || ae.VolumeNode != tc.volume || sandbox.KindOf(err) != sandbox.Unavailable ||
				manager.RetryAfterSeconds(err) != 7 || !strings.Contains(err.Error(), want) {
				t.Errorf("Place(volume on %s, %d MiB) = %q %v; want a refusal %q, retry after 7 s", tc.volume, tc.mib, got, err, want)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("Place(volume on %s, %d MiB) = %q %v, want %q", tc.volume, tc.mib, got, err, tc.want)
		}
	}
	// The volumes' node: the first that records one; volumes on two nodes
	// are refused, naming both.
	for name, on := range map[string]string{"v-f": "f", "v-f2": "f", "v-h": "h", "v-old": ""} {
		if err := db.CreateVolume(ctx, metadata.Volume{Name: name, CreatedAt: now, Node: on}); err != nil {
			t.Fatal(err)
		}
	}
	mounts := func(names ...string) []sandbox.VolumeMount {
		var out []sandbox.VolumeMount
		for i, n := range names {
			out = append(out, sandbox.VolumeMount{Name: n, Path: fmt.Sprintf("/v%d", i)})
		}
		return out
	}
	for _, tc := range []struct {
		op, id  string
		volumes []string
		want    string // the volume and its node, or the refusal's text
	}{
		{"create", "", nil, " on "},
		{"create", "", []string{"v-old", "v-missing"}, " on "},
		{"create", "", []string{"v-old", "v-f", "v-missing", "v-f2"}, "v-f on f"},
		{"resume", "sbx-1", []string{"v-h"}, "v-h on h"},
		{"create", "", []string{"v-f", "v-old", "v-h"}, "create: the sandbox would mount volumes on two nodes: volume v-f is on node f and volume v-h on node h"},
		{"resume", "sbx-1", []string{"v-h", "v-f2", "v-f"}, "resume sbx-1: it mounts volumes on two nodes: volume v-h is on node h and volume v-f2 on node f"},
		{"fork", "sbx-1", []string{"v-f2", "v-h"}, "fork sbx-1: it mounts volumes on two nodes: volume v-f2 is on node f and volume v-h on node h"},
	} {
		name, on, err := volumeNode(ctx, db, tc.op, tc.id, mounts(tc.volumes...))
		if strings.Contains(tc.want, ":") {
			if name != "" || on != "" || sandbox.KindOf(err) != sandbox.Conflict || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("volumeNode(%s %v) = %q %q %v; want a conflict %q", tc.op, tc.volumes, name, on, err, tc.want)
			}
			continue
		}
		if got := name + " on " + on; err != nil || got != tc.want {
			t.Errorf("volumeNode(%s %v) = %q %v; want %q", tc.op, tc.volumes, got, err, tc.want)
		}
	}
}

// TestClassifyCall: which sandbox a request is about, whether it wakes it,
// reads only its record, or makes one.
func TestClassifyCall(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		header       map[string]string
		want         call
	}{
		{"GET", "/v1/sandboxes/sbx-1", nil, call{id: "sbx-1", record: true, keep: true}},
		{"DELETE", "/v1/sandboxes/sbx-1", nil, call{id: "sbx-1", keep: true}},
		{"PATCH", "/v1/sandboxes/sbx-1", nil, call{id: "sbx-1", keep: true}},
		{"POST", "/v1/sandboxes/sbx-1/exec", nil, call{id: "sbx-1", wakes: true, keep: true}},
		{"PUT", "/v1/sandboxes/sbx-1/files", nil, call{id: "sbx-1", wakes: true}},
		{"GET", "/v1/sandboxes/sbx-1/ports/8080/x/y", nil, call{id: "sbx-1", wakes: true}},
		{"POST", "/v1/sandboxes/sbx-1/resume", nil, call{id: "sbx-1", wakes: true, resume: true, keep: true}},
		{"POST", "/v1/sandboxes/sbx-1/hibernate", nil, call{id: "sbx-1", keep: true}},
		{"POST", "/v1/sandboxes", nil, call{create: true, keep: true}},
		{"GET", "/v1/sandboxes", nil, call{}},
		{"GET", "/v1/nodes", nil, call{}},
		{"POST", "/v1/sandboxes/sbx-1/fork", nil, call{id: "sbx-1", fork: true, keep: true}},
		{"POST", "/sandboxes", nil, call{create: true, keep: true}},
		{"POST", "/sandboxes/sbx-1/connect", nil, call{id: "sbx-1", wakes: true, keep: true}},
		{"POST", "/v2/sandboxes/sbx-1/connect", nil, call{id: "sbx-1", wakes: true, keep: true}},
		{"GET", "/files", map[string]string{"E2b-Sandbox-Id": "sbx-1", "E2b-Sandbox-Port": "49983"}, call{id: "sbx-1", wakes: true}},
	} {
		r := httptest.NewRequest(tc.method, tc.path, nil)
		for k, v := range tc.header {
			r.Header.Set(k, v)
		}
		if got := classifyCall(r, ""); got != tc.want {
			t.Errorf("%s %s: %+v, want %+v", tc.method, tc.path, got, tc.want)
		}
	}
}

// TestForwardedServedHere: a request another node forwarded is served by the
// node it reached, whatever it is about (never placed or forwarded by the
// record again: only a referral sends it on, TestReferral); the front reads
// nothing of the database for it.
func TestForwardedServedHere(t *testing.T) {
	f := &clusterFront{s: &Server{}} // no database: any lookup would panic
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ })
	for _, path := range []string{"/v1/sandboxes/sbx-1/exec", "/v1/sandboxes", "/sandboxes/sbx-1/connect"} {
		r := httptest.NewRequest("POST", path, nil)
		r.Header.Set(HeaderForwarded, "node-a")
		f.ServeHTTP(httptest.NewRecorder(), r, next)
	}
	r := httptest.NewRequest("GET", "/v1/nodes", nil) // about no sandbox
	f.ServeHTTP(httptest.NewRecorder(), r, next)
	if served != 4 {
		t.Errorf("served %d of 4 requests here", served)
	}
}

// TestFrontVolumesOnTwoNodes: through the cluster front, a create that
// mounts volumes of two nodes, and a resume, an exec (which resumes) and a
// fork of a hibernated sandbox whose volumes are on two nodes, are answered
// 409 conflict naming both volumes and their nodes, before any handler (so
// nothing changes: the record is as it was). (One node's volumes are
// placed there: TestPlace.)
func TestFrontVolumesOnTwoNodes(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	now := time.Now()
	for name, on := range map[string]string{"vol-a": "node-a", "vol-b": "node-b"} {
		if err := db.CreateVolume(ctx, metadata.Volume{Name: name, CreatedAt: now, Node: on}); err != nil {
			t.Fatal(err)
		}
	}
	sb := &metadata.Sandbox{ID: "sbx-two", State: sandbox.StateHibernated, Image: "base", MemoryMiB: 256, CreatedAt: now, StateChangedAt: now,
		Policy: sandbox.Policy{Volumes: []sandbox.VolumeMount{{Name: "vol-a", Path: "/a"}, {Name: "vol-b", Path: "/b"}}}}
	if err := db.CreateSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	before, err := db.GetSandbox(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	f := &clusterFront{s: &Server{db: db, node: "node-c", log: defaultLogger()}}
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ })
	for _, tc := range []struct{ path, body, want string }{
		{"/v1/sandboxes", `{"volumes":[{"name":"vol-a","path":"/a"},{"name":"vol-b","path":"/b"}]}`,
			"create: the sandbox would mount volumes on two nodes: volume vol-a is on node node-a and volume vol-b on node node-b"},
		{"/v1/sandboxes/sbx-two/resume", `{}`, "resume sbx-two: it mounts volumes on two nodes: volume vol-a is on node node-a and volume vol-b on node node-b"},
		{"/v1/sandboxes/sbx-two/exec", `{"cmd":["true"]}`, "resume sbx-two: it mounts volumes on two nodes"},
		{"/v1/sandboxes/sbx-two/fork", `{"volumes":"copy"}`, "fork sbx-two: it mounts volumes on two nodes: volume vol-a is on node node-a and volume vol-b on node node-b"},
	} {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest("POST", tc.path, strings.NewReader(tc.body)), next)
		if w.Code != http.StatusConflict || !strings.Contains(w.Body.String(), `"conflict"`) || !strings.Contains(w.Body.String(), tc.want) {
			t.Errorf("POST %s: %d %s; want 409 conflict with %q", tc.path, w.Code, w.Body, tc.want)
		}
	}
	if served != 0 {
		t.Errorf("%d refused calls reached the handler", served)
	}
	if after, err := db.GetSandbox(ctx, sb.ID); err != nil || after.Version != before.Version || after.State != sandbox.StateHibernated {
		t.Errorf("after the refusals: %+v %v; want the record unchanged", after, err)
	}
}

// TestReferral: a call that a handler fails with another node's ownership
// (a *manager.NotOwnerError: that node claimed the sandbox after this one
// read the record) is forwarded by the front to that node — a REST v1
// call's kept body, a port-proxy body the handler did not read, a call
// that was forwarded to this node already (its Torpor-Forwarded-By grows)
// — with the caller's headers as they came, even if the handler removed
// some (as the E2B front does); nothing the handler would have written
// reaches the caller. Not referred: a call forwarded maxForwardHops times,
// a body the handler read and did not keep, an owner that is lost (each
// answered 409 by the handler), and any other error.
func TestReferral(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	type got struct {
		path, by, header, body string
	}
	reached := make(chan got, 10)
	owner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		reached <- got{r.URL.Path, r.Header.Get(HeaderForwarded), r.Header.Get("X-Caller") + r.Header.Get("E2b-Sandbox-Id"), string(b)}
		w.WriteHeader(http.StatusTeapot)
	}))
	defer owner.Close()
	now := time.Now()
	for name, at := range map[string]time.Time{"node-b": now, "node-lost": now.Add(-time.Hour)} {
		if err := db.PutNode(ctx, metadata.Node{Name: name, Advertise: owner.URL, StartedAt: at, HeartbeatAt: at, MemoryOvercommit: 1}); err != nil {
			t.Fatal(err)
		}
	}
	s := &Server{db: db, node: "node-c", log: defaultLogger()}
	f := &clusterFront{s: s}
	s.cluster = f
	notOwner := func(n string) error {
		return &sandbox.Error{Kind: sandbox.Conflict, SandboxID: "sbx-1", Err: &manager.NotOwnerError{SandboxID: "sbx-1", Node: n}}
	}
	for _, tc := range []struct {
		name, method, path, body, by string
		err                          error
		read                         bool // the handler reads the body (it is not kept)
		want                         int
		wantBy                       string
	}{
		{"exec", "POST", "/v1/sandboxes/sbx-1/exec", `{"cmd":["true"]}`, "", notOwner("node-b"), true, http.StatusTeapot, "node-c"},
		{"port proxy body", "POST", "/v1/sandboxes/sbx-1/ports/80/x", "payload", "", notOwner("node-b"), false, http.StatusTeapot, "node-c"},
		{"files GET forwarded once", "GET", "/v1/sandboxes/sbx-1/files", "", "node-a", notOwner("node-b"), false, http.StatusTeapot, "node-a, node-c"},
		{"e2b in-sandbox", "GET", "/files", "", "", notOwner("node-b"), false, http.StatusTeapot, "node-c"},
		{"forwarded too often", "GET", "/v1/sandboxes/sbx-1/files", "", "node-a, node-b, node-d", notOwner("node-b"), false, http.StatusConflict, ""},
		{"body read", "PUT", "/v1/sandboxes/sbx-1/files", "content", "", notOwner("node-b"), true, http.StatusConflict, ""},
		{"owner lost", "POST", "/v1/sandboxes/sbx-1/resume", "", "", notOwner("node-lost"), false, http.StatusConflict, ""},
		{"other error", "POST", "/v1/sandboxes/sbx-1/resume", "", "", sandbox.Errorf(sandbox.Conflict, "sandbox sbx-1 is in state creating"), false, http.StatusConflict, ""},
	} {
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
		}
		r := httptest.NewRequest(tc.method, tc.path, body)
		r.Header.Set("X-Caller", "kept")
		if tc.by != "" {
			r.Header.Set(HeaderForwarded, tc.by)
		}
		if tc.path == "/files" {
			r.Header.Set("E2b-Sandbox-Id", "sbx-1")
			r.Header.Set("E2b-Sandbox-Port", "49983")
		}
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if tc.read {
				io.ReadAll(r.Body)
			}
			r.Header.Del("X-Caller")
			r.Header.Del("E2b-Sandbox-Id")
			s.fail(w, r, tc.err)
		})
		w := httptest.NewRecorder()
		f.ServeHTTP(w, r, next)
		if w.Code != tc.want {
			t.Errorf("%s: %d %s, want %d", tc.name, w.Code, w.Body, tc.want)
			continue
		}
		if tc.want != http.StatusTeapot {
			if !strings.Contains(w.Body.String(), "conflict") {
				t.Errorf("%s: %s, want the handler's conflict", tc.name, w.Body)
			}
			continue
		}
		g := <-reached
		wantHeader := "kept"
		if tc.path == "/files" {
			wantHeader += "sbx-1"
		}
		if g.path != tc.path || g.by != tc.wantBy || g.header != wantHeader || g.body != tc.body {
			t.Errorf("%s: the owner got %+v; want path %s, %s %q, the caller's header, body %q", tc.name, g, tc.path, HeaderForwarded, tc.wantBy, tc.body)
		}
		if strings.Contains(w.Body.String(), "owned by") {
			t.Errorf("%s: the handler's refusal reached the caller: %s", tc.name, w.Body)
		}
	}
	if len(reached) != 0 {
		t.Errorf("%d refused calls reached the owner", len(reached))
	}
}

// TestForwardOwnerDown: a call for a sandbox whose owner (a live node by
// its record) does not answer is 502 bad_gateway with Retry-After (the
// owner counts as lost within the lease time and its sandboxes resume
// elsewhere: a retry is the remedy), naming the node.
func TestForwardOwnerDown(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // nothing listens there now
	now := time.Now()
	if err := db.PutNode(ctx, metadata.Node{Name: "node-b", Advertise: down.URL, StartedAt: now, HeartbeatAt: now, MemoryOvercommit: 1}); err != nil {
		t.Fatal(err)
	}
	sb := &metadata.Sandbox{ID: "sbx-downowner01", State: sandbox.StateRunning, Owner: "node-b", Image: "base", MemoryMiB: 256, CreatedAt: now, StateChangedAt: now}
	if err := db.CreateSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	f := &clusterFront{s: &Server{db: db, node: "node-c", log: defaultLogger()}}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Errorf("%s served here", r.URL.Path) })
	w := httptest.NewRecorder()
	f.ServeHTTP(w, httptest.NewRequest("GET", "/v1/sandboxes/"+sb.ID+"/files?path=/etc/hostname", nil), next)
	if w.Code != http.StatusBadGateway || w.Header().Get("Retry-After") != "5" || !strings.Contains(w.Body.String(), "bad_gateway") ||
		!strings.Contains(w.Body.String(), strings.TrimPrefix(down.URL, "http://")) {
		t.Errorf("forward to a node that does not answer: %d Retry-After %q %s; want 502 bad_gateway with Retry-After 5 naming it",
			w.Code, w.Header().Get("Retry-After"), w.Body)
	}
}

// TestForwardOwnerHung: a call forwarded to an owner that accepts it and
// never answers (a server stopped by SIGSTOP, a deadlock) ends once the
// owner has sent no heartbeat for node.SelfFenceAfter — by then a node cut
// off from the database has fenced itself — with 502 bad_gateway,
// Retry-After and the node named; before, it waited as long as the caller
// did (a trial's exec hung until the owner was continued, 33 s later).
func TestForwardOwnerHung(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer hung.Close()
	defer close(release)
	// Its last heartbeat is past the self-fence time, not yet the lease:
	// not lost, so the call is forwarded to it.
	beat := time.Now().Add(-node.SelfFenceAfter - 2*time.Second)
	if err := db.PutNode(ctx, metadata.Node{Name: "node-b", Advertise: hung.URL, StartedAt: beat, HeartbeatAt: beat, MemoryOvercommit: 1}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	sb := &metadata.Sandbox{ID: "sbx-hungowner01", State: sandbox.StateRunning, Owner: "node-b", Image: "base", MemoryMiB: 256, CreatedAt: now, StateChangedAt: now}
	if err := db.CreateSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	f := &clusterFront{s: &Server{db: db, node: "node-c", log: defaultLogger()}}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Errorf("%s served here", r.URL.Path) })
	w := httptest.NewRecorder()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.ServeHTTP(w, httptest.NewRequest("POST", "/v1/sandboxes/"+sb.ID+"/exec", strings.NewReader(`{"cmd":["true"]}`)), next)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a call forwarded to a hung owner still waits after 30 s")
	}
	if w.Code != http.StatusBadGateway || w.Header().Get("Retry-After") != "5" || !strings.Contains(w.Body.String(), "node node-b sent no heartbeat") {
		t.Errorf("forward to a hung owner: %d Retry-After %q %s; want 502 with Retry-After 5 saying node-b sent no heartbeat",
			w.Code, w.Header().Get("Retry-After"), w.Body)
	}
}

// TestPlacePending: creates placed in a row through one node, faster than
// the nodes heartbeat, spread over the nodes with room: each placement
// counts on its node until that node's next heartbeat (a trial's second
// and third creates went to the node that looked emptiest at its last
// heartbeat, which refused them, while another stood empty).
func TestPlacePending(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	beat := time.Now().Add(-time.Second)
	for name, load := range map[string]int64{"na": 400, "nb": 0, "nc": 0} {
		if err := db.PutNode(ctx, metadata.Node{Name: name, Advertise: "http://" + name, Capacity: metadata.NodeResources{MemoryMiB: 482},
			Load: metadata.NodeResources{MemoryMiB: load}, MemoryOvercommit: 1, StartedAt: beat, HeartbeatAt: beat}); err != nil {
			t.Fatal(err)
		}
	}
	f := &clusterFront{}
	place := func() (string, error) {
		n, err := Place(ctx, db, Placement{Op: "create", MiB: 256, Self: "na", Pending: f.pendingOn}, time.Now())
		if err != nil {
			return "", err
		}
		f.placedOn(n.Name, 256)
		return n.Name, nil
	}
	first, err := place()
	if err != nil {
		t.Fatal(err)
	}
	second, err := place()
	if err != nil || second == first {
		t.Fatalf("second create placed on %q (%v) after the first on %q: want the other empty node", second, err, first)
	}
	if n, err := place(); sandbox.KindOf(err) != sandbox.Unavailable {
		t.Fatalf("third create placed on %q (%v): want 503, both placements pending", n, err)
	}
	// The first node's next heartbeat counts its sandbox in its load.
	later := time.Now().Add(2 * placedMargin)
	if err := db.PutNode(ctx, metadata.Node{Name: first, Advertise: "http://" + first, Capacity: metadata.NodeResources{MemoryMiB: 482},
		Load: metadata.NodeResources{MemoryMiB: 0}, MemoryOvercommit: 1, StartedAt: beat, HeartbeatAt: later}); err != nil {
		t.Fatal(err)
	}
	if got := f.pendingOn(first, later); got != 0 {
		t.Errorf("pending on %s after a heartbeat past the placement: %d MiB, want 0", first, got)
	}
	if got := f.pendingOn(second, beat); got != 256 {
		t.Errorf("pending on %s before its heartbeat: %d MiB, want 256", second, got)
	}
}

// TestPlacedOnFencedNode: a placed call (a resume of a sandbox no node owns)
// forwarded to a node that refuses it because it is fenced (refuseFenced,
// HeaderFenced: a node just back on the database heartbeats as active a few
// seconds before its fence ends) is served by the forwarding node; a call
// for a sandbox that fenced node owns gets its 503 as it is. Before, the
// placed resume failed 503 (CI: TestClusterSelfFence, where placement
// prefers the node holding the snapshot's local copy).
func TestPlacedOnFencedNode(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	fenced := &Server{node: "node-b", log: defaultLogger()}
	fenced.fence.since, fenced.fence.renewed = time.Now(), time.Now().Add(-node.SelfFenceAfter)
	reached := 0
	nodeB := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !fenced.refuseFenced(w, r) {
			reached++
			w.WriteHeader(http.StatusTeapot)
		}
	}))
	defer nodeB.Close()
	now := time.Now()
	for name, adv := range map[string]string{"node-b": nodeB.URL, "node-c": "http://node-c.invalid"} {
		if err := db.PutNode(ctx, metadata.Node{Name: name, Advertise: adv, Capacity: metadata.NodeResources{MemoryMiB: 4096},
			MemoryOvercommit: 1, StartedAt: now, HeartbeatAt: now}); err != nil {
			t.Fatal(err)
		}
	}
	for _, sb := range []*metadata.Sandbox{
		{ID: "sbx-placed00001", State: sandbox.StateHibernated, SnapshotNode: "node-b"},
		{ID: "sbx-ownedbyb001", State: sandbox.StateRunning, Owner: "node-b"},
	} {
		sb.Image, sb.MemoryMiB, sb.CreatedAt, sb.StateChangedAt = "base", 256, now, now
		if err := db.CreateSandbox(ctx, sb); err != nil {
			t.Fatal(err)
		}
	}
	here, _, _, _ := StartFake(t, Config{})
	f := &clusterFront{s: &Server{db: db, node: "node-c", log: defaultLogger(), Manager: here.Manager}}
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served++
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Body", string(b))
		w.WriteHeader(http.StatusOK)
	})
	w := httptest.NewRecorder()
	f.ServeHTTP(w, httptest.NewRequest("POST", "/v1/sandboxes/sbx-placed00001/resume", strings.NewReader(`{}`)), next)
	if w.Code != http.StatusOK || served != 1 || w.Header().Get("X-Body") != "{}" {
		t.Errorf("placed resume refused by the fenced node: %d %s, served here %d times with body %q; want 200 served here with the body",
			w.Code, w.Body, served, w.Header().Get("X-Body"))
	}
	w = httptest.NewRecorder()
	f.ServeHTTP(w, httptest.NewRequest("POST", "/v1/sandboxes/sbx-ownedbyb001/exec", strings.NewReader(`{"cmd":["true"]}`)), next)
	if w.Code != http.StatusServiceUnavailable || served != 1 || !strings.Contains(w.Body.String(), "fenced itself") || w.Header().Get("Retry-After") != "5" {
		t.Errorf("exec in a sandbox the fenced node owns: %d %s (served here %d times); want its 503 with Retry-After 5", w.Code, w.Body, served)
	}
	if reached != 0 {
		t.Errorf("the fenced node served %d calls", reached)
	}
}
