package bench

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestRestoreLevers measures the engine's restore levers one against another
// in one run: the raw measurement (checkpoint, a rest, restore until the
// workload's first answer) with a plain engine, with prepared containers,
// with --background, and with both. It runs only when TORPOR_LEVERS is set
// (minutes of real sandboxes); TORPOR_LEVERS_CYCLES sets the cycles per case
// (default 10), TORPOR_LEVERS_DEBUG a directory for runsc's debug logs (the
// restore's timing tree; slower).
//
//	TORPOR_LEVERS=1 go test -count=1 -run TestRestoreLevers -v -timeout 30m ./bench
func TestRestoreLevers(t *testing.T) {
	if os.Getenv("TORPOR_LEVERS") == "" {
		t.Skip("set TORPOR_LEVERS=1 to measure the restore levers")
	}
	cycles := 10
	if n, err := strconv.Atoi(os.Getenv("TORPOR_LEVERS_CYCLES")); err == nil && n > 0 {
		cycles = n
	}
	srv := servertest.Start(t, servertest.Options{})
	c := client.New(srv.URL)
	if _, err := srv.Images.EnsureBase(context.Background(), io.Discard); err != nil {
		t.Fatal(err)
	}
	opts := Options{DataDir: srv.DataDir, RunscPath: servertest.Runsc(t), AgentPath: servertest.AgentBinary(t), ScratchDir: t.TempDir()}
	cases := []struct {
		name string
		cfg  gvisor.Config
	}{
		{"plain", gvisor.Config{}},
		{"prepared", gvisor.Config{PreparedContainers: 1}},
		{"background", gvisor.Config{BackgroundRestore: true}},
		{"prepared+background", gvisor.Config{PreparedContainers: 1, BackgroundRestore: true}},
	}
	ctx := context.Background()
	sizes := []int{64, 512}
	if v := os.Getenv("TORPOR_LEVERS_SIZES"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil {
				t.Fatalf("TORPOR_LEVERS_SIZES %q: %v", v, err)
			}
			sizes = append(sizes, n)
		}
	}
	only := os.Getenv("TORPOR_LEVERS_CASES") // comma-separated names; "" = all
	for _, ws := range sizes {
		// One engine and one workload per case, their cycles interleaved, so
		// that the other load on a shared host falls on every case alike.
		type run struct {
			name string
			r    *rawEngine
			run  *rawRun
			ms   []float64
		}
		var runs []*run
		defer func() {
			for _, k := range runs {
				if k.run != nil {
					k.run.stop()
				}
				k.r.close()
			}
		}()
		for _, k := range cases {
			if only != "" && !slices.Contains(strings.Split(only, ","), k.name) {
				continue
			}
			cfg := k.cfg
			if d := os.Getenv("TORPOR_LEVERS_DEBUG"); d != "" {
				dir := filepath.Join(d, strconv.Itoa(ws), k.name) + "/"
				os.MkdirAll(dir, 0o755)
				cfg.ExtraFlags = []string{"--debug", "--debug-log=" + dir}
			}
			r, why := newRawEngineConfig(opts, c, "", cfg)
			if r == nil {
				t.Skip(why)
			}
			r.rest = time.Second
			k := &run{name: k.name, r: r}
			runs = append(runs, k)
			var err error
			if k.run, err = r.start(ctx, ws, memoryFor(ws), workload.Script()); err != nil {
				t.Fatalf("%d MiB %s: %v", ws, k.name, err)
			}
		}
		for i := 0; i < cycles; i++ {
			for _, k := range runs {
				_, ms, err := k.run.cycle(ctx)
				if err != nil {
					t.Fatalf("%d MiB %s: cycle %d: %v", ws, k.name, i+1, err)
				}
				k.ms = append(k.ms, ms)
			}
		}
		var base float64
		for _, k := range runs {
			s := Summarize(k.ms)
			if base == 0 {
				base = s.P50
			}
			t.Logf("%d MiB %-20s restore to first answer p50 %6.1f ms p90 %6.1f ms (%.2f× %s), n=%d, %d into prepared containers",
				ws, k.name, s.P50, s.P90, s.P50/base, runs[0].name, s.N, k.r.eng.PreparedRestores())
		}
		for _, k := range runs {
			k.run.stop()
			k.run = nil
			k.r.close()
		}
		runs = nil
	}
}
