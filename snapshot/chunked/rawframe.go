package chunked

import (
	"encoding/binary"
	"math"
)

// Chunks that zstd cannot shrink are stored without being run through it: a
// zstd frame of raw blocks, which every zstd decoder reads like any other
// frame (the stored format does not change). Whether a chunk is worth trying
// is decided from a sample of its bytes (incompressible), as filesystems that
// compress do (btrfs samples and estimates the entropy for the same reason).
// On a sandbox's random memory (bench.BenchmarkStore's workload, encrypted
// or already compressed data) zstd's fastest level finds nothing and ends up
// writing raw blocks itself, after hashing and Huffman-coding every byte:
// about a third of a first commit's CPU (CPU profile of BenchmarkDiffCommit,
// label commit=first).

const (
	// sampleRuns runs of sampleRun bytes, spread over a chunk, are the
	// sample: 1,024 bytes whatever the chunk's size.
	sampleRuns = 128
	sampleRun  = 8
	// rawEntropy is the sampled order-0 entropy, in bits per byte, at or above
	// which a chunk is stored raw. Uniformly random bytes measure 7.82 ± 0.02 on
	// a sample of 1,024 bytes (the estimate is biased low by about
	// 255/(2·1024·ln 2)); a chunk at 7.6 could lose at most ~5% to an order-0
	// coder. What the sample cannot see is a chunk that repeats its own random
	// bytes (an LZ match within 64 KiB): it is stored raw, at worst twice its
	// compressed size.
	rawEntropy = 7.6
)

// nlog2n[c] is c·log2(c) for the counts a sample can hold.
var nlog2n = func() (t [sampleRuns*sampleRun + 1]float64) {
	for c := 2; c < len(t); c++ {
		t[c] = float64(c) * math.Log2(float64(c))
	}
	return t
}()

// incompressible reports whether data (a chunk: whole pages, at most
// maxChunk bytes) looks like random bytes: the entropy of its sample is at
// least rawEntropy. Chunks shorter than a page are never (their sample would
// be most of them).
func incompressible(data []byte) bool {
	if len(data) < pageSize {
		return false
	}
	var hist [256]uint16
	// An odd stride: the runs start at every offset within a cache line or a
	// struct, not only where a page-aligned array's random field lies.
	stride := ((len(data)-sampleRun)/(sampleRuns-1) - 1) | 1
	for i := 0; i < sampleRuns; i++ {
		for _, c := range data[i*stride : i*stride+sampleRun] {
			hist[c]++
		}
	}
	const n = sampleRuns * sampleRun
	var s float64
	for _, c := range hist {
		s += nlog2n[c]
	}
	return math.Log2(n)-s/n >= rawEntropy
}

// zstd frame layout (RFC 8878, section 3.1.1).
const (
	zstdMagic    = 0xFD2FB528
	rawFrameHead = 0xA0      // Frame_Header_Descriptor: Single_Segment, a 4-byte Frame_Content_Size
	rawBlockMax  = 128 << 10 // Block_Maximum_Size
)

// appendRawFrame appends to dst a zstd frame holding data in raw
// (uncompressed) blocks, with no checksum: 12 bytes more than data for a
// chunk. Any zstd decoder returns data from it.
func appendRawFrame(dst, data []byte) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, zstdMagic)
	dst = append(dst, rawFrameHead)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(data)))
	for {
		n := min(len(data), rawBlockMax)
		h := uint32(n) << 3 // Block_Type 0: raw
		if n == len(data) {
			h |= 1 // Last_Block
		}
		dst = append(dst, byte(h), byte(h>>8), byte(h>>16))
		dst = append(dst, data[:n]...)
		data = data[n:]
		if len(data) == 0 {
			return dst
		}
	}
}
