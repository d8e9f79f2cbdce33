package chunked

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
)

// How a cold open reads (assemble, runFetch): the chunks of a file are grouped
// into fetches, runs of neighbouring chunks of one pack that one ranged read
// returns, of up to fetchSpan bytes (a whole pack: packTarget) or fetchMax
// chunks. Config.Workers fetches run at once (default 4 on local disk, where
// reads come from the page cache or one device and a few saturate the 2–4
// cores that then decompress and hash; 16 on S3, where each ranged GET waits
// on a round trip and the server: 512 MiB is ~64 GETs, four rounds). Each
// fetch reads into a pooled buffer and decodes its chunks side by side into
// another, then writes each run of chunks that are neighbours in the file with
// one write, so a cold open makes one read and a few writes per pack instead
// of a zeroed allocation per read, one per chunk and a write per chunk (16 KiB
// on average). Memory in flight: Workers × (fetchSpan + decoded bytes).
const (
	fetchSpan = packTarget
	fetchMax  = 512
)

// rangeReader is a Backend that reads a range into the caller's buffer (FS,
// S3): len(buf) bytes of object key from byte offset off, io.ErrUnexpectedEOF
// (wrapped) when the object is shorter, fs.ErrNotExist when it is missing.
type rangeReader interface {
	GetRangeInto(ctx context.Context, key string, off int64, buf []byte) error
}

// GetRangeInto implements rangeReader with one ReadAt.
func (b *FS) GetRangeInto(ctx context.Context, key string, off int64, buf []byte) error {
	p, err := b.path(key)
	if err != nil {
		return err
	}
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.ReadAt(buf, off); err != nil {
		if errors.Is(err, io.EOF) {
			err = fmt.Errorf("%s: bytes %d-%d: %w", key, off, off+int64(len(buf)), io.ErrUnexpectedEOF)
		}
		return err
	}
	return nil
}

// fetchBufs holds the buffers of fetches: a pack span read, or a fetch's
// decoded chunks. Buffers of up to fetchSpan + maxChunk come from it; a larger
// need (a run of chunks that compress well) is allocated and dropped.
var fetchBufs = sync.Pool{New: func() any { b := make([]byte, 0, fetchSpan+maxChunk); return &b }}

// getFetchBuf returns a buffer of n bytes (not cleared) and its release.
func getFetchBuf(n int64) ([]byte, func()) {
	if n > fetchSpan+maxChunk {
		return make([]byte, n), func() {}
	}
	p := fetchBufs.Get().(*[]byte)
	return (*p)[:n], func() { fetchBufs.Put(p) }
}

// readSpan reads n bytes of object key of tier b from off into a pooled
// buffer when b can (rangeReader), else with GetRange; release returns the
// buffer once nothing uses the bytes.
func readSpan(ctx context.Context, b Backend, key string, off, n int64) (span []byte, release func(), err error) {
	rr, ok := b.(rangeReader)
	if !ok {
		span, err = b.GetRange(ctx, key, off, n)
		return span, func() {}, err
	}
	span, release = getFetchBuf(n)
	if err := rr.GetRangeInto(ctx, key, off, span); err != nil {
		release()
		return nil, nil, err
	}
	return span, release, nil
}

// writeRuns writes the chunks of ft (out[i] at file offset ft.offs[i]) to
// ft.f, one write per run of chunks that are neighbours both in the file and
// in dec, where chunk i was decoded at pos[i] (a chunk read some other way,
// from another copy, is written alone).
func writeRuns(ft *fetch, out [][]byte, dec []byte, pos []int64) error {
	inDec := func(i int) bool { return len(out[i]) > 0 && &out[i][0] == &dec[pos[i]] }
	for i := 0; i < len(out); {
		j, end := i+1, ft.offs[i]+int64(len(out[i]))
		if inDec(i) {
			for j < len(out) && inDec(j) && ft.offs[j] == end && pos[j] == pos[j-1]+int64(len(out[j-1])) {
				end += int64(len(out[j]))
				j++
			}
		}
		b := out[i]
		if j > i+1 {
			b = dec[pos[i] : pos[i]+end-ft.offs[i]]
		}
		if _, err := ft.f.WriteAt(b, ft.offs[i]); err != nil {
			return err
		}
		i = j
	}
	return nil
}
