package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server/servertest"
)

// TestBadInput sends unknown ids and malformed or out-of-range input to every
// endpoint, with raw net/http: unknown ids must give 404 not_found, bad input 400
// invalid_argument, each with a message, and none of the calls may change any
// state — the list of sandboxes, their states and snapshots and the engine's
// instances are compared before and after. A hibernate of a hibernated sandbox is
// fine and changes nothing either.
func TestBadInput(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	run := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	hib := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	hibSnap := hibernate(t, c, hib.ID).Snapshot.ID

	listBefore := listJSON(t, srv)
	engBefore := engineJSON(t, srv)

	type call struct {
		method, path, ctype, body string
		status                    int
		names                     string // the field or parameter the message must name ("" = any message)
	}
	const j = "application/json"
	var calls []call
	add := func(status int, method, path, ctype, body string) {
		calls = append(calls, call{method, path, ctype, body, status, ""})
	}
	addNamed := func(names, method, path, ctype, body string) {
		calls = append(calls, call{method, path, ctype, body, http.StatusBadRequest, names})
	}

	// Unknown ids, well-formed and not.
	for _, u := range []string{"sbx-000000000000", "nope"} {
		p := "/v1/sandboxes/" + u
		add(404, "GET", p, "", "")
		add(404, "DELETE", p, "", "")
		add(404, "POST", p+"/exec", j, `{"cmd":["true"]}`)
		add(404, "POST", p+"/hibernate", "", "")
		add(404, "POST", p+"/resume", "", "")
		add(404, "POST", p+"/fork", j, `{"count":1}`)
		add(404, "GET", p+"/files?path=/etc/hostname", "", "")
		add(404, "PUT", p+"/files?path=/tmp/x", "application/octet-stream", "x")
		add(404, "GET", p+"/ports/8080/", "", "")
	}
	// A missing file in a running sandbox.
	add(404, "GET", "/v1/sandboxes/"+run.ID+"/files?path=/no/such/file", "", "")

	// Create.
	for _, body := range []string{
		`{"memory_mib": 256`,                   // malformed
		`{"memory_mib": 256, "bogus": 1}`,      // unknown field
		`{"memory_mib": -5}`,                   // negative memory
		`{"memory_mib": 32}`,                   // below the minimum
		`{"cpus": 0.01}`,                       // too few cpus
		`{"cpus": -1}`,                         // negative cpus
		`{"image": "no-such-image"}`,           // unknown image
		`{"memory_mib": "lots"}`,               // wrong type
		`{} {}`,                                // trailing data
		`[]`,                                   // not an object
		`null`,                                 // not an object either
		`{"env": {"BAD-KEY": "x"}}`,            // bad env name
		`{"image": "sha256:0000000000000000"}`, // unknown digest
	} {
		add(400, "POST", "/v1/sandboxes", j, body)
	}
	// Zero, negative and absurd limits, and a past expiry: each refused
	// naming its field, not taken for the default or accepted.
	for field, bodies := range map[string][]string{
		"pids_limit":     {`{"pids_limit": 0}`, `{"pids_limit": -1}`, `{"pids_limit": 8}`, `{"pids_limit": 1000000000}`},
		"memory_mib":     {`{"memory_mib": 0}`, `{"memory_mib": 1000000000}`},
		"cpus":           {`{"cpus": 0}`, `{"cpus": 1000}`},
		"expires_at":     {`{"expires_at": "2000-01-01T00:00:00Z"}`, `{"expires_at": "` + time.Now().Add(-time.Minute).UTC().Format(time.RFC3339) + `"}`},
		"idle_timeout_s": {`{"idle_timeout_s": -1}`, `{"idle_timeout_s": 100000000000}`},
		"pause_after_s":  {`{"pause_after_s": -1}`},
		"timeout_s":      {`{"timeout_s": -1}`},
	} {
		for _, body := range bodies {
			addNamed(field, "POST", "/v1/sandboxes", j, body)
		}
	}
	// A query parameter the route does not take is refused, not ignored.
	addNamed("limit", "GET", "/v1/sandboxes?limit=abc", "", "")
	addNamed("limit", "GET", "/v1/sandboxes?limit=10", "", "")
	addNamed("state", "GET", "/v1/snapshots?state=running", "", "")
	addNamed("offset", "GET", "/v1/sandboxes/"+run.ID+"/files?path=/etc/hostname&offset=3", "", "")
	addNamed("path", "GET", "/v1/sandboxes/"+run.ID+"/files?path=/etc/hostname&path=/etc/passwd", "", "")
	// A NUL byte in an environment value (the process would see it cut there).
	addNamed("env", "POST", "/v1/sandboxes", j, `{"env": {"A": "x\u0000y"}}`)
	addNamed("env", "POST", "/v1/sandboxes/"+run.ID+"/exec", j, `{"cmd":["true"],"env":{"A":"x\u0000y"}}`)

	// Calls on the running and on the hibernated sandbox: none may wake or change it.
	for _, id := range []string{run.ID, hib.ID} {
		p := "/v1/sandboxes/" + id
		for _, body := range []string{
			`{"cmd":`,                             // malformed
			`{"cmd":["true"],"shell":true}`,       // unknown field
			`{"cmd":[]}`,                          // empty cmd
			`{"cmd":[""]}`,                        // empty program
			`{}`,                                  // no cmd
			``,                                    // no body
			`{"cmd":["pwd"],"cwd":"tmp"}`,         // relative cwd
			`{"cmd":["true"],"timeout_s":-1}`,     // negative timeout
			`{"cmd":["true"],"timeout_s":1e12}`,   // absurd timeout
			`{"cmd":["true"],"env":{"1BAD":"x"}}`, // invalid env key
			`{"cmd":["cat"],"stdin":"x","background":true}`, // stdin for a background process
		} {
			add(400, "POST", p+"/exec", j, body)
		}
		add(400, "GET", p+"/files?path=relative/file", "", "")
		add(400, "GET", p+"/files", "", "")
		add(400, "PUT", p+"/files?path=relative/file", "application/octet-stream", "data")
		add(400, "PUT", p+"/files?path=", "application/octet-stream", "data")
		for _, body := range []string{`{"count":0}`, `{"count":-1}`, `{"count":100}`, `{"count":"two"}`, `{"count":1,"x":1}`, `{"count":`} {
			add(400, "POST", p+"/fork", j, body)
		}
		add(400, "PUT", p+"/files?path=/tmp/a%00b", "application/octet-stream", "data")
		add(400, "PUT", p+"/files?path=/.torpor/x", "application/octet-stream", "data")
		// A name longer than 255 bytes (refused before the agent: the sandbox
		// stays hibernated).
		add(400, "GET", p+"/files?path=/tmp/"+strings.Repeat("n", 256), "", "")
		add(400, "PUT", p+"/files?path=/tmp/"+strings.Repeat("n", 256)+"/x", "application/octet-stream", "data")
		for _, port := range []string{"0", "99999", "abc", "-1", "49983"} {
			add(400, "GET", p+"/ports/"+port+"/", "", "")
		}
		// resume takes no options: a body other than {} is refused, not ignored.
		for _, body := range []string{`{bad json`, `{"async_upload":true}`, `[]`} {
			add(400, "POST", p+"/resume", j, body)
			add(400, "POST", "/v1/snapshots/snap-any/verify", j, body) // nor does verify
		}
		add(413, "POST", "/v1/snapshots/snap-any/verify", j, `{"x":"`+strings.Repeat("x", 2<<20)+`"}`)
		// A path that exists, with the wrong method: 405, not 404.
		add(405, "GET", p+"/hibernate", "", "")
		add(405, "PUT", p+"/resume", j, "{}")
		add(405, "DELETE", p+"/hibernate", "", "")
		add(405, "POST", p, j, "{}")
		// Over the 1 MiB limit: 413.
		add(413, "POST", p+"/hibernate", j, `{"async_upload":true,"x":"`+strings.Repeat("x", 2<<20)+`"}`)
		add(413, "POST", p+"/resume", j, `{"x":"`+strings.Repeat("x", 2<<20)+`"}`)
	}

	for _, cl := range calls {
		var body []byte
		if cl.body != "" || cl.method == "PUT" {
			body = []byte(cl.body)
		}
		res := rawCall(t, cl.method, srv.URL+cl.path, cl.ctype, body)
		what := fmt.Sprintf("%s %s %.80s", cl.method, cl.path, cl.body)
		wantCode := map[int]string{400: apiv1.CodeInvalidArgument, 404: apiv1.CodeNotFound,
			405: apiv1.CodeMethodNotAllowed, 413: apiv1.CodeInvalidArgument}[cl.status]
		if res.Status != cl.status || res.Err.Code != wantCode || res.Err.Message == "" || !strings.Contains(res.Err.Message, cl.names) {
			t.Errorf("%s: HTTP %d code %q message %q; want %d %s with a message naming %q (body %s)",
				what, res.Status, res.Err.Code, res.Err.Message, cl.status, wantCode, cl.names, res.Body)
		}
	}
	t.Logf("%d bad calls answered", len(calls))

	// Hibernating a hibernated sandbox is fine and changes nothing.
	res := rawCall(t, "POST", srv.URL+"/v1/sandboxes/"+hib.ID+"/hibernate", "", nil)
	var sb apiv1.Sandbox
	if res.Status != http.StatusOK || json.Unmarshal(res.Body, &sb) != nil || sb.State != apiv1.StateHibernated || sb.Snapshot == nil || sb.Snapshot.ID != hibSnap {
		t.Errorf("hibernate of a hibernated sandbox: HTTP %d %s", res.Status, res.Body)
	}

	if after := listJSON(t, srv); after != listBefore {
		t.Errorf("the sandboxes changed:\nbefore %s\nafter  %s", listBefore, after)
	}
	if after := engineJSON(t, srv); after != engBefore {
		t.Errorf("the engine's instances changed:\nbefore %s\nafter  %s", engBefore, after)
	}
	// The running one still works.
	sh(t, c, run.ID, "true")
}

// listJSON returns GET /v1/sandboxes as canonical JSON, without the usage
// counters (which grow with time, not with calls).
func listJSON(t *testing.T, srv *servertest.Server) string {
	t.Helper()
	res := rawCall(t, "GET", srv.URL+"/v1/sandboxes", "", nil)
	if res.Status != 200 {
		t.Fatalf("list: HTTP %d %s", res.Status, res.Body)
	}
	var l struct {
		Sandboxes []map[string]any `json:"sandboxes"`
	}
	if err := json.Unmarshal(res.Body, &l); err != nil {
		t.Fatal(err)
	}
	for _, sb := range l.Sandboxes {
		delete(sb, "usage") // accrues with time by design
	}
	b, _ := json.Marshal(l)
	return string(b)
}

func engineJSON(t *testing.T, srv *servertest.Server) string {
	t.Helper()
	srv.Manager.Wait() // hibernated instances still being removed
	infos, err := srv.Engine.List(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(infos)
	return string(b)
}

// TestFileErrorsOfThePath: file calls that fail because of their path answer
// 400 invalid_argument naming the path, not 500 internal (a new-user trial): a
// PUT through a symlink into the read-only /.torpor (the direct path is refused
// by the host), a path over the guest's PATH_MAX (each name within 255 bytes,
// so the guest answers), and a symlink loop, read and written through. A
// refused PUT leaves the client's connection usable for the calls after it. The guest's errors are mapped on
// the host, so agents in older snapshots are answered the same way.
func TestFileErrorsOfThePath(t *testing.T) {
	srv := start(t, servertest.Options{})
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	sh(t, c, sb.ID, "ln -s /.torpor /tmp/l && ln -s /tmp/loop /tmp/loop")
	long := strings.Repeat("/"+strings.Repeat("d", 250), 20) // 5020 bytes
	p := srv.URL + "/v1/sandboxes/" + sb.ID + "/files?path="
	for _, cl := range []struct {
		method, path, want string
	}{
		{"PUT", "/tmp/l/x", "read-only"},
		{"PUT", "/tmp/l/sub/x", "read-only"},
		{"GET", long, "too long"},
		{"GET", "/tmp/loop", "symbolic links"},
		{"PUT", "/tmp/loop/x", "no directory"},
	} {
		var body []byte
		if cl.method == "PUT" {
			body = []byte("data")
		}
		res := rawCall(t, cl.method, p+cl.path, "application/octet-stream", body)
		if res.Status != 400 || res.Err.Code != apiv1.CodeInvalidArgument || !strings.Contains(res.Err.Message, cl.want) ||
			!strings.Contains(res.Err.Message, fmt.Sprintf("path %q", cl.path)) {
			t.Errorf("%s %.60s: HTTP %d %+v; want 400 invalid_argument naming the path and %q", cl.method, cl.path, res.Status, res.Err, cl.want)
		}
	}
	if got := wantState(t, c, sb.ID, apiv1.StateRunning); got.Error != "" {
		t.Errorf("after the refused calls: %+v", got)
	}
	if err := c.DeleteSandbox(ctxFor(t, time.Minute), sb.ID); err != nil {
		t.Error(err)
	}
}
