package bench

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"sort"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Series is one latency distribution of a plot: its legend name and its samples
// in milliseconds.
type Series struct {
	Name    string
	Samples []float64
}

// PlotPanel is one panel of a plot: a title and the distributions drawn in it.
type PlotPanel struct {
	Title  string
	Series []Series
}

// Panels turns results into one panel per working set with the time to first
// request from each tier (paused, hibernated) and the raw `runsc restore`
// baseline of the same run, when they were measured. Series without samples
// are left out.
func Panels(results []Result) []PlotPanel {
	var out []PlotPanel
	for _, r := range results {
		p := PlotPanel{Title: fmt.Sprintf("working set %d MiB (memory %d MiB)", r.WorkingSetMiB, r.MemoryMiB)}
		add := func(name string, s *Summary) {
			if s != nil && len(s.Samples) > 0 {
				p.Series = append(p.Series, Series{Name: name, Samples: s.Samples})
			}
		}
		add("paused → first request", &r.Paused)
		add("hibernated → first request", &r.Resume)
		add("raw runsc restore → first answer", r.RawRestore)
		add(fmt.Sprintf("%d concurrent wakes → each answers", r.Wakes.N/DefaultWakeRounds), &r.Wakes)
		if len(p.Series) > 0 {
			out = append(out, p)
		}
	}
	return out
}

// Plot sizes: each panel is panelWidth × panelHeight.
const (
	panelWidth  = 6 * vg.Inch
	panelHeight = 4 * vg.Inch
)

// WritePlot draws panels side by side as a PNG at path: in each, the
// cumulative distribution of every series (x: milliseconds on a log scale,
// y: the fraction of runs at or below it), so tiers and the runsc baseline can
// be compared at every percentile. It returns an error when there is nothing to
// draw, a sample is not positive (a log axis cannot show it), or the file cannot
// be written.
func WritePlot(path string, panels []PlotPanel) error {
	if len(panels) == 0 {
		return errors.New("bench: plot: no measurements to draw")
	}
	rows := make([][]*plot.Plot, 1)
	for _, pn := range panels {
		p, err := cdfPlot(pn)
		if err != nil {
			return err
		}
		rows[0] = append(rows[0], p)
	}
	img := vgimg.New(panelWidth*vg.Length(len(panels)), panelHeight)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: len(panels), PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2}
	canvases := plot.Align(rows, tiles, dc)
	for i, p := range rows[0] {
		p.Draw(canvases[0][i])
	}
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("bench: plot: %w", err)
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: plot: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("bench: plot: write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("bench: plot: write %s: %w", path, err)
	}
	return nil
}

// plotColors are the series' colours, in order (a colour-blind-safe palette).
var plotColors = []color.RGBA{
	{0x00, 0x72, 0xb2, 0xff}, // blue
	{0xd5, 0x5e, 0x00, 0xff}, // vermilion
	{0x55, 0x55, 0x55, 0xff}, // grey
	{0x00, 0x9e, 0x73, 0xff}, // green
	{0xcc, 0x79, 0xa7, 0xff}, // purple
}

func cdfPlot(pn PlotPanel) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = pn.Title
	p.X.Label.Text = "time to first request (ms, log scale)"
	p.Y.Label.Text = "fraction of runs"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
	minX, maxX := math.Inf(1), math.Inf(-1)
	for i, s := range pn.Series {
		xy := make(plotter.XYs, 0, len(s.Samples))
		sorted := append([]float64(nil), s.Samples...)
		sort.Float64s(sorted)
		for j, v := range sorted {
			if !(v > 0) {
				return nil, fmt.Errorf("bench: plot: %s: sample %v ms cannot be drawn on a log scale", s.Name, v)
			}
			xy = append(xy, plotter.XY{X: v, Y: float64(j+1) / float64(len(sorted))})
		}
		minX, maxX = math.Min(minX, sorted[0]), math.Max(maxX, sorted[len(sorted)-1])
		line, points, err := plotter.NewLinePoints(xy)
		if err != nil {
			return nil, fmt.Errorf("bench: plot: %s: %w", s.Name, err)
		}
		c := plotColors[i%len(plotColors)]
		line.Color, line.Width = c, vg.Points(1.5)
		points.Color, points.Shape, points.Radius = c, draw.CircleGlyph{}, vg.Points(2)
		p.Add(line, points)
		p.Legend.Add(fmt.Sprintf("%s (p50 %.1f ms)", s.Name, Percentile(s.Samples, 50)), line, points)
	}
	// A little room on both sides of the log axis.
	p.X.Min, p.X.Max = minX/1.2, maxX*1.2
	return p, nil
}
