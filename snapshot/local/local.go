// Package local is the plain snapshot store on a local directory (`torpor serve
// --store plain`): each snapshot kept as the engine's files. The default for a
// new data directory is the chunked store (package snapshot/chunked).
//
// Layout under the store's directory:
//
//	<id>/manifest.json   the commit record; written last (temp file, fsync, rename)
//	<id>/<file>          the engine's checkpoint files
//	.staging/<id>/       a snapshot being written; never opened
//
// Commit renames the staging directory to <id> only after every file and the
// manifest are synced, so a directory named <id> with a manifest is a complete
// snapshot, and anything else is debris that Recover removes.
package local

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"sync"

	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/snapshot"
)

// Store implements snapshot.Store on a directory.
type Store struct {
	dir string
}

var _ snapshot.Store = (*Store)(nil)
var _ snapshot.Verifier = (*Store)(nil)

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)

// New opens (creating if needed) a store in dir.
func New(dir string) (*Store, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(abs, ".staging"), 0o700); err != nil {
		return nil, fmt.Errorf("snapshot store %s: %w", abs, err)
	}
	return &Store{dir: abs}, nil
}

func (s *Store) staged(id string) string { return filepath.Join(s.dir, ".staging", id) }
func (s *Store) final(id string) string  { return filepath.Join(s.dir, id) }

func checkID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("snapshot id %q: invalid", id)
	}
	return nil
}

// Stage implements snapshot.Store.
// StagedDir is the directory Stage makes for snapshot id, whether or not it
// exists; Recover removes every entry of its parent.
func (s *Store) StagedDir(id string) string { return s.staged(id) }

func (s *Store) Stage(ctx context.Context, id string) (string, error) {
	if err := checkID(id); err != nil {
		return "", err
	}
	if _, err := os.Stat(s.final(id)); err == nil {
		return "", fmt.Errorf("snapshot %s: already committed", id)
	}
	if err := os.Mkdir(s.staged(id), 0o700); err != nil {
		return "", fmt.Errorf("snapshot %s: stage: %w", id, err)
	}
	return s.staged(id), nil
}

// Commit implements snapshot.Store.
func (s *Store) Commit(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
	if err := checkID(id); err != nil {
		return m, err
	}
	if m.ID != id {
		return m, fmt.Errorf("snapshot %s: manifest id %q differs", id, m.ID)
	}
	dir := s.staged(id)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() && e.Name() != "manifest.json" {
			names = append(names, e.Name())
		}
	}
	if len(names) == 0 {
		return m, fmt.Errorf("snapshot %s: commit: no files staged", id)
	}
	sort.Strings(names)
	// The block sums a resume checks (snapshot.BlockSums, XXH3: ~20 ms for
	// 512 MiB) are computed beside the whole-file sha256s.
	blocks := make([][]string, len(names))
	blockErrs := make([]error, len(names))
	var bwg sync.WaitGroup
	for i, n := range names {
		st, err := os.Stat(filepath.Join(dir, n))
		if err != nil {
			blockErrs[i] = err
			continue
		}
		bwg.Add(1)
		go func() {
			defer bwg.Done()
			blocks[i], blockErrs[i] = snapshot.BlockSums(ctx, filepath.Join(dir, n), st.Size())
		}()
	}
	files, err := hashAll(ctx, dir, names, true)
	bwg.Wait()
	if err == nil {
		err = errors.Join(blockErrs...)
	}
	if err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	for i := range files {
		files[i].BlockBytes, files[i].BlockXXH3 = snapshot.BlockSumBytes, blocks[i]
	}
	m.Files, m.Bytes = files, 0
	for _, f := range files {
		m.Bytes += f.Bytes
	}
	// Every byte is stored, once, by this snapshot.
	m.LogicalBytes, m.StoredBytes, m.NewBytes = m.Bytes, m.Bytes, m.Bytes
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return m, err
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o600); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	if err := os.Rename(dir, s.final(id)); err != nil {
		return m, fmt.Errorf("snapshot %s: commit: %w", id, err)
	}
	if err := atomicfile.SyncDir(s.dir); err != nil {
		return m, err
	}
	return m, nil
}

// Abort implements snapshot.Store.
func (s *Store) Abort(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	return os.RemoveAll(s.staged(id))
}

// Manifest implements snapshot.Store.
func (s *Store) Manifest(ctx context.Context, id string) (snapshot.Manifest, error) {
	var m snapshot.Manifest
	if err := checkID(id); err != nil {
		return m, err
	}
	b, err := os.ReadFile(filepath.Join(s.final(id), "manifest.json"))
	if errors.Is(err, os.ErrNotExist) {
		return m, fmt.Errorf("snapshot %s: %w", id, snapshot.ErrNotFound)
	}
	if err != nil {
		return m, fmt.Errorf("snapshot %s: %w", id, err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: err.Error()}
	}
	for _, f := range m.Files {
		// Open and Verify read each file at dir/<name>: a name must not lead
		// elsewhere ("../other/pages.img") or to the directory itself.
		if f.Name == "" || f.Name == "." || f.Name == ".." || strings.ContainsAny(f.Name, "/\x00") {
			return m, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: fmt.Sprintf("file name %q is not a name in the snapshot's directory", f.Name)}
		}
	}
	return m, nil
}

// Open implements snapshot.Store. Files are hashed in parallel (one goroutine per
// file, at most 4) so verification costs about one read of the largest file.
func (s *Store) Open(ctx context.Context, id string) (string, snapshot.Manifest, error) {
	m, err := s.Manifest(ctx, id)
	if err != nil {
		return "", m, err
	}
	dir := s.final(id)
	if err := checkSizes(id, dir, m.Files); err != nil {
		return "", m, err
	}
	var legacy []snapshot.File
	for _, f := range m.Files {
		if len(f.BlockXXH3) == 0 {
			legacy = append(legacy, f)
		} else if err := snapshot.VerifyBlockSums(ctx, id, dir, f); err != nil {
			return "", m, err
		}
	}
	if err := verifyBlocks(ctx, id, dir, legacy); err != nil {
		return "", m, err
	}
	return dir, m, nil
}

// Verify checks every file of snapshot id against the sha256 its manifest
// records (a whole pass over each file; a resume checks the cheaper block sums
// instead, see snapshot.BlockSums). Errors: snapshot.ErrNotFound; a
// *snapshot.CorruptError naming the file when one is missing, has the wrong size
// or the wrong sha256; read errors.
func (s *Store) Verify(ctx context.Context, id string) (snapshot.Manifest, error) {
	m, err := s.Manifest(ctx, id)
	if err != nil {
		return m, err
	}
	if err := checkSizes(id, s.final(id), m.Files); err != nil {
		return m, err
	}
	whole := make([]snapshot.File, len(m.Files))
	for i, f := range m.Files {
		whole[i] = snapshot.File{Name: f.Name, Bytes: f.Bytes, SHA256: f.SHA256}
	}
	return m, verifyBlocks(ctx, id, s.final(id), whole)
}

// checkSizes returns a *snapshot.CorruptError for the first of files that is
// missing from dir or whose size differs from its manifest entry.
func checkSizes(id, dir string, files []snapshot.File) error {
	for _, f := range files {
		st, err := os.Stat(filepath.Join(dir, f.Name))
		if err != nil {
			return &snapshot.CorruptError{Snapshot: id, File: f.Name, Reason: "missing"}
		}
		if st.Size() != f.Bytes {
			return &snapshot.CorruptError{Snapshot: id, File: f.Name, Reason: fmt.Sprintf("size %d != %d", st.Size(), f.Bytes)}
		}
	}
	return nil
}

// verifyBlocks checks every file against its manifest entry's sha256s, block by
// block on all cores (manifests written before snapshot.File.BlockXXH3); files
// recorded without blocks are hashed whole.
func verifyBlocks(ctx context.Context, id, dir string, files []snapshot.File) error {
	type job struct {
		f     snapshot.File
		block int // -1: whole file
	}
	var jobs []job
	for _, f := range files {
		if len(f.Blocks) == 0 || f.BlockBytes <= 0 {
			jobs = append(jobs, job{f, -1})
			continue
		}
		if want := (f.Bytes + f.BlockBytes - 1) / f.BlockBytes; int64(len(f.Blocks)) != want {
			return &snapshot.CorruptError{Snapshot: id, File: f.Name, Reason: fmt.Sprintf("manifest lists %d blocks, size needs %d", len(f.Blocks), want)}
		}
		for b := range f.Blocks {
			jobs = append(jobs, job{f, b})
		}
	}
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			path := filepath.Join(dir, j.f.Name)
			if j.block < 0 {
				got, err := hashFile(ctx, path, false)
				if err != nil {
					errs[i] = fmt.Errorf("snapshot %s: verify: %w", id, err)
				} else if got.SHA256 != j.f.SHA256 {
					errs[i] = &snapshot.CorruptError{Snapshot: id, File: j.f.Name,
						Reason: fmt.Sprintf("sha256 mismatch: want %s, got %s", j.f.SHA256, got.SHA256)}
				}
				return
			}
			off := int64(j.block) * j.f.BlockBytes
			got, err := snapshot.SumRange(path, off, min(j.f.BlockBytes, j.f.Bytes-off), sha256.New())
			if err != nil {
				errs[i] = fmt.Errorf("snapshot %s: verify: %w", id, err)
			} else if got != j.f.Blocks[j.block] {
				errs[i] = &snapshot.CorruptError{Snapshot: id, File: j.f.Name,
					Reason: fmt.Sprintf("sha256 mismatch in block %d (bytes %d–%d): want %s, got %s",
						j.block, off, off+min(j.f.BlockBytes, j.f.Bytes-off), j.f.Blocks[j.block], got)}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		var ce *snapshot.CorruptError
		if errors.As(err, &ce) {
			return err
		}
	}
	return errors.Join(errs...)
}

// Delete implements snapshot.Store.
func (s *Store) Delete(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	// Remove the manifest first: from that instant the snapshot no longer exists.
	if err := os.Remove(filepath.Join(s.final(id), "manifest.json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	_ = atomicfile.SyncDir(s.final(id))
	if err := os.RemoveAll(s.final(id)); err != nil {
		return fmt.Errorf("snapshot %s: delete: %w", id, err)
	}
	return os.RemoveAll(s.staged(id))
}

// List implements snapshot.Store.
func (s *Store) List(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, e := range ents {
		if !e.IsDir() || e.Name() == ".staging" {
			continue
		}
		if _, err := os.Stat(filepath.Join(s.dir, e.Name(), "manifest.json")); err == nil {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

// Usage implements snapshot.UsageReporter: the committed snapshots' files are
// the durable tier (StoredBytes), staging is local (LocalBytes).
func (s *Store) Usage(ctx context.Context) (snapshot.Usage, error) {
	var u snapshot.Usage
	total, err := snapshot.DirBytes(s.dir)
	if err != nil {
		return u, err
	}
	if u.LocalBytes, err = snapshot.DirBytes(filepath.Join(s.dir, ".staging")); err != nil {
		return u, err
	}
	u.StoredBytes = total - u.LocalBytes
	return u, nil
}

// Recover implements snapshot.Store: it empties .staging and removes directories
// without a manifest.
func (s *Store) Recover(ctx context.Context) error {
	if err := os.RemoveAll(filepath.Join(s.dir, ".staging")); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(s.dir, ".staging"), 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.IsDir() || e.Name() == ".staging" {
			continue
		}
		if _, err := os.Stat(filepath.Join(s.dir, e.Name(), "manifest.json")); errors.Is(err, os.ErrNotExist) {
			_ = os.RemoveAll(filepath.Join(s.dir, e.Name()))
		}
	}
	return nil
}

// hashAll hashes the named files of dir concurrently; with sync it also fsyncs each.
func hashAll(ctx context.Context, dir string, names []string, sync_ bool) ([]snapshot.File, error) {
	out := make([]snapshot.File, len(names))
	errs := make([]error, len(names))
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			out[i], errs[i] = hashFile(ctx, filepath.Join(dir, n), sync_)
			out[i].Name = n
		}()
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

func hashFile(ctx context.Context, path string, sync_ bool) (snapshot.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return snapshot.File{}, err
	}
	defer f.Close()
	h := sha256.New()
	buf := make([]byte, 1<<20)
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return snapshot.File{}, err
		}
		k, err := f.Read(buf)
		h.Write(buf[:k])
		n += int64(k)
		if err == io.EOF {
			break
		}
		if err != nil {
			return snapshot.File{}, err
		}
	}
	if sync_ {
		if err := f.Sync(); err != nil {
			return snapshot.File{}, err
		}
	}
	return snapshot.File{Bytes: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}
