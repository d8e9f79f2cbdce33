package chunked

import (
	"encoding/binary"

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
// objects per GiB. Cutting after a page whose hash is ≡ 3 (mod 4) — so chunks
// are whole pages, 16 KiB on average, at most 64 KiB — re-synchronises right after
// an insertion: 3.97% of the bytes were new (2.95 MiB), against 1.02% for 4 KiB
// chunks and 100% for any fixed size above a page. See README "Snapshot store".
//
// The page hash is the page's XXH3-128 (pageKey), and a chunk's key is the
// XXH3-128 of its pages' hashes (fingerprint): one pass over the bytes both cuts
// and keys a chunk. Until 2026-12-01 the cut used each page's CRC-32C and the
// key a second pass of XXH3-128 over the chunk: 6.7 ms for CRC-32C against
// 3.2 ms for XXH3-128 over 80 MiB of pages on one core here
// (BenchmarkFingerprint), in a commit that reads every page of the checkpoint.
// Manifests of that chunking say "page-cdc-crc32c-4-16"; their chunks are read
// the same way, and a diff commit on such a parent finds its unchanged chunks
// only where the two rules cut alike.
const (
	pageSize    = 4096
	cutModulus  = 4  // a chunk ends after a page whose pageKey's Lo % cutModulus == cutModulus-1
	maxPages    = 16 // … or after this many pages
	maxChunk    = maxPages * pageSize
	chunkingTag = "page-cdc-xxh3-4-16" // recorded in manifests
)

// chunkSum is a chunk's key (fingerprint) or a page's hash (pageKey): an
// XXH3-128 (github.com/zeebo/xxh3).
type chunkSum = xxh3.Uint128

// pageKey returns the XXH3-128 of page p (pageSize bytes, or fewer for a
// file's trailing partial page).
func pageKey(p []byte) chunkSum { return xxh3.Hash128(p) }

// cutsAfter says whether a page with hash k ends the chunk it is in.
func cutsAfter(k chunkSum) bool { return k.Lo%cutModulus == cutModulus-1 }

// cut returns the length of the chunk that starts at data[0] and its key
// (fingerprint): whole pages up to and including the first whose pageKey cuts
// (cutsAfter), at most maxPages; a trailing partial page (fewer than pageSize
// bytes left) ends the chunk it falls in, or is a chunk of its own. data must
// not be empty. Each byte is read once.
func cut(data []byte) (int, chunkSum) {
	var sums [maxPages * 16]byte
	n, k := 0, 0
	for pages := 0; pages < maxPages; pages++ {
		end := min(n+pageSize, len(data))
		pk := pageKey(data[n:end])
		putSum(sums[k:], pk)
		k += 16
		partial := end-n < pageSize
		n = end
		if partial || n == len(data) || cutsAfter(pk) {
			break
		}
	}
	return n, xxh3.Hash128(sums[:k])
}

// fingerprint returns chunk b's key: the XXH3-128 of the XXH3-128s of its
// pages (the last one possibly partial), each as 16 bytes (Hi then Lo,
// little-endian). It equals the key cut returns for the same bytes. Two
// different chunks have equal keys with probability about 2^-128 per pair; it
// is the strong checksum rsync (3.2+) compares blocks with, applied twice. It
// is not a cryptographic hash: see parent.go for what the store trusts it with.
func fingerprint(b []byte) chunkSum {
	var sums [(maxPages + 1) * 16]byte
	buf := sums[:0]
	for off := 0; off < len(b); off += pageSize {
		buf = append(buf, make([]byte, 16)...)
		putSum(buf[len(buf)-16:], pageKey(b[off:min(off+pageSize, len(b))]))
	}
	return xxh3.Hash128(buf)
}

// putSum writes k into dst[:16]: Hi then Lo, little-endian.
func putSum(dst []byte, k chunkSum) {
	binary.LittleEndian.PutUint64(dst, k.Hi)
	binary.LittleEndian.PutUint64(dst[8:], k.Lo)
}

// segmentSpan is the nominal length in bytes of the segments a commit's workers
// chunk in parallel: 4 MiB makes 19 segments of a 64 MiB sandbox's 76 MiB
// pages.img, enough to keep two to sixteen workers busy to the end.
const segmentSpan = 4 << 20

// segments returns the offsets that split data into segments which, chunked
// separately with cut, give exactly the chunks (and keys) of one pass of cut
// from offset 0: 0; then, for each multiple of span (span is rounded up to
// whole pages), the end of the first whole page at or after it, and before the
// next multiple, that is a cut point (cutsAfter), if any; then len(data).
//
// Why the result is exact: a whole page that cutsAfter ends the chunk
// that contains it, wherever that chunk began (cut stops there unless it
// stopped earlier at maxPages, and then the next chunk contains the page), so
// a pass restarted after such a page produces what the single pass produces
// from there on. Chunks never straddle a returned offset.
func segments(data []byte, span int) []int {
	span = (max(span, 1) + pageSize - 1) / pageSize * pageSize
	bounds := []int{0}
	for nominal := span; nominal+pageSize <= len(data); nominal += span {
		for p := nominal; p < nominal+span && p+pageSize <= len(data); p += pageSize {
			if cutsAfter(pageKey(data[p : p+pageSize])) {
				if p+pageSize < len(data) {
					bounds = append(bounds, p+pageSize)
				}
				break
			}
		}
	}
	return append(bounds, len(data))
}

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
