package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
)

// TestPlace: placement takes active nodes with room only; the snapshot's
// node first, then the asking node, then the most free memory, by name on
// a tie; nil when none has room.
func TestPlace(t *testing.T) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	now := time.Now()
	put := func(name string, capMiB, loadMiB int64, beat time.Time, draining bool) {
		t.Helper()
		n := metadata.Node{Name: name, Advertise: "http://" + name, Capacity: metadata.NodeResources{MemoryMiB: capMiB},
			Load: metadata.NodeResources{MemoryMiB: loadMiB}, StartedAt: beat, HeartbeatAt: beat}
		if err := db.PutNode(ctx, n); err != nil {
			t.Fatal(err)
		}
		if err := db.SetNodeDraining(ctx, name, draining); err != nil {
			t.Fatal(err)
		}
	}
	put("a", 4096, 0, now, true)                    // draining
	put("b", 4096, 3900, now, false)                // no room for 512
	put("c", 4096, 1024, now, false)                // room
	put("d", 4096, 1024, now, false)                // room, same as c
	put("e", 8192, 0, now.Add(-time.Minute), false) // lost
	put("f", 2048, 0, now, false)                   // room, less than c
	for _, tc := range []struct {
		mib          int
		prefer, self string
		want         string
	}{
		{512, "", "", "c"},   // most free (3072 for c and d): by name
		{512, "f", "", "f"},  // the snapshot's node
		{512, "a", "d", "d"}, // the snapshot's node drains: the asking node
		{512, "e", "", "c"},  // the snapshot's node is lost
		{512, "b", "b", "c"}, // neither has room
		{512, "", "f", "f"},  // the asking node
		{3500, "", "f", ""},  // nobody has room
		{2048, "", "", "c"},
	} {
		n, err := Place(ctx, db, tc.mib, tc.prefer, tc.self, now)
		got := ""
		if n != nil {
			got = n.Name
		}
		if err != nil || got != tc.want {
			t.Errorf("Place(%d MiB, prefer %q, self %q) = %q %v, want %q", tc.mib, tc.prefer, tc.self, got, err, tc.want)
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
// node it reached, whatever it is about (no second forward, no loop); the
// front reads nothing for it.
func TestForwardedServedHere(t *testing.T) {
	f := &clusterFront{} // no server: any lookup would panic
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
