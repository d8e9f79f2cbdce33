package chunked

import (
	"hash/crc32"

	"github.com/zeebo/xxh3"
)

// Chunking: page-aligned content-defined chunks.
//
// gVisor's pages.img is a sequence of 4 KiB pages whose order is stable between
// checkpoints, but pages are inserted when the sandbox maps memory, which shifts
// everything after the insertion. Measured on two checkpoints of the reference
// workload (64 MiB Python server, one request between, 77.7 MB pages.img that
// grew by 7 pages): fixed 16 KiB–2 MiB chunks found 0% of the second file in the
// first (every chunk shifted); fixed 4 KiB chunks found 99%, but mean 250 k
// objects per GiB. Cutting after a page whose CRC-32C is ≡ 3 (mod 4) — so chunks
// are whole pages, 16 KiB on average, at most 64 KiB — re-synchronises right after
// an insertion: 3.97% of the bytes were new (2.95 MiB), against 1.02% for 4 KiB
// chunks and 100% for any fixed size above a page. See README "Snapshot store".
const (
	pageSize    = 4096
	cutModulus  = 4  // a chunk ends after a page whose crc32c % cutModulus == cutModulus-1
	maxPages    = 16 // … or after this many pages
	maxChunk    = maxPages * pageSize
	chunkingTag = "page-cdc-crc32c-4-16" // recorded in manifests
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// cut returns the length of the chunk that starts at data[0]: whole pages up
// to and including the first whose CRC-32C ≡ cutModulus-1 (mod cutModulus), at
// most maxPages; a trailing partial page (fewer than pageSize bytes left) ends
// the chunk it falls in, or is a chunk of its own. data must not be empty.
func cut(data []byte) int {
	n := 0
	for pages := 0; pages < maxPages; pages++ {
		if len(data)-n < pageSize {
			return len(data)
		}
		crc := crc32.Checksum(data[n:n+pageSize], castagnoli)
		n += pageSize
		if crc%cutModulus == cutModulus-1 {
			break
		}
	}
	return n
}

// segmentSpan is the nominal length in bytes of the segments a commit's workers
// chunk in parallel: 4 MiB makes 19 segments of a 64 MiB sandbox's 76 MiB
// pages.img, enough to keep two to sixteen workers busy to the end.
const segmentSpan = 4 << 20

// segments returns the offsets that split data into segments which, chunked
// separately with cut, give exactly the chunks (and keys) of one pass of cut
// from offset 0: 0; then, for each multiple of span (span is rounded up to
// whole pages), the end of the first whole page at or after it, and before the
// next multiple, whose CRC-32C is a cut point, if any; then len(data).
//
// Why the result is exact: a page whose CRC-32C ≡ cutModulus-1 ends the chunk
// that contains it, wherever that chunk began (cut stops there unless it
// stopped earlier at maxPages, and then the next chunk contains the page), so
// a pass restarted after such a page produces what the single pass produces
// from there on. Chunks never straddle a returned offset.
func segments(data []byte, span int) []int {
	span = (max(span, 1) + pageSize - 1) / pageSize * pageSize
	bounds := []int{0}
	for nominal := span; nominal+pageSize <= len(data); nominal += span {
		for p := nominal; p < nominal+span && p+pageSize <= len(data); p += pageSize {
			if crc32.Checksum(data[p:p+pageSize], castagnoli)%cutModulus == cutModulus-1 {
				if p+pageSize < len(data) {
					bounds = append(bounds, p+pageSize)
				}
				break
			}
		}
	}
	return append(bounds, len(data))
}

// chunkSum is a chunk's fingerprint: its XXH3-128 (github.com/zeebo/xxh3).
type chunkSum = xxh3.Uint128

// fingerprint returns chunk b's key, XXH3-128 of its bytes: ~0.6 ms per 64 MiB
// on one core here when computed right after cut, with the chunk in cache
// (BenchmarkFingerprint), against ~7 ms for cutting. Two different chunks have
// equal keys with probability 2^-128; it is the strong checksum rsync (3.2+)
// compares blocks with. It is not a cryptographic hash: see parent.go for what
// the store trusts it with.
func fingerprint(b []byte) chunkSum { return xxh3.Hash128(b) }

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

var zeroChunk = make([]byte, maxChunk+pageSize)

// zeroKey is fingerprint of n zero bytes (an all-zero chunk, not stored).
func zeroKey(n int64) chunkSum {
	if n <= int64(len(zeroChunk)) {
		return fingerprint(zeroChunk[:n])
	}
	return fingerprint(make([]byte, n))
}
