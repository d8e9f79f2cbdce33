package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
)

// TestPoolCommands: image pool and snapshot template send the sizes given
// to the pool calls and print the pools; without --size/--pool they show
// them; a size without an image name is a usage error.
func TestPoolCommands(t *testing.T) {
	var mu sync.Mutex
	pools := map[string]apiv1.Pool{}
	var puts []string
	mux := http.NewServeMux()
	set := func(kind, key string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			var req apiv1.SetPoolRequest
			if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Size == nil {
				w.WriteHeader(400)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			name := r.PathValue(key)
			puts = append(puts, kind+" "+name)
			p := apiv1.Pool{Template: kind, Name: name, Size: *req.Size, Ready: 1, SnapshotID: "snap-t", UpdatedAt: time.Now()}
			if *req.Size == 0 {
				delete(pools, kind+" "+name)
			} else {
				pools[kind+" "+name] = p
			}
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(p)
		}
	}
	mux.HandleFunc("PUT /v1/images/{name}/pool", set("image", "name"))
	mux.HandleFunc("PUT /v1/snapshots/{id}/pool", set("snapshot", "id"))
	mux.HandleFunc("GET /v1/pools", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		out := apiv1.ListPoolsResponse{Pools: []apiv1.Pool{}}
		for _, k := range []string{"image base", "snapshot snap-1"} {
			if p, ok := pools[k]; ok {
				out.Pools = append(out.Pools, p)
			}
		}
		json.NewEncoder(w).Encode(out)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := Run(context.Background(), append([]string{"--url", srv.URL}, args...), strings.NewReader(""), &out, &errb)
		return code, out.String(), errb.String()
	}
	if code, out, errs := run("image", "pool", "base", "--size", "3"); code != 0 || !strings.Contains(out, "image     base  3     1      snap-t") {
		t.Fatalf("image pool base --size 3: %d\n%s%s", code, out, errs)
	}
	if code, out, errs := run("snapshot", "template", "snap-1", "--pool", "2", "--json"); code != 0 || !strings.Contains(out, `"size": 2`) || !strings.Contains(out, `"template": "snapshot"`) {
		t.Fatalf("snapshot template --pool 2 --json: %d\n%s%s", code, out, errs)
	}
	if code, out, _ := run("image", "pool"); code != 0 || !strings.Contains(out, "base") || !strings.Contains(out, "snap-1") {
		t.Fatalf("image pool (list): %d\n%s", code, out)
	}
	if code, out, _ := run("image", "pool", "other"); code != 0 || !strings.Contains(out, "image other has no warm pool") {
		t.Fatalf("image pool other: %d\n%s", code, out)
	}
	if code, _, _ := run("image", "pool", "--size", "2"); code != 2 {
		t.Fatalf("image pool --size without a name: exit %d, want 2", code)
	}
	if code, _, _ := run("image", "pool", "base", "--size", "0"); code != 0 {
		t.Fatal("image pool base --size 0 failed")
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(puts, ",") != "image base,snapshot snap-1,image base" || len(pools) != 1 {
		t.Fatalf("PUTs %v, pools left %v", puts, pools)
	}
}
