package bench

import "testing"

func TestPercentile(t *testing.T) {
	ten := []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(100 - i) // 100..1, unsorted
	}
	for _, tc := range []struct {
		name    string
		samples []float64
		p, want float64
	}{
		{"empty", nil, 50, 0},
		{"one p50", []float64{7}, 50, 7},
		{"one p99", []float64{7}, 99, 7},
		{"two p50", []float64{3, 1}, 50, 1},
		{"two p51", []float64{3, 1}, 51, 3},
		{"ten p50", ten, 50, 5},
		{"ten p90", ten, 90, 9},
		{"ten p91", ten, 91, 10},
		{"ten p99", ten, 99, 10},
		{"ten p100", ten, 100, 10},
		{"ten p0", ten, 0, 1},
		{"ten p10", ten, 10, 1},
		{"ten p11", ten, 11, 2},
		{"hundred p50", hundred, 50, 50},
		{"hundred p90", hundred, 90, 90},
		{"hundred p99", hundred, 99, 99},
		{"hundred p99.5", hundred, 99.5, 100},
		{"five p90", []float64{5, 4, 3, 2, 1}, 90, 5},
		{"five p50", []float64{5, 4, 3, 2, 1}, 50, 3},
		{"ties", []float64{2, 2, 2, 1}, 50, 2},
	} {
		if got := Percentile(tc.samples, tc.p); got != tc.want {
			t.Errorf("%s: Percentile(%v, %g) = %g, want %g", tc.name, tc.samples, tc.p, got, tc.want)
		}
	}
	if ten[0] != 10 {
		t.Error("Percentile sorted its input")
	}
}

func TestSummarize(t *testing.T) {
	s := Summarize([]float64{4, 1, 3, 2})
	if s.P50 != 2 || s.P90 != 4 || s.P99 != 4 || s.Max != 4 || s.N != 4 {
		t.Errorf("Summarize = %+v", s)
	}
	if len(s.Samples) != 4 || s.Samples[0] != 4 || s.Samples[3] != 2 {
		t.Errorf("Summarize kept samples %v, want them in the order given", s.Samples)
	}
}
