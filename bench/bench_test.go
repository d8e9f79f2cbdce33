package bench

import (
	"context"
	"os"
	"testing"

	"github.com/torpor/torpor/server/servertest"
)

// BenchmarkResume runs the resume benchmark at 64 MiB against a real in-process
// server (needs root and runsc, like servertest) and reports its percentiles as
// custom metrics. Each b.N iteration is one hibernate/resume cycle, at least 5
// (the first b.N=1 run already takes far longer than the default -benchtime, so
// by default the benchmark runs once with 5 cycles):
//
//	go test -run '^$' -bench Resume ./bench
//	go test -run '^$' -bench Resume -benchtime 20x ./bench   # then 20 cycles
func BenchmarkResume(b *testing.B) {
	srv := servertest.Start(b, servertest.Options{})
	cycles := b.N
	if cycles < 5 {
		cycles = 5
	}
	opts := Options{
		URL:            srv.URL,
		Cycles:         cycles,
		WorkingSetsMiB: []int{64},
		ExecSamples:    20,
		Wakes:          DefaultWakes,
		ForkCycles:     DefaultForkCycles,
		Out:            os.Stderr,
		Progress:       testLog{b},
		DataDir:        srv.DataDir,
		RunscPath:      servertest.Runsc(b),
		AgentPath:      servertest.AgentBinary(b),
		ScratchDir:     b.TempDir(),
	}
	b.ResetTimer()
	results, err := Measure(context.Background(), opts)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	r := results[0]
	b.ReportMetric(r.Resume.P50, "resume_p50_ms")
	b.ReportMetric(r.Resume.P99, "resume_p99_ms")
	b.ReportMetric(r.Hibernate.P50, "hibernate_p50_ms")
	b.ReportMetric(r.Exec.P50, "exec_p50_ms")
	b.ReportMetric(r.Paused.P50, "paused_p50_ms")
	b.ReportMetric(r.Paused.P99, "paused_p99_ms")
	b.ReportMetric(float64(r.SnapshotBytes)/(1<<20), "snapshot_MiB")
	if r.RawRestore != nil {
		b.ReportMetric(r.RawRestore.P50, "raw_restore_p50_ms")
		b.ReportMetric(r.RawCheckpoint.P50, "raw_checkpoint_p50_ms")
		b.ReportMetric(r.RatioP50(), "ratio_p50")
	} else {
		b.Logf("raw runsc measurement skipped: %s", r.RawSkipped)
	}
	// ns/op would be the whole run divided by b.N: meaningless here.
	b.ReportMetric(0, "ns/op")
}

// testLog sends progress lines to the benchmark's log.
type testLog struct{ b *testing.B }

func (l testLog) Write(p []byte) (int, error) {
	l.b.Logf("%s", p)
	return len(p), nil
}
