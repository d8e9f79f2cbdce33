package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"io/fs"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
)

// The load soak (`make soak`; docs/operations.md#the-load-soak): many small
// sandboxes with idle pause and hibernation on, under a steady mix of calls,
// while the server's resources are sampled for leaks.

// soakSample is one reading of the server's resources.
type soakSample struct {
	at         time.Duration // since the load began
	rssBytes   int64         // VmRSS of the server process (/proc/PID/status)
	goroutines int64         // go_goroutines of GET /metrics
	fds        int           // entries of /proc/PID/fd
	netns      int           // /run/netns entries of this data directory's scope
	runsc      int           // runsc processes on this data directory's runsc root
	diskBytes  int64         // bytes of the files under the data directory, images excepted
	states     map[string]int
}

// soakLimit is the leak trend the soak fails on: a resource's median over the
// last third of the samples after warm-up may exceed its median over the
// first third by at most abs + rel × that first median.
type soakLimit struct {
	name string
	abs  float64
	rel  float64
	get  func(soakSample) float64
}

var soakLimits = []soakLimit{
	{"rss_mib", 64, 0.5, func(s soakSample) float64 { return float64(s.rssBytes) / (1 << 20) }},
	{"goroutines", 100, 0.5, func(s soakSample) float64 { return float64(s.goroutines) }},
	{"fds", 40, 0.5, func(s soakSample) float64 { return float64(s.fds) }},
	{"netns", 8, 0.5, func(s soakSample) float64 { return float64(s.netns) }},
	{"disk_mib", 256, 1.0, func(s soakSample) float64 { return float64(s.diskBytes) / (1 << 20) }},
}

// soakThink is each worker's pause between two calls: with it the sandboxes
// outside the hot quarter get a call every few seconds each (about 10 calls a
// second in all at a 300 ms p50), so that many pass pause_after_s and
// idle_timeout_s between two calls and cycle through the tiers.
const soakThink = 100 * time.Millisecond

// soakOps are the calls of the mix, with their weights.
var soakOps = []struct {
	name   string
	weight int
}{{"exec", 40}, {"write", 20}, {"read", 20}, {"get", 10}, {"list", 5}, {"hibernate", 3}, {"pause", 2}}

// TestLoadSoak runs only when TORPOR_SOAK_DURATION is set (a Go duration;
// `make soak`: 30m). It starts `torpor serve` (its own process, so that its
// RSS and fds can be read from /proc) and TORPOR_SOAK_SANDBOXES sandboxes
// (default: as many of 64 MiB as a twelfth of the host's available memory
// allows, 8 to 48) with pause_after_s 3 and idle_timeout_s 8, then drives
// 4 workers of calls, 100 ms apart each (exec, file write and read, get, list,
// hibernate, pause):
// a quarter of the sandboxes get 80% of the calls, so the rest go idle, pause
// and hibernate, and wake on their next call. Every interval (a tenth of
// the duration, 15 s to 3 min) it samples the server's RSS, goroutines, open
// fds, the scope's network namespaces and runsc processes and the data
// directory's disk use, and the p99 latency of each call. It fails on a leak
// trend (soakLimits: after the first 20% of the samples, the last third's
// median against the first third's), on more than 1% of calls failing, on a
// file that reads back other than written, and when deleting every sandbox
// leaves network namespaces or runsc processes. It prints a report table.
func TestLoadSoak(t *testing.T) {
	dur := os.Getenv("TORPOR_SOAK_DURATION")
	if dur == "" {
		t.Skip("TORPOR_SOAK_DURATION not set (make soak sets 30m)")
	}
	duration, err := time.ParseDuration(dur)
	if err != nil || duration < 30*time.Second {
		t.Fatalf("TORPOR_SOAK_DURATION=%q: want a duration of 30s or more", dur)
	}
	n := soakSandboxes(t)
	interval := min(max(duration/10, 15*time.Second), 3*time.Minute)

	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--standby-memory", "0"}}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start()
	defer func() {
		if p.up {
			p.stop()
		}
		if t.Failed() {
			t.Logf("server log:\n%s", tail(p.logText(), 6000))
		}
	}()
	c := p.client()
	ctx, cancel := context.WithTimeout(context.Background(), duration+20*time.Minute)
	defer cancel()

	t0 := time.Now()
	ids := make([]string, 0, n)
	for i := range n {
		sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 64, PauseAfterS: lcInt(3), IdleTimeoutS: lcInt(8)})
		if err != nil {
			t.Fatalf("create sandbox %d of %d: %v", i+1, n, err)
		}
		ids = append(ids, sb.ID)
	}
	t.Logf("created %d sandboxes of 64 MiB in %v; load for %v, sampled every %v", n, time.Since(t0).Round(time.Second), duration, interval)

	s := &soak{t: t, c: c, ids: ids, files: map[string]map[string]string{}, lat: map[string][]time.Duration{},
		fails: map[string]int{}, ops: map[string]int{}}
	pid := p.cmd.Process.Pid
	scope := gvisor.Scope(filepath.Join(dataDir, "gvisor"))
	var samples []soakSample
	var p99s []map[string]time.Duration
	var counts []map[string]int
	start := time.Now()
	samples = append(samples, s.sample(ctx, pid, scope, 0, p.url()))

	stop := startWorkers(4, func(rng *mrand.Rand) {
		s.step(ctx, rng)
		time.Sleep(soakThink)
	})
	for next := start.Add(interval); ; next = next.Add(interval) {
		last := !next.Before(start.Add(duration))
		if last {
			next = start.Add(duration)
		}
		time.Sleep(time.Until(next))
		pct, cnt := s.takeLatencies()
		p99s, counts = append(p99s, pct), append(counts, cnt)
		samples = append(samples, s.sample(ctx, pid, scope, time.Since(start), p.url()))
		if last {
			break
		}
	}
	stop()

	s.report(samples, p99s, counts)
	soakTrend(t, samples)
	s.mu.Lock()
	total, failed := sum(s.ops), sum(s.fails)
	s.mu.Unlock()
	if failed*100 > total {
		t.Errorf("%d of %d calls failed (more than 1%%); first errors:\n%s", failed, total, strings.Join(s.errs, "\n"))
	}
	if s.mismatches > 0 {
		t.Errorf("%d file reads returned other bytes than the acknowledged write", s.mismatches)
	}

	// Every sandbox deleted: nothing of them stays on the host.
	for _, id := range ids {
		if err := c.DeleteSandbox(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
	deadline := time.Now().Add(time.Minute)
	var end soakSample
	for {
		end = s.sample(ctx, pid, scope, time.Since(start), p.url())
		if (end.netns == 0 && end.runsc == 0) || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if end.netns != 0 || end.runsc != 0 {
		t.Errorf("after every sandbox was deleted: %d network namespaces and %d runsc processes of the scope left", end.netns, end.runsc)
	}
	t.Logf("after deleting every sandbox: rss %.0f MiB, goroutines %d, fds %d (at the start: %.0f MiB, %d, %d)",
		float64(end.rssBytes)/(1<<20), end.goroutines, end.fds, float64(samples[0].rssBytes)/(1<<20), samples[0].goroutines, samples[0].fds)
}

// soakSandboxes is TORPOR_SOAK_SANDBOXES, else what a twelfth of the host's
// available memory (MemAvailable) holds at 64 MiB each, 8 to 48.
func soakSandboxes(t *testing.T) int {
	if v := os.Getenv("TORPOR_SOAK_SANDBOXES"); v != "" {
		k, err := strconv.Atoi(v)
		if err != nil || k < 1 {
			t.Fatalf("TORPOR_SOAK_SANDBOXES=%q: want a positive number", v)
		}
		return k
	}
	avail := int64(4 << 30)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemAvailable:" {
				if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					avail = kb << 10
				}
			}
		}
	}
	return int(min(max(avail/12/(64<<20), 8), 48))
}

// soak is the state of the load: the sandboxes, the acknowledged writes and
// the latencies of the current interval.
type soak struct {
	t   *testing.T
	c   *client.Client
	ids []string

	mu         sync.Mutex
	files      map[string]map[string]string // sandbox -> path -> sha256 of its acknowledged write
	busy       map[string]bool              // a path being written or read
	lat        map[string][]time.Duration   // this interval's latencies by call
	ops, fails map[string]int
	errs       []string
	mismatches int
	seq        int
}

// step runs one call of the mix on a sandbox: a quarter of them (the first)
// get 80% of the calls.
func (s *soak) step(ctx context.Context, rng *mrand.Rand) {
	hot := max(len(s.ids)/4, 1)
	var id string
	if rng.IntN(5) < 4 {
		id = s.ids[rng.IntN(hot)]
	} else {
		id = s.ids[rng.IntN(len(s.ids))]
	}
	w := 0
	for _, o := range soakOps {
		w += o.weight
	}
	k := rng.IntN(w)
	op := ""
	for _, o := range soakOps {
		if k < o.weight {
			op = o.name
			break
		}
		k -= o.weight
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	err := s.run(cctx, op, id, rng)
	d := time.Since(t0)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ops[op]++
	if err != nil {
		s.fails[op]++
		if len(s.errs) < 10 {
			s.errs = append(s.errs, fmt.Sprintf("%s %s after %v: %v", op, id, d.Round(time.Millisecond), err))
		}
		return
	}
	s.lat[op] = append(s.lat[op], d)
}

func (s *soak) run(ctx context.Context, op, id string, rng *mrand.Rand) error {
	c := s.c
	switch op {
	case "exec":
		out, _, code, err := c.ExecCollect(ctx, id, apiv1.ExecRequest{Cmd: []string{"echo", "ok"}})
		if err == nil && (code != 0 || string(out) != "ok\n") {
			return fmt.Errorf("exec answered exit %d, output %q", code, out)
		}
		return err
	case "write":
		s.mu.Lock()
		s.seq++
		path := fmt.Sprintf("/root/soak-%d", s.seq%64) // at most 64 files a sandbox
		if s.busy == nil {
			s.busy = map[string]bool{}
		}
		if s.busy[id+path] {
			s.mu.Unlock()
			return nil
		}
		s.busy[id+path] = true
		delete(s.files[id], path) // either content until acknowledged
		s.mu.Unlock()
		defer func() { s.mu.Lock(); delete(s.busy, id+path); s.mu.Unlock() }()
		data := make([]byte, 1+rng.IntN(16<<10))
		rand.Read(data)
		if err := c.WriteFile(ctx, id, path, bytes.NewReader(data)); err != nil {
			return err
		}
		s.mu.Lock()
		if s.files[id] == nil {
			s.files[id] = map[string]string{}
		}
		s.files[id][path] = sha(data)
		s.mu.Unlock()
		return nil
	case "read":
		s.mu.Lock()
		var path, want string
		for p, h := range s.files[id] {
			if !s.busy[id+p] {
				path, want = p, h
				break
			}
		}
		if path != "" {
			s.busy[id+path] = true
		}
		s.mu.Unlock()
		if path == "" {
			_, err := c.GetSandbox(ctx, id)
			return err
		}
		defer func() { s.mu.Lock(); delete(s.busy, id+path); s.mu.Unlock() }()
		rc, err := c.ReadFile(ctx, id, path)
		if err != nil {
			return err
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return err
		}
		if sha(b) != want {
			s.mu.Lock()
			s.mismatches++
			s.mu.Unlock()
			return fmt.Errorf("read %s: %d bytes with sha256 %s, want %s", path, len(b), sha(b), want)
		}
		return nil
	case "get":
		_, err := c.GetSandbox(ctx, id)
		return err
	case "list":
		_, err := c.ListSandboxes(ctx)
		return err
	case "hibernate":
		_, err := c.Hibernate(ctx, id)
		if client.IsConflict(err) {
			return nil // not running or paused now (hibernating by itself): not a failure of the call
		}
		return err
	case "pause":
		_, err := c.Pause(ctx, id)
		if client.IsConflict(err) {
			return nil // hibernated or between states
		}
		return err
	}
	panic(op)
}

// takeLatencies returns the p99 and count of each call since the last take,
// and starts a new interval.
func (s *soak) takeLatencies() (map[string]time.Duration, map[string]int) {
	s.mu.Lock()
	lat := s.lat
	s.lat = map[string][]time.Duration{}
	s.mu.Unlock()
	p99, cnt := map[string]time.Duration{}, map[string]int{}
	for op, ds := range lat {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		p99[op] = ds[min(len(ds)-1, len(ds)*99/100)]
		cnt[op] = len(ds)
	}
	return p99, cnt
}

// sample reads the server's resources now.
func (s *soak) sample(ctx context.Context, pid int, scope string, at time.Duration, base string) soakSample {
	sm := soakSample{at: at, goroutines: -1, states: map[string]int{}}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				sm.rssBytes = kb << 10
			}
		}
	}
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		sm.fds = len(ents)
	}
	// The server's unclaimed prepared containers (at most its
	// --prepared-containers) are not counted: they are no sandbox's.
	al := aliases()
	unclaimed := func(name string) bool { return strings.HasPrefix(hostName(name, al), unclaimedPrefix) }
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			if name, ok := strings.CutPrefix(e.Name(), scope+"-"); ok && !unclaimed(strings.TrimSuffix(strings.TrimSuffix(name, "-g"), "-h")) {
				sm.netns++
			}
		}
	}
	root := filepath.Join(dataDir, "gvisor", "root")
procs:
	for _, p := range hostProcs(root) {
		if !strings.Contains(p, "runsc") {
			continue
		}
		for _, f := range strings.Fields(p) {
			if unclaimed(filepath.Base(f)) {
				continue procs
			}
		}
		sm.runsc++
	}
	images := filepath.Join(dataDir, "images")
	filepath.WalkDir(dataDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && path == images {
			return filepath.SkipDir
		}
		if d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				sm.diskBytes += info.Size()
			}
		}
		return nil
	})
	sm.goroutines = metricValue(ctx, base+"/metrics", "go_goroutines")
	if all, err := s.c.ListSandboxes(ctx); err == nil {
		for _, sb := range all {
			sm.states[string(sb.State)]++
		}
	}
	return sm
}

// metricValue returns the value of an unlabelled metric from a Prometheus
// text page, -1 when it cannot be read.
func metricValue(ctx context.Context, url, name string) int64 {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return -1
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int64(f)
			}
		}
	}
	return -1
}

// report prints the samples and each interval's p99 latencies as a table.
func (s *soak) report(samples []soakSample, p99s []map[string]time.Duration, counts []map[string]int) {
	var b strings.Builder
	fmt.Fprintf(&b, "| t | rss MiB | goroutines | fds | netns | runsc procs | disk MiB | running/paused/hibernated |")
	for _, o := range soakOps {
		fmt.Fprintf(&b, " %s p99 ms (n) |", o.name)
	}
	b.WriteString("\n|---|---|---|---|---|---|---|---|")
	for range soakOps {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	for i, sm := range samples {
		fmt.Fprintf(&b, "| %s | %.0f | %d | %d | %d | %d | %.0f | %d/%d/%d |", sm.at.Round(time.Second), float64(sm.rssBytes)/(1<<20),
			sm.goroutines, sm.fds, sm.netns, sm.runsc, float64(sm.diskBytes)/(1<<20),
			sm.states[string(apiv1.StateRunning)], sm.states[string(apiv1.StatePaused)], sm.states[string(apiv1.StateHibernated)])
		for _, o := range soakOps {
			if i == 0 {
				b.WriteString(" |")
				continue
			}
			fmt.Fprintf(&b, " %.0f (%d) |", float64(p99s[i-1][o.name].Microseconds())/1000, counts[i-1][o.name])
		}
		b.WriteString("\n")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.t.Logf("load soak, %d sandboxes: %d calls (%v), %d failed (%v)\n%s", len(s.ids), sum(s.ops), s.ops, sum(s.fails), s.fails, b.String())
	if len(s.errs) > 0 {
		s.t.Logf("first errors:\n%s", strings.Join(s.errs, "\n"))
	}
}

// soakTrend fails t on a leak trend (soakLimits) over the samples after the
// first 20% (the warm-up: sandboxes settling into their tiers, caches filling).
func soakTrend(t *testing.T, samples []soakSample) {
	t.Helper()
	after := samples[len(samples)/5:]
	if len(after) < 3 {
		t.Logf("too few samples after warm-up (%d) for a trend", len(after))
		return
	}
	third := max(len(after)/3, 1)
	for _, l := range soakLimits {
		first, last := median(after[:third], l.get), median(after[len(after)-third:], l.get)
		limit := first + l.abs + l.rel*first
		t.Logf("trend %s: median %.0f after warm-up, %.0f at the end (limit %.0f)", l.name, first, last, limit)
		if last > limit {
			t.Errorf("leak trend: %s grew from %.0f to %.0f after warm-up (limit %.0f: +%.0f and +%.0f%%)", l.name, first, last, limit, l.abs, 100*l.rel)
		}
	}
}

func median(ss []soakSample, get func(soakSample) float64) float64 {
	v := make([]float64, len(ss))
	for i, s := range ss {
		v[i] = get(s)
	}
	sort.Float64s(v)
	return v[len(v)/2]
}
