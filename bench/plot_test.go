package bench

import (
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWritePlot(t *testing.T) {
	raw := Summarize([]float64{150, 140, 160, 155})
	results := []Result{
		{WorkingSetMiB: 64, MemoryMiB: 512, Resume: Summarize([]float64{160, 170, 150}),
			Paused: Summarize([]float64{7.5, 8, 9}), RawRestore: &raw},
		{WorkingSetMiB: 512, MemoryMiB: 1536, Resume: Summarize([]float64{360, 380})},
	}
	panels := Panels(results)
	if len(panels) != 2 || len(panels[0].Series) != 3 || len(panels[1].Series) != 1 {
		t.Fatalf("Panels = %+v, want 3 series then 1 (no paused or raw samples at 512 MiB)", panels)
	}
	path := filepath.Join(t.TempDir(), "sub", "resume.png")
	if err := WritePlot(path, panels); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("the plot is not a PNG: %v", err)
	}
	// Two panels side by side: twice as wide as high, plus or minus rounding.
	b := img.Bounds()
	if b.Dx() < 2*b.Dy() || b.Dx() > 4*b.Dy() {
		t.Errorf("plot is %dx%d, want two 6x4 panels side by side", b.Dx(), b.Dy())
	}
}

func TestWritePlotRefuses(t *testing.T) {
	dir := t.TempDir()
	if err := WritePlot(filepath.Join(dir, "a.png"), nil); err == nil || !strings.Contains(err.Error(), "no measurements") {
		t.Errorf("empty plot: err = %v", err)
	}
	bad := []PlotPanel{{Title: "x", Series: []Series{{Name: "zero", Samples: []float64{0, 1}}}}}
	if err := WritePlot(filepath.Join(dir, "b.png"), bad); err == nil || !strings.Contains(err.Error(), "log scale") {
		t.Errorf("zero sample: err = %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "b.png")); err == nil {
		t.Error("a refused plot left a file")
	}
}
