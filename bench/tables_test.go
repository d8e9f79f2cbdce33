package bench

import (
	"strings"
	"testing"
)

func TestWriteTablesTargets(t *testing.T) {
	raw := func(p50 float64) *Summary { return &Summary{P50: p50, N: 1} }
	for _, tc := range []struct {
		name    string
		results []Result
		want    []string
		notWant []string
	}{
		{
			name: "both sizes, fast",
			results: []Result{
				{WorkingSetMiB: 64, Resume: Summary{P50: 90, N: 1}, RawRestore: raw(150), RawCheckpoint: raw(80)},
				{WorkingSetMiB: 512, Resume: Summary{P50: 108, N: 1}, RawRestore: raw(300), RawCheckpoint: raw(300)},
			},
			want: []string{
				"target: resume p50 ≤ 0.7× raw (restore off the critical path): PASS (0.60×)",
				"target: resume p50 ≤ 0.7× raw (restore off the critical path): PASS (0.36×)",
				"resume p50 512 MiB / 64 MiB: 1.20× (raw restore: 2.00×)",
				"target: resume p50 of the largest working set ≤ 1.3× the smallest's: PASS (1.20×)",
			},
		},
		{
			name: "slow at the large size",
			results: []Result{
				{WorkingSetMiB: 512, Resume: Summary{P50: 400, N: 1}, RawRestore: raw(300), RawCheckpoint: raw(300)},
				{WorkingSetMiB: 64, Resume: Summary{P50: 160, N: 1}, RawRestore: raw(150), RawCheckpoint: raw(80)},
			},
			want: []string{
				"target: resume p50 ≤ 0.7× raw (restore off the critical path): MISS (1.33×)",
				"resume p50 512 MiB / 64 MiB: 2.50×",
				"the smallest's: MISS (2.50×)",
			},
		},
		{
			name:    "one size",
			results: []Result{{WorkingSetMiB: 64, Resume: Summary{P50: 90, N: 1}}},
			notWant: []string{"largest working set", "MiB / "},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b strings.Builder
			if err := WriteTables(&b, tc.results); err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(b.String(), w) {
					t.Errorf("missing %q in:\n%s", w, b.String())
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(b.String(), w) {
					t.Errorf("unexpected %q in:\n%s", w, b.String())
				}
			}
		})
	}
}
