package chunked

import (
	"fmt"
	"slices"
	"testing"
)

type cutChunk struct {
	off, n int
	key    chunkSum
}

// onePass chunks data[start:end] with cut from start, as commits did before
// segments.
func onePass(data []byte, start, end int) []cutChunk {
	var out []cutChunk
	for off := start; off < end; {
		n, key := cut(data[off:end])
		if want := fingerprint(data[off : off+n]); key != want {
			panic(fmt.Sprintf("chunk at %d: cut's key %x, fingerprint %x", off, key, want))
		}
		out = append(out, cutChunk{off, n, key})
		off += n
	}
	return out
}

// Chunking a file's segments separately gives exactly the chunks and keys of
// one pass over the whole file, whatever the span: the property the parallel
// commit rests on.
func TestSegmentsChunkAsOnePass(t *testing.T) {
	img := append(memImage(2000), make([]byte, 1234)...) // a trailing partial page
	fill(img[len(img)-1234:])
	// 200 zero pages, then 100 pages none of which is a cut point: chunks of
	// maxPages there, and no segment boundary until the run ends.
	clear(img[100*pageSize : 300*pageSize])
	for p := 600; p < 700; p++ {
		page := img[p*pageSize : (p+1)*pageSize]
		for cutsAfter(pageKey(page)) {
			fill(page)
		}
	}
	cases := map[string][]byte{
		"image":            img,
		"whole pages":      img[:1500*pageSize],
		"shorter than one": img[len(img)-1000:],
		"one page":         img[:pageSize],
	}
	for name, data := range cases {
		want := onePass(data, 0, len(data))
		for _, span := range []int{1, pageSize, 3 * pageSize, 5*pageSize + 7, 64 << 10, 1 << 20, segmentSpan} {
			b := segments(data, span)
			if b[0] != 0 || b[len(b)-1] != len(data) || !slices.IsSorted(b) {
				t.Fatalf("%s span %d: bounds %v", name, span, b)
			}
			var got []cutChunk
			for i := 0; i+1 < len(b); i++ {
				if b[i] >= b[i+1] {
					t.Fatalf("%s span %d: empty segment at %d", name, span, b[i])
				}
				got = append(got, onePass(data, b[i], b[i+1])...)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("%s span %d: %d segments give %d chunks, one pass %d (or different ones)", name, span, len(b)-1, len(got), len(want))
			}
			if name == "image" && span == 3*pageSize && len(b) < 200 {
				t.Fatalf("%s span %d: only %d segments", name, span, len(b)-1)
			}
		}
	}
}
