package snapshot

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/zeebo/xxh3"
)

// Resume-time verification.
//
// A resume must prove a snapshot's files intact before the engine reads them,
// and it is on the resume's critical path: with sha256 (SHA-NI, ~1.7 GB/s per
// core here) checking a 524 MiB memory file took 150–155 ms on 2 cores, a third
// of a 512 MiB resume (measured 2026-11-30, README "Performance"). XXH3-128
// (github.com/zeebo/xxh3, AVX2) checks the same file in ~20 ms. What the check
// guards against is accidental damage: a flipped bit, a truncated or partly
// written file, a file from another snapshot. A 128-bit XXH3 detects these with
// a miss probability of about 2^-128. It is no defence against someone who can
// write the data directory, but neither is sha256 there: the manifest beside the
// files can be rewritten too. Manifests keep the sha256 of every file, which
// `torpor snapshot verify` checks.

// BlockSumBytes is the block size of BlockSums: 16 MiB, so that a 512 MiB file
// is checked as 32 blocks spread over all cores.
const BlockSumBytes = 16 << 20

// BlockSums returns the XXH3-128 sum (32 lowercase hex digits) of every
// BlockSumBytes-long block of the size-byte file at path, the last block
// shorter, computed on all cores. Errors: the file's open or read errors, and
// ctx's error.
func BlockSums(ctx context.Context, path string, size int64) ([]string, error) {
	n := int((size + BlockSumBytes - 1) / BlockSumBytes)
	out := make([]string, n)
	errs := make([]error, n)
	forEachBlock(n, func(b int) {
		if errs[b] = ctx.Err(); errs[b] == nil {
			off := int64(b) * BlockSumBytes
			out[b], errs[b] = blockSum(path, off, min(BlockSumBytes, size-off))
		}
	})
	return out, errors.Join(errs...)
}

// VerifyBlockSums checks file f of snapshot id, in dir, against f.BlockXXH3 on
// all cores. It returns *CorruptError naming the file and the first bad block
// when the file is missing, has a size other than f.Bytes, or a block's sum
// differs; other errors are read errors or ctx's.
func VerifyBlockSums(ctx context.Context, id, dir string, f File) error {
	path := filepath.Join(dir, f.Name)
	st, err := os.Stat(path)
	if err != nil {
		return &CorruptError{Snapshot: id, File: f.Name, Reason: "missing"}
	}
	if st.Size() != f.Bytes {
		return &CorruptError{Snapshot: id, File: f.Name, Reason: fmt.Sprintf("size %d != %d", st.Size(), f.Bytes)}
	}
	bs := f.BlockBytes
	if bs <= 0 {
		return &CorruptError{Snapshot: id, File: f.Name, Reason: "manifest has block sums without a block size"}
	}
	if want := (f.Bytes + bs - 1) / bs; int64(len(f.BlockXXH3)) != want {
		return &CorruptError{Snapshot: id, File: f.Name, Reason: fmt.Sprintf("manifest lists %d blocks, size needs %d", len(f.BlockXXH3), want)}
	}
	errs := make([]error, len(f.BlockXXH3))
	forEachBlock(len(f.BlockXXH3), func(b int) {
		if errs[b] = ctx.Err(); errs[b] != nil {
			return
		}
		off := int64(b) * bs
		n := min(bs, f.Bytes-off)
		got, err := blockSum(path, off, n)
		switch {
		case err != nil:
			errs[b] = fmt.Errorf("snapshot %s: verify %s: %w", id, f.Name, err)
		case got != f.BlockXXH3[b]:
			errs[b] = &CorruptError{Snapshot: id, File: f.Name,
				Reason: fmt.Sprintf("xxh3 mismatch in block %d (bytes %d–%d): want %s, got %s", b, off, off+n, f.BlockXXH3[b], got)}
		}
	})
	for _, err := range errs {
		var ce *CorruptError
		if errors.As(err, &ce) {
			return err
		}
	}
	return errors.Join(errs...)
}

// forEachBlock runs fn(0..n-1) on GOMAXPROCS goroutines.
func forEachBlock(n int, fn func(b int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for b := 0; b < n; b++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(b)
		}()
	}
	wg.Wait()
}

// blockSum returns the hex XXH3-128 of n bytes of path at off.
func blockSum(path string, off, n int64) (string, error) {
	return SumRange(path, off, n, xxh3.New128())
}

// SumRange returns h's sum, in lowercase hex, of the n bytes of the file at path
// starting at byte off. Errors: the open and read errors, and a short read when
// the file ends before off+n.
func SumRange(path string, off, n int64, h hash.Hash) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if k, err := io.Copy(h, io.NewSectionReader(f, off, n)); err != nil {
		return "", err
	} else if k != n {
		return "", fmt.Errorf("%s: %d bytes at %d: short read (%d)", path, n, off, k)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
