package bench

import (
	"math"
	"sort"
	"time"
)

// Percentile returns the p-th percentile (0 < p <= 100) of samples by the
// nearest-rank method: the smallest sample such that at least p percent of the
// samples are less than or equal to it. It returns 0 for no samples; samples is
// not modified.
func Percentile(samples []float64, p float64) float64 {
	if len(samples) == 0 {
		return 0
	}
	s := append([]float64(nil), samples...)
	sort.Float64s(s)
	if p <= 0 {
		return s[0]
	}
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	if rank < 1 {
		rank = 1
	}
	if rank > len(s) {
		rank = len(s)
	}
	return s[rank-1]
}

// Summary is the distribution of one metric.
type Summary struct {
	P50, P90, P99, Max float64
	N                  int
	// Samples are the measurements summarized, in the order taken, for plots
	// (WritePlot); they are left out of the JSON output.
	Samples []float64 `json:"-"`
}

// Summarize computes the nearest-rank p50, p90, p99 and the maximum of samples
// and keeps a copy of them.
func Summarize(samples []float64) Summary {
	return Summary{
		P50: Percentile(samples, 50), P90: Percentile(samples, 90),
		P99: Percentile(samples, 99), Max: Percentile(samples, 100), N: len(samples),
		Samples: append([]float64(nil), samples...),
	}
}

// msOf is d in milliseconds, with microsecond resolution.
func msOf(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
