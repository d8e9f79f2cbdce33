package chunked

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// Diff commits without hashing what did not change.
//
// A diff hibernate's files are mostly the parent snapshot's bytes: 99.8% of a
// 512 MiB checkpoint after one request (README "Snapshot store"). Hashing every
// chunk with sha256 was 85% of such a commit's CPU (measured: 390 ms of chunking
// for 524 MB on 2 cores). When the parent's opened copy is on local disk, intact
// since this process verified or wrote it, each new chunk is instead looked up by
// its key (cut) among the parent's chunks and compared byte for byte
// with the parent's copy; an identical chunk takes the parent's chunk id. Only
// chunks that differ, or whose parent copy is not usable, are hashed. A byte
// comparison is exact, so the ids stay content addresses: no chunk is ever named
// by a fingerprint alone.

// fileStamp is what an opened copy's file looked like when this process last
// verified or wrote it.
type fileStamp struct {
	size  int64
	mtime time.Time
}

// stampCopy records the opened copy of snapshot id as verified now.
func (s *Store) stampCopy(id string, d doc) {
	stamps := map[string]fileStamp{}
	for _, fc := range d.Files {
		st, err := os.Stat(filepath.Join(s.opened(id), fc.Name))
		if err != nil {
			return
		}
		stamps[fc.Name] = fileStamp{st.Size(), st.ModTime()}
	}
	s.docMu.Lock()
	defer s.docMu.Unlock()
	if s.stamps == nil {
		s.stamps = map[string]map[string]fileStamp{}
	}
	s.stamps[id] = stamps
}

func (s *Store) forgetCopy(id string) {
	s.docMu.Lock()
	defer s.docMu.Unlock()
	delete(s.stamps, id)
}

// parentCopy is a parent snapshot's opened copy, mapped read-only, with its
// chunks indexed by key.
type parentCopy struct {
	files map[string]*parentFile
}

type parentFile struct {
	data  []byte // mmap of the opened copy's file
	index map[uint64][]parentChunk
}

type parentChunk struct {
	off int64
	ref chunkRef
}

// openParent returns the parent's copy, or nil when it cannot be trusted or
// used: no chunk keys for it in memory (committed or opened before this process
// started), a file changed since it was verified, or a failed mmap.
func (s *Store) openParent(parent string) *parentCopy {
	if parent == "" {
		return nil
	}
	d, ok := s.cachedDoc(parent)
	s.docMu.Lock()
	stamps := s.stamps[parent]
	s.docMu.Unlock()
	if !ok || d.keys == nil || stamps == nil {
		return nil
	}
	p := &parentCopy{files: map[string]*parentFile{}}
	for i, fc := range d.Files {
		pf := p.mapFile(filepath.Join(s.opened(parent), fc.Name), stamps[fc.Name])
		if pf == nil {
			continue
		}
		var off int64
		for j, r := range fc.Chunks {
			if r.ID != "" && off+r.Len <= int64(len(pf.data)) {
				k := d.keys[i][j]
				pf.index[k] = append(pf.index[k], parentChunk{off, r})
			}
			off += r.Len
		}
		p.files[fc.Name] = pf
	}
	if len(p.files) == 0 {
		return nil
	}
	return p
}

func (p *parentCopy) mapFile(path string, want fileStamp) *parentFile {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() != want.size || !st.ModTime().Equal(want.mtime) || st.Size() == 0 {
		return nil
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(st.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil
	}
	return &parentFile{data: data, index: map[uint64][]parentChunk{}}
}

// match returns the parent's chunk whose bytes equal data, if there is one.
func (p *parentCopy) match(file string, key uint64, data []byte) (chunkRef, bool) {
	if p == nil {
		return chunkRef{}, false
	}
	pf := p.files[file]
	if pf == nil {
		return chunkRef{}, false
	}
	for _, c := range pf.index[key] {
		if c.ref.Len == int64(len(data)) && bytes.Equal(pf.data[c.off:c.off+c.ref.Len], data) {
			return c.ref, true
		}
	}
	return chunkRef{}, false
}

func (p *parentCopy) close() {
	if p == nil {
		return
	}
	for _, pf := range p.files {
		_ = syscall.Munmap(pf.data)
	}
}

// unmapLater unmaps a commit's mappings (the parent's copy and the staged
// files) on another goroutine, once nothing refers to them: tearing down the
// page tables of two ~76 MiB mappings took 2–4 ms of a 64 MiB diff commit's
// ~45 ms (CPU profile of bench.BenchmarkStore, 2026-11-30), time the
// hibernate's answer need not wait for.
func unmapLater(par *parentCopy, mapped [][]byte) {
	if par == nil && len(mapped) == 0 {
		return
	}
	go func() {
		par.close()
		for _, b := range mapped {
			_ = syscall.Munmap(b)
		}
	}()
}
