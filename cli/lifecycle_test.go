package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/torpor/torpor/apiv1"
)

// create's lifecycle flags end up in the request; set sends only the flags given;
// usage and volume ls print tables.
func TestLifecycleFlags(t *testing.T) {
	var bodies = map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies[r.Method+" "+r.URL.Path] = string(b)
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Path == "/v1/volumes" && r.Method == http.MethodGet:
			json.NewEncoder(w).Encode(apiv1.ListVolumesResponse{Volumes: []apiv1.Volume{{Name: "data", UsedBy: []string{"sbx-1"}}}})
		case strings.HasPrefix(r.URL.Path, "/v1/volumes"):
			w.WriteHeader(http.StatusCreated)
			json.NewEncoder(w).Encode(apiv1.Volume{Name: "data"})
		default:
			json.NewEncoder(w).Encode(apiv1.Sandbox{ID: "sbx-1", State: apiv1.StateRunning, IdleTimeoutS: 3,
				Hibernation: apiv1.Hibernation{Mode: "filesystem"}, Usage: apiv1.Usage{RunningS: 12.5, SnapshotByteS: 1 << 30}})
		}
	}))
	defer srv.Close()
	run := func(args ...string) string {
		var out, errb bytes.Buffer
		if code := Run(context.Background(), append([]string{"--url", srv.URL}, args...), strings.NewReader(""), &out, &errb); code != 0 {
			t.Fatalf("torpor %v: exit %d: %s", args, code, errb.String())
		}
		return out.String()
	}
	run("create", "--idle-timeout", "3", "--timeout", "60", "--on-timeout", "delete", "--mode", "filesystem",
		"--on-resume", "python3 app.py", "--volume", "data:/data")
	var req apiv1.CreateSandboxRequest
	if err := json.Unmarshal([]byte(bodies["POST /v1/sandboxes"]), &req); err != nil {
		t.Fatal(err)
	}
	if req.IdleTimeoutS == nil || *req.IdleTimeoutS != 3 || req.TimeoutS != 60 || req.OnTimeout != "delete" ||
		req.HibernationMode != "filesystem" || strings.Join(req.OnResume, " ") != "sh -c python3 app.py" ||
		len(req.Volumes) != 1 || req.Volumes[0] != (apiv1.VolumeMount{Name: "data", Path: "/data"}) {
		t.Fatalf("create request %s", bodies["POST /v1/sandboxes"])
	}
	run("create")
	if strings.Contains(bodies["POST /v1/sandboxes"], "idle_timeout_s") {
		t.Fatalf("create without --idle-timeout sent %s", bodies["POST /v1/sandboxes"])
	}
	run("set", "sbx-1", "--idle-timeout", "0")
	if got := bodies["PATCH /v1/sandboxes/sbx-1"]; strings.TrimSpace(got) != `{"idle_timeout_s":0}` {
		t.Fatalf("set sent %s", got)
	}
	if out := run("usage", "sbx-1"); !strings.Contains(out, "12.5") || !strings.Contains(out, "sbx-1") {
		t.Fatalf("usage: %s", out)
	}
	run("volume", "create", "data")
	if out := run("volume", "ls"); !strings.Contains(out, "data") || !strings.Contains(out, "sbx-1") {
		t.Fatalf("volume ls: %s", out)
	}
	var vols apiv1.ListVolumesResponse
	if err := json.Unmarshal([]byte(run("volume", "ls", "--json")), &vols); err != nil || len(vols.Volumes) != 1 || vols.Volumes[0].UsedBy[0] != "sbx-1" {
		t.Fatalf("volume ls --json (want GET /v1/volumes's shape): %+v %v", vols, err)
	}
	run("volume", "rm", "data")
	if _, ok := bodies["DELETE /v1/volumes/data"]; !ok {
		t.Fatal("volume rm sent no DELETE")
	}
	var out, errb bytes.Buffer
	if code := Run(context.Background(), []string{"--url", srv.URL, "create", "--volume", "nopath"}, strings.NewReader(""), &out, &errb); code != 2 {
		t.Fatalf("--volume nopath: exit %d", code)
	}
}
