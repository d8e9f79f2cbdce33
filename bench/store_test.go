package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/workload"
)

// Targets of the store benchmark (issue 4).
const (
	TargetDiffHibernateGiBs = 1.0 // diff hibernate ≥ 1 GiB/s of logical memory
	TargetWarmResumeRatio   = 1.1 // resume from a warm chunk cache ≤ 1.1 × the plain store's
)

// storeResult is one store's measurement at one working-set size.
type storeResult struct {
	name  string
	ws    int
	first float64 // first hibernate, GiB/s of logical bytes
	diff  Summary // diff hibernates after a warm resume, GiB/s
	// diffCold: diff hibernates of the cold phase (each but the first after a
	// cold resume, whose reassembly left the opened copy and cache just written), GiB/s.
	diffCold Summary
	diffP10  float64 // 10th percentile of diff (the slow tail of a throughput), GiB/s
	warm     Summary // resume (time to first request), ms, local copies kept
	cold     Summary // resume with the opened copies and the chunk cache emptied, ms
	// Server-side parts of the warm resumes (from its "resumed" log line): the
	// store's Open (verification, and reassembly when cold) and runsc restore.
	warmOpen, warmRestore, coldOpen Summary
	// Server-side parts of the diff hibernates ("snapshot committed" lines):
	// runsc checkpoint and the store's commit, ms; warm phase, then cold phase.
	diffCheckpoint, diffCommit, coldCheckpoint, coldCommit Summary
	logMiB                                                 float64 // median logical snapshot size
}

// BenchmarkStore compares the snapshot stores in one run on the same workload
// (the Python server of the resume benchmark, 64 MiB of data; set
// TORPOR_BENCH_STORE_MIB=64,512 for more sizes, TORPOR_BENCH_STORES=plain,chunked
// to leave stores out): hibernate throughput of a first
// and of diff hibernates (logical snapshot bytes / hibernate_ms), and resume
// time (proxied GET to a hibernated sandbox until its answer) from the plain
// store, the chunked store on local disk with its opened copy kept (warm) and
// removed (cold), and the chunked store on S3 (versitygw on localhost, skipped
// when not installed) warm and cold (opened copies and chunk cache emptied).
// Each phase has max(b.N, 5) cycles; p50s are reported and printed.
// TORPOR_BENCH_SYNC=1 runs sync(2) between each hibernate and the resume (a
// diagnostic: with it the chunked store's warm runsc restore is as fast as the
// plain store's, so writeback left over from its hibernate slows the restore):
//
//	go test -run '^$' -bench Store ./bench
func BenchmarkStore(b *testing.B) {
	sizes := []int{64}
	if v := os.Getenv("TORPOR_BENCH_STORE_MIB"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				b.Fatalf("TORPOR_BENCH_STORE_MIB=%q: want sizes in MiB, comma-separated", v)
			}
			sizes = append(sizes, n)
		}
	}
	kinds := []string{"plain", "chunked", "s3"}
	if v := os.Getenv("TORPOR_BENCH_STORES"); v != "" {
		kinds = strings.Split(v, ",")
		for _, k := range kinds {
			if k != "plain" && k != "chunked" && k != "s3" {
				b.Fatalf("TORPOR_BENCH_STORES=%q: want plain, chunked and/or s3, comma-separated", v)
			}
		}
	}
	var results []storeResult
	for _, ws := range sizes {
		for _, kind := range kinds {
			b.Run(fmt.Sprintf("%s-%dMiB", kind, ws), func(b *testing.B) {
				cycles := b.N
				if cycles < 5 {
					cycles = 5
				}
				r := measureStore(b, kind, ws, cycles)
				results = append(results, r)
				b.ReportMetric(r.first, "first_hib_GiB/s")
				b.ReportMetric(r.diff.P50, "diff_hib_p50_GiB/s")
				if r.diffCold.N > 0 {
					b.ReportMetric(r.diffCold.P50, "diff_hib_after_cold_p50_GiB/s")
				}
				b.ReportMetric(r.warm.P50, "resume_warm_p50_ms")
				b.ReportMetric(r.warmOpen.P50, "warm_store_open_p50_ms")
				b.ReportMetric(r.warmRestore.P50, "warm_runsc_restore_p50_ms")
				if r.cold.N > 0 {
					b.ReportMetric(r.cold.P50, "resume_cold_p50_ms")
					b.ReportMetric(r.coldOpen.P50, "cold_store_open_p50_ms")
				}
				b.ReportMetric(0, "ns/op")
			})
		}
	}
	writeStoreTable(os.Stderr, results)
}

func writeStoreTable(f *os.File, results []storeResult) {
	if len(results) == 0 {
		return
	}
	w := tabwriter.NewWriter(f, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "store\tMiB\tsnapshot MiB\tfirst hibernate GiB/s\tdiff hibernate p50 GiB/s (checkpoint, commit ms)\tresume warm p50 ms (open, restore)\tdiff hibernate after cold p50 GiB/s (checkpoint, commit ms)\tresume cold p50 ms (open)\twarm/plain")
	plain := map[int]float64{}
	for _, r := range results {
		if r.name == "plain" {
			plain[r.ws] = r.warm.P50
		}
	}
	for _, r := range results {
		cold, diffCold, ratio := "-", "-", "-"
		if r.cold.N > 0 {
			cold = fmt.Sprintf("%.0f (%.0f)", r.cold.P50, r.coldOpen.P50)
			diffCold = fmt.Sprintf("%.3f (%.0f, %.0f)", r.diffCold.P50, r.coldCheckpoint.P50, r.coldCommit.P50)
		}
		if p := plain[r.ws]; p > 0 {
			ratio = fmt.Sprintf("%.2f", r.warm.P50/p)
		}
		fmt.Fprintf(w, "%s\t%d\t%.1f\t%.3f\t%.3f (%.0f, %.0f; n=%d)\t%.0f (%.0f, %.0f)\t%s\t%s\t%s\n", r.name, r.ws, r.logMiB, r.first,
			r.diff.P50, r.diffCheckpoint.P50, r.diffCommit.P50, r.diff.N, r.warm.P50, r.warmOpen.P50, r.warmRestore.P50, diffCold, cold, ratio)
	}
	w.Flush()
	fmt.Fprintf(f, "targets: diff hibernate ≥ %.1f GiB/s; warm resume ≤ %.1f× plain\n", TargetDiffHibernateGiBs, TargetWarmResumeRatio)
}

// measureStore starts a server with store kind, one sandbox running the
// workload, and runs a first hibernate, cycles warm cycles and (chunked stores)
// cycles cold ones.
func measureStore(b *testing.B, kind string, ws, cycles int) storeResult {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	var cfg server.StoreConfig
	switch kind {
	case "plain":
		cfg.Kind = "plain"
	case "chunked":
		cfg.Kind = "chunked"
	case "s3":
		s3 := s3test.Start(b)
		const bucket = "torpor-bench"
		if _, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket, AccessKey: s3.AccessKey,
			SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
			b.Fatal(err)
		}
		cfg = server.StoreConfig{Kind: "s3", S3Endpoint: s3.Endpoint, S3Bucket: bucket,
			S3AccessKey: s3.AccessKey, S3SecretKey: s3.SecretKey, S3Region: s3.Region}
	}
	logs := &resumeLog{}
	srv := servertest.Start(b, servertest.Options{Store: cfg,
		Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: logLevel()}))})
	c := srv.Client
	sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: memoryFor(ws)})
	if err != nil {
		b.Fatal(err)
	}
	id := sb.ID
	if err := workload.Start(ctx, c, id, ws); err != nil {
		b.Fatal(err)
	}
	st, err := workload.Get(ctx, c, id, "/count")
	if err != nil {
		b.Fatal(err)
	}
	count := st.Count
	r := storeResult{name: kind, ws: ws}
	var logical []float64

	// cycle hibernates (returning GiB/s), optionally empties the local copies,
	// and times the first proxied request.
	cycle := func(label string, cold bool) (gibs, resumeMS float64) {
		t0 := time.Now()
		h, err := c.Hibernate(ctx, id)
		if err != nil {
			b.Fatalf("%s: %s hibernate: %v", kind, label, err)
		}
		ms := msOf(time.Since(t0))
		if h.Snapshot == nil {
			b.Fatalf("%s: %s hibernate: no snapshot in the answer", kind, label)
		}
		if h.Snapshot.HibernateMS > 0 {
			ms = float64(h.Snapshot.HibernateMS)
		}
		logical = append(logical, float64(h.Snapshot.Bytes)/(1<<20))
		gibs = float64(h.Snapshot.Bytes) / (1 << 30) / (ms / 1000)
		if cold {
			// The cache fills in the background after a hibernate: remove until
			// both directories stay empty for 200 ms.
			for quiet := 0; quiet < 2; time.Sleep(100 * time.Millisecond) {
				found := 0
				for _, sub := range []string{"open", "cache"} {
					dir := filepath.Join(srv.DataDir, "chunks", sub)
					ents, _ := os.ReadDir(dir)
					found += len(ents)
					for _, e := range ents {
						_ = os.RemoveAll(filepath.Join(dir, e.Name()))
					}
				}
				if found == 0 {
					quiet++
				} else {
					quiet = 0
				}
			}
		}
		if os.Getenv("TORPOR_BENCH_SYNC") != "" {
			syscall.Sync()
		}
		t0 = time.Now()
		st, err := workload.Get(ctx, c, id, "/count")
		d := time.Since(t0)
		if err != nil {
			b.Fatalf("%s: %s resume: %v", kind, label, err)
		}
		if st.Count != count+1 {
			b.Fatalf("%s: %s resume: counter %d, want %d", kind, label, st.Count, count+1)
		}
		count = st.Count
		return gibs, msOf(d)
	}

	first, firstResume := cycle("first", false)
	r.first = first
	b.Logf("%s %d MiB: first hibernate %.3f GiB/s, resume %.0f ms", kind, ws, first, firstResume)
	var diff, diffCold, warm, cold []float64
	logs.take()
	for i := 0; i < cycles; i++ {
		g, ms := cycle("warm", false)
		diff, warm = append(diff, g), append(warm, ms)
	}
	lg := logs.take()
	r.warmOpen, r.warmRestore = Summarize(lg.open), Summarize(lg.restore)
	r.diffCheckpoint, r.diffCommit = Summarize(lg.checkpoint), Summarize(lg.commit)
	if kind != "plain" {
		for i := 0; i < cycles; i++ {
			g, ms := cycle("cold", true)
			diffCold, cold = append(diffCold, g), append(cold, ms)
		}
		lg = logs.take()
		r.coldOpen = Summarize(lg.open)
		r.coldCheckpoint, r.coldCommit = Summarize(lg.checkpoint), Summarize(lg.commit)
	}
	r.diff, r.diffCold, r.warm, r.cold = Summarize(diff), Summarize(diffCold), Summarize(warm), Summarize(cold)
	r.diffP10 = Percentile(diff, 10)
	r.logMiB = Percentile(logical, 50)
	b.Logf("%s %d MiB: diff hibernate p50 %.3f GiB/s (p10 %.3f; after cold resumes p50 %.3f); resume warm p50 %.0f ms (store open %.0f ms, runsc restore %.0f ms), cold p50 %.0f ms (store open %.0f ms)",
		kind, ws, r.diff.P50, r.diffP10, r.diffCold.P50, r.warm.P50, r.warmOpen.P50, r.warmRestore.P50, r.cold.P50, r.coldOpen.P50)
	if err := c.DeleteSandbox(ctx, id); err != nil {
		b.Logf("delete %s: %v", id, err)
	}
	return r
}

// logLevel is the server log's level: TORPOR_BENCH_LOG=FILE copies the log to
// FILE at level debug (the stores' per-phase timings), for diagnosis.
func logLevel() slog.Level {
	if os.Getenv("TORPOR_BENCH_LOG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

// resumeLog is the server's JSON log; it keeps the verify_ms (the store's Open)
// and restore_ms of every "resumed" line, and the checkpoint_ms and commit_ms of
// every "snapshot committed" line.
type resumeLog struct {
	mu  sync.Mutex
	cur logSamples
}

type logSamples struct{ open, restore, checkpoint, commit []float64 }

func (l *resumeLog) Write(p []byte) (int, error) {
	var line struct {
		Msg          string  `json:"msg"`
		VerifyMS     float64 `json:"verify_ms"`
		RestoreMS    float64 `json:"restore_ms"`
		CheckpointMS float64 `json:"checkpoint_ms"`
		CommitMS     float64 `json:"commit_ms"`
	}
	if f := os.Getenv("TORPOR_BENCH_LOG"); f != "" {
		if lf, err := os.OpenFile(f, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
			lf.Write(p)
			lf.Close()
		}
	}
	if json.Unmarshal(p, &line) != nil {
		return len(p), nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch line.Msg {
	case "resumed":
		l.cur.open, l.cur.restore = append(l.cur.open, line.VerifyMS), append(l.cur.restore, line.RestoreMS)
	case "snapshot committed":
		l.cur.checkpoint, l.cur.commit = append(l.cur.checkpoint, line.CheckpointMS), append(l.cur.commit, line.CommitMS)
	}
	return len(p), nil
}

// take returns and forgets the samples so far.
func (l *resumeLog) take() logSamples {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.cur
	l.cur = logSamples{}
	return s
}
