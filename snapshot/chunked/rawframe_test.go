package chunked

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"os/exec"
	"testing"
)

// A raw frame decodes to its data through the store's zstd decoder, in one
// block and in several (data longer than a block), and through the reference
// zstd program where it is installed.
func TestRawFrameDecodes(t *testing.T) {
	s := newFSStore(t)
	for _, n := range []int{1, pageSize, maxChunk, 3*rawBlockMax + 17} {
		data := make([]byte, n)
		fill(data)
		frame := appendRawFrame([]byte("prefix"), data)
		if !bytes.HasPrefix(frame, []byte("prefix")) || len(frame) != len("prefix")+9+3*(n/rawBlockMax+1)+n {
			t.Fatalf("%d bytes: frame of %d bytes", n, len(frame))
		}
		frame = frame[len("prefix"):]
		got, err := s.dec.DecodeAll(frame, nil)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%d bytes: decoded %d bytes, err %v", n, len(got), err)
		}
		zstd, err := exec.LookPath("zstd")
		if err != nil {
			continue
		}
		cmd := exec.Command(zstd, "-d", "-c")
		cmd.Stdin = bytes.NewReader(frame)
		out, err := cmd.Output()
		if err != nil || !bytes.Equal(out, data) {
			t.Fatalf("%d bytes: zstd -d gave %d bytes, err %v", n, len(out), err)
		}
	}
}

// Random bytes are judged incompressible at every chunk size; text, base64,
// sparse pages and a page half random, half zero are not.
func TestIncompressible(t *testing.T) {
	rnd := func(n int) []byte { b := make([]byte, n); fill(b); return b }
	half := rnd(maxChunk)
	clear(half[maxChunk/2:])
	sparse := make([]byte, 4*pageSize)
	for i := 0; i < len(sparse); i += 64 {
		copy(sparse[i:], rnd(8))
	}
	text := bytes.Repeat([]byte("checkpoint state: sandbox heap, page tables and file descriptors\n"), 2000)[:maxChunk]
	b64 := []byte(base64.StdEncoding.EncodeToString(rnd(maxChunk))[:maxChunk])
	cases := []struct {
		name string
		data []byte
		want bool
	}{
		{"random page", rnd(pageSize), true},
		{"random 16 KiB", rnd(4 * pageSize), true},
		{"random 64 KiB", rnd(maxChunk), true},
		{"half random, half zero", half, false},
		{"sparse", sparse, false},
		{"text", text, false},
		{"base64", b64, false},
		{"shorter than a page", rnd(pageSize - 1), false},
	}
	for _, c := range cases {
		if got := incompressible(c.data); got != c.want {
			t.Errorf("%s: incompressible %v, want %v", c.name, got, c.want)
		}
	}
	// Over many random chunks none is sent to the compressor (the estimate's
	// spread is far from the threshold).
	for i := range 2000 {
		if d := rnd(pageSize * (1 + i%16)); !incompressible(d) {
			t.Fatalf("random chunk %d of %d bytes judged compressible", i, len(d))
		}
	}
}

// A commit stores random chunks raw (12 bytes of framing each) and compresses
// the others; its packs hold zstd frames the reference decoder reads, and the
// snapshot opens from them with the staged bytes, with and without a key.
func TestCommitStoresRandomChunksRaw(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		t.Run(fmt.Sprintf("key=%v", keyed), func(t *testing.T) {
			var k *Key
			if keyed {
				k = newKey(t)
			}
			s, err := New(ctx, Config{Dir: t.TempDir(), Key: k})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			files := firstCommitFiles()
			commit(t, s, "first", files)
			d, err := s.readDoc(ctx, "first")
			if err != nil {
				t.Fatal(err)
			}
			overhead := int64(12)
			if keyed {
				overhead += sealedChunkHeader + 16
			}
			var raw, compressed int
			var rawRef chunkRef
			for _, f := range d.Files {
				for _, c := range f.Chunks {
					switch {
					case c.ID == "":
					case c.Stored == c.Len+overhead:
						raw++
						rawRef = c
					case c.Stored < c.Len/2:
						compressed++
					}
				}
			}
			if raw < 1000 || compressed < 10 {
				t.Fatalf("%d chunks stored raw, %d compressed: want the random pages raw, the text compressed", raw, compressed)
			}
			if zstd, err := exec.LookPath("zstd"); err == nil && !keyed {
				c := rawRef
				s.idx.mu.Lock()
				loc := s.idx.known.locs[c.ID]
				s.idx.mu.Unlock()
				stored, err := readStored(ctx, s.b, c.ID, loc)
				if err != nil {
					t.Fatal(err)
				}
				cmd := exec.Command(zstd, "-d", "-c")
				cmd.Stdin = bytes.NewReader(stored)
				out, err := cmd.Output()
				if sum := sha256.Sum256(out); err != nil || hex.EncodeToString(sum[:]) != c.ID {
					t.Fatalf("chunk %s: zstd -d: %d bytes, err %v", c.ID, len(out), err)
				}
			}
			dropLocal(t, s)
			mustOpen(t, s, "first", files)
		})
	}
}
