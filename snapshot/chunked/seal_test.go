package chunked

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
	"github.com/torpor/torpor/snapshot/storetest"
)

func newKey(t testing.TB) *Key {
	t.Helper()
	raw := make([]byte, KeyBytes)
	rand.Read(raw)
	k, err := NewKey(raw)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// openKeyed opens (or reopens) a store in dir with filesystem backend and
// key k (nil: none), and old keys.
func openKeyed(t *testing.T, dir string, k *Key, old ...*Key) *Store {
	t.Helper()
	s, err := New(ctx, Config{Dir: dir, Key: k, OldKeys: old})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// markedImage is a memory image of random pages with marker written into
// several of them: what a sandbox holding a secret in memory checkpoints.
func markedImage(pages int, marker string) []byte {
	img := memImage(pages)
	for p := 3; p < pages; p += pages / 7 {
		copy(img[p*pageSize+100:], marker)
	}
	return img
}

// grepTree returns the files under dir whose bytes contain needle.
func grepTree(t *testing.T, dir string, needle []byte) []string {
	t.Helper()
	var hits []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if bytes.Contains(b, needle) {
			hits = append(hits, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return hits
}

func commitMarked(t *testing.T, s *Store, id, sandbox string, files map[string][]byte) snapshot.Manifest {
	t.Helper()
	return stageAndCommit(t, s, id, files, func(ctx context.Context, id string, m snapshot.Manifest) (snapshot.Manifest, error) {
		m.SandboxID, m.Spec.Env = sandbox, map[string]string{"TOKEN": sandbox + "-env"}
		return s.Commit(ctx, id, m)
	})
}

func chunkIDs(d doc) map[string]bool {
	ids := map[string]bool{}
	for _, fc := range d.Files {
		for _, r := range fc.Chunks {
			if r.ID != "" {
				ids[r.ID] = true
			}
		}
	}
	return ids
}

func TestEncryptedRoundTripNoPlaintext(t *testing.T) {
	dir := t.TempDir()
	s := openKeyed(t, dir, newKey(t))
	const marker = "torpor-secret-marker-7f3a9c"
	img := markedImage(2048, marker)
	files := map[string][]byte{"pages.img": img, "checkpoint.img": []byte("kernel state " + marker)}
	commitMarked(t, s, "snap-e1", "sbx-hidden-name", files)
	// Nothing the store keeps holds the marker, the sandbox's id or its
	// environment: not the backend, not a plaintext copy left in open/.
	for _, needle := range []string{marker, "sbx-hidden-name", "pages.img"} {
		if hits := grepTree(t, dir, []byte(needle)); len(hits) > 0 {
			t.Errorf("%q in plain text in %v", needle, hits)
		}
	}
	// The addresses are not the chunks' sha256.
	d, err := s.readDoc(ctx, "snap-e1")
	if err != nil {
		t.Fatal(err)
	}
	var off int64
	for _, ref := range d.Files[1].Chunks { // pages.img, sorted after checkpoint.img
		if ref.ID != "" {
			chunk := img[off : off+ref.Len]
			if ref.ID == sha256Hex(chunk) || ref.ID != s.key.address(chunk) {
				t.Errorf("chunk address %s: want the keyed hash, not the sha256", ref.ID)
			}
			break
		}
		off += ref.Len
	}
	mustOpen(t, s, "snap-e1", files)
	// A store opened again (nothing in memory) reads it back cold.
	s.Close()
	s2 := openKeyed(t, dir, s.key)
	mustOpen(t, s2, "snap-e1", files)
	if _, err := s2.Verify(ctx, "snap-e1"); err != nil {
		t.Fatal(err)
	}
}

// TestEncryptedOpenedCopyReleased: with a key, an opened copy stays while an
// Open of it is unreleased (two overlapping Opens: until the second Release)
// and is gone after the last; Recover at start removes every opened copy
// (one a crash left between Open and Release, and a half-built one), live
// snapshot or not. Without a key, Release keeps the copy (warm resume).
func TestEncryptedOpenedCopyReleased(t *testing.T) {
	const marker = "torpor-secret-marker-8b2e41"
	files := map[string][]byte{"pages.img": markedImage(256, marker), "checkpoint.img": []byte("kernel " + marker)}
	dir := t.TempDir()
	k := newKey(t)
	s := openKeyed(t, dir, k)
	commitMarked(t, s, "snap-r1", "sbx-r1", files)
	open := filepath.Join(dir, "open", "snap-r1")
	mustOpen(t, s, "snap-r1", files)
	mustOpen(t, s, "snap-r1", files) // a second restore of it, overlapping
	s.Release("snap-r1")
	if len(grepTree(t, open, []byte(marker))) == 0 {
		t.Fatal("the opened copy is gone while an Open of it is unreleased")
	}
	s.Release("snap-r1")
	if hits := grepTree(t, dir, []byte(marker)); len(hits) > 0 {
		t.Errorf("after the last Release the marker is in plain text in %v", hits)
	}
	// A crash between Open and Release, and one in the middle of a rebuild.
	mustOpen(t, s, "snap-r1", files)
	if err := os.MkdirAll(filepath.Join(dir, "open", ".build-snap-r1-0123"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "open", ".build-snap-r1-0123", "pages.img"), []byte(marker), 0o600); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s2 := openKeyed(t, dir, k)
	if err := s2.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	if hits := grepTree(t, dir, []byte(marker)); len(hits) > 0 {
		t.Errorf("after Recover the marker is in plain text in %v", hits)
	}
	mustOpen(t, s2, "snap-r1", files) // still resumes: rebuilt from the chunks

	plain := openKeyed(t, t.TempDir(), nil)
	commitMarked(t, plain, "snap-p1", "sbx-p1", files)
	mustOpen(t, plain, "snap-p1", files)
	plain.Release("snap-p1")
	if _, err := os.Stat(filepath.Join(plain.dir, "open", "snap-p1")); err != nil {
		t.Errorf("without a key the opened copy should stay after Release: %v", err)
	}
}

func TestEncryptedDedupWithinOneKey(t *testing.T) {
	s := openKeyed(t, t.TempDir(), newKey(t))
	img := memImage(4096) // 16 MiB
	m1 := commit(t, s, "snap-1", map[string][]byte{"pages.img": img})
	m2 := commit(t, s, "snap-2", map[string][]byte{"pages.img": img}) // no parent: by address
	if m2.NewBytes != 0 {
		t.Errorf("an equal snapshot under the same key stored %d new bytes", m2.NewBytes)
	}
	img3 := mutate(img, 0.02, 8, 7)
	m3 := stageAndCommitParent(t, s, "snap-3", "snap-2", map[string][]byte{"pages.img": img3})
	t.Logf("first %d new bytes; equal %d; 2%% changed (diff) %d", m1.NewBytes, m2.NewBytes, m3.NewBytes)
	if m3.NewBytes > m1.NewBytes/10 || s.lastReused.Load() == 0 {
		t.Errorf("diff commit under a key: %d new bytes of %d, %d chunks from the parent's keys", m3.NewBytes, m1.NewBytes, s.lastReused.Load())
	}
	dropLocal(t, s)
	mustOpen(t, s, "snap-3", map[string][]byte{"pages.img": img3})
	mustOpen(t, s, "snap-1", map[string][]byte{"pages.img": img})
}

func stageAndCommitParent(t *testing.T, s *Store, id, parent string, files map[string][]byte) snapshot.Manifest {
	t.Helper()
	m, _ := commitChild(t, s, id, parent, files)
	return m
}

func TestDifferentKeysDifferentAddresses(t *testing.T) {
	img := memImage(1024)
	var docs []doc
	for _, k := range []*Key{newKey(t), newKey(t), nil} {
		s := openKeyed(t, t.TempDir(), k)
		commit(t, s, "snap-x", map[string][]byte{"pages.img": img})
		d, err := s.readDoc(ctx, "snap-x")
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, d)
	}
	a, b, plain := chunkIDs(docs[0]), chunkIDs(docs[1]), chunkIDs(docs[2])
	for id := range a {
		if b[id] || plain[id] {
			t.Fatalf("chunk address %s under two keys (or as a plain sha256)", id)
		}
	}
	if len(a) != len(b) || len(a) != len(plain) || len(a) == 0 {
		t.Errorf("chunk counts %d, %d, %d", len(a), len(b), len(plain))
	}
}

func TestEncryptedTamperedChunkNamed(t *testing.T) {
	s := openKeyed(t, t.TempDir(), newKey(t))
	img := memImage(1024)
	commit(t, s, "snap-t", map[string][]byte{"pages.img": img})
	d, _ := s.readDoc(ctx, "snap-t")
	bad := d.Files[0].Chunks[2].ID
	corruptChunk(t, s, bad)
	dropLocal(t, s)
	_, _, err := s.Open(ctx, "snap-t")
	var ce *snapshot.CorruptError
	if !errors.As(err, &ce) || ce.Snapshot != "snap-t" || ce.File != "pages.img" || !strings.Contains(err.Error(), bad) ||
		!strings.Contains(err.Error(), "authentication failed") {
		t.Fatalf("open of a tampered chunk: %v", err)
	}
	// A manifest changed by one byte, or moved to another id, fails as well.
	raw, _ := getAll(ctx, s.b, manifestKey("snap-t"))
	for name, edit := range map[string]func() (string, []byte){
		"flipped": func() (string, []byte) {
			b := bytes.Clone(raw)
			b[len(b)/2] ^= 1
			return "snap-t", b
		},
		"moved": func() (string, []byte) { return "snap-u", raw },
	} {
		id, b := edit()
		if _, err := s.unmarshalDoc(id, b); !errors.As(err, &ce) || ce.File != "manifest.json" {
			t.Errorf("%s manifest: %v", name, err)
		}
	}
}

func TestWrongOrMissingKeyNamed(t *testing.T) {
	dir := t.TempDir()
	a, b := newKey(t), newKey(t)
	s := openKeyed(t, dir, a)
	img := memImage(1024)
	commit(t, s, "snap-k", map[string][]byte{"pages.img": img})
	packs := func() int { u, _ := s.Usage(ctx); return u.Packs }
	nPacks := packs()
	s.Close()

	for _, tc := range []struct {
		key  *Key
		want string
	}{
		{b, "snapshot snap-k was encrypted with key " + a.ID() + ", this server has key " + b.ID()},
		{nil, "snapshot snap-k is encrypted (key " + a.ID() + ") and no key is configured"},
	} {
		w := openKeyed(t, dir, tc.key)
		_, _, err := w.Open(ctx, "snap-k")
		var ke *snapshot.KeyError
		if !errors.As(err, &ke) || err.Error() != tc.want {
			t.Fatalf("open with the wrong key: %v, want %q", err, tc.want)
		}
		if _, err := w.Verify(ctx, "snap-k"); !errors.As(err, &ke) {
			t.Fatalf("verify with the wrong key: %v", err)
		}
		// A collection cannot read the manifest: it deletes nothing.
		if _, err := w.Collect(ctx, nil); err == nil {
			t.Fatal("collect with the wrong key succeeded")
		}
		// A commit with the wrong key adds its own chunks beside.
		commit(t, w, "snap-other", map[string][]byte{"pages.img": img})
		if err := w.Delete(ctx, "snap-other"); err != nil {
			t.Fatal(err)
		}
		w.Close()
	}
	// Nothing was changed: the right key opens it, cold.
	s = openKeyed(t, dir, a)
	if got := packs(); got < nPacks {
		t.Fatalf("packs %d after the wrong keys, %d before", got, nPacks)
	}
	mustOpen(t, s, "snap-k", map[string][]byte{"pages.img": img})
}

func TestPlainSnapshotsReadableWithKeyAndRotation(t *testing.T) {
	dir := t.TempDir()
	img := memImage(2048)
	s := openKeyed(t, dir, nil)
	commit(t, s, "snap-plain", map[string][]byte{"pages.img": img})
	s.Close()

	// A key set on a store with plain snapshots: they stay readable, new ones
	// are sealed, and a diff commit does not name the plain parent's chunks.
	a := newKey(t)
	s = openKeyed(t, dir, a)
	mustOpen(t, s, "snap-plain", map[string][]byte{"pages.img": img})
	img2 := mutate(img, 0.01, 8, 3)
	commitChild(t, s, "snap-a", "snap-plain", map[string][]byte{"pages.img": img2})
	if s.lastReused.Load() != 0 {
		t.Errorf("a sealed diff commit reused %d chunks of a plain parent", s.lastReused.Load())
	}
	da, err := s.readDoc(ctx, "snap-a")
	if err != nil || da.key != a {
		t.Fatalf("snap-a: key %v, err %v", da.key, err)
	}
	for id := range chunkIDs(da) {
		if dp, _ := s.readDoc(ctx, "snap-plain"); chunkIDs(dp)[id] {
			t.Fatalf("sealed snapshot names plain chunk %s", id)
		}
	}
	raw, _ := getAll(ctx, s.b, manifestKey("snap-a"))
	if !bytes.HasPrefix(raw, sealedDocPrefix) {
		t.Fatalf("manifest of snap-a not sealed: %.40s", raw)
	}
	s.Close()

	// Rotation: b is the key, a an old key; both old snapshots open, new ones
	// are sealed with b.
	b := newKey(t)
	s = openKeyed(t, dir, b, a)
	dropLocal(t, s)
	mustOpen(t, s, "snap-a", map[string][]byte{"pages.img": img2})
	mustOpen(t, s, "snap-plain", map[string][]byte{"pages.img": img})
	commitChild(t, s, "snap-b", "snap-a", map[string][]byte{"pages.img": img2})
	if db, _ := s.readDoc(ctx, "snap-b"); db.key != b {
		t.Fatalf("snap-b sealed with %v, want the new key", db.key)
	}
	// With snap-a gone, a collection removes its chunks: a is no longer needed.
	if err := s.Delete(ctx, "snap-a"); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Collect(ctx, nil); err != nil || n < len(chunkIDs(da)) {
		t.Fatalf("collect after the last snapshot under the old key went: %d chunks deleted (want %d), %v", n, len(chunkIDs(da)), err)
	}
	s.Close()
	s = openKeyed(t, dir, b)
	mustOpen(t, s, "snap-b", map[string][]byte{"pages.img": img2})
	mustOpen(t, s, "snap-plain", map[string][]byte{"pages.img": img})
}

func TestLoadKey(t *testing.T) {
	dir := t.TempDir()
	raw := make([]byte, KeyBytes)
	rand.Read(raw)
	want, _ := NewKey(raw)
	for name, content := range map[string][]byte{
		"raw":    raw,
		"hex":    []byte(hex.EncodeToString(raw) + "\n"),
		"base64": []byte(base64.StdEncoding.EncodeToString(raw) + "\n"),
	} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, content, 0o600)
		k, err := LoadKey(p)
		if err != nil || k.ID() != want.ID() {
			t.Errorf("%s: %v, %v", name, k, err)
		}
	}
	p := filepath.Join(dir, "shared")
	os.WriteFile(p, raw, 0o644)
	os.Chmod(p, 0o644)
	if _, err := LoadKey(p); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("a key readable by others: %v", err)
	}
	p = filepath.Join(dir, "short")
	os.WriteFile(p, raw[:16], 0o600)
	if _, err := LoadKey(p); err == nil {
		t.Error("a 16-byte key was accepted")
	}
	other, _ := NewKey(append(raw[1:], 0))
	if other.ID() == want.ID() || len(want.ID()) != 16 {
		t.Errorf("key ids %s, %s", want.ID(), other.ID())
	}
}

func TestConformanceFSEncrypted(t *testing.T) {
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return openKeyed(t, t.TempDir(), newKey(t)) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true)})
}

func newKeyedS3Store(t *testing.T, srv *s3test.Server, k *Key) *Store {
	t.Helper()
	s, err := New(ctx, Config{Dir: t.TempDir(), Backend: newS3Backend(t, srv), CacheBytes: 64 << 20, Key: k})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestConformanceS3Encrypted(t *testing.T) {
	srv := s3test.Start(t)
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newKeyedS3Store(t, srv, newKey(t)) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true)})
}

func TestConformanceS3AsyncEncrypted(t *testing.T) {
	srv := s3test.Start(t)
	storetest.RunWith(t, func(t *testing.T) snapshot.Store { return newKeyedS3Store(t, srv, newKey(t)) },
		storetest.Options{Corrupt: damage(false), Remove: damage(true), Async: true})
}

// TestS3EncryptedNoPlaintext: neither the bucket (versitygw's files), nor the
// chunk cache, nor the outbox of an asynchronous commit hold the marker.
func TestS3EncryptedNoPlaintext(t *testing.T) {
	srv := s3test.Start(t)
	s := newKeyedS3Store(t, srv, newKey(t))
	const marker = "torpor-s3-secret-marker-21be"
	img := markedImage(2048, marker)
	files := map[string][]byte{"pages.img": img}
	commitMarked(t, s, "snap-s1", "sbx-s3-hidden", files)
	dir, err := s.Stage(ctx, "snap-s2")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "pages.img"), mutate(img, 0.01, 4, 9), 0o600)
	if _, err := s.CommitAsync(ctx, "snap-s2", snapshot.Manifest{ID: "snap-s2", SandboxID: "sbx-s3-hidden", CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	for _, needle := range []string{marker, "sbx-s3-hidden"} {
		if hits := grepTree(t, s.dir, []byte(needle)); len(hits) > 0 {
			t.Errorf("%q in plain text on local disk (outbox pending): %v", needle, hits)
		}
	}
	waitDurable(t, s, "snap-s2")
	dropLocal(t, s)
	mustOpen(t, s, "snap-s1", files) // cold: through the cache, from S3
	s.fill.wait()
	if n, _ := s.cache.Used(); n == 0 {
		t.Fatal("cold open filled no cache")
	}
	for _, needle := range []string{marker, "sbx-s3-hidden"} {
		if hits := grepTree(t, srv.DataDir(), []byte(needle)); len(hits) > 0 {
			t.Errorf("%q in plain text in the bucket: %v", needle, hits)
		}
		if hits := grepTree(t, filepath.Join(s.dir, "cache"), []byte(needle)); len(hits) > 0 {
			t.Errorf("%q in plain text in the chunk cache: %v", needle, hits)
		}
	}
	// The check can fail: the same commit without a key leaves the marker.
	plain := newKeyedS3Store(t, srv, nil)
	commitMarked(t, plain, "snap-p", "sbx-plain", files)
	if hits := grepTree(t, srv.DataDir(), []byte("sbx-plain")); len(hits) == 0 {
		t.Error("a plain manifest's sandbox id is not found in the bucket: the check cannot see anything")
	}
}

// A store whose outbox holds a snapshot sealed with another key refuses to
// recover (a server does so at start), naming the key, and deletes nothing.
func TestPendingUploadWrongKeyNamed(t *testing.T) {
	dir := t.TempDir()
	a := newKey(t)
	s, err := New(ctx, Config{Dir: dir, Key: a, ReadOnly: true}) // ReadOnly: no upload runs
	if err != nil {
		t.Fatal(err)
	}
	img := memImage(256)
	stageAndCommit(t, s, "snap-p", map[string][]byte{"pages.img": img}, s.CommitAsync)
	s.Close()
	w := openKeyed(t, dir, newKey(t))
	err = w.Recover(ctx)
	var ke *snapshot.KeyError
	if !errors.As(err, &ke) || ke.KeyID != a.ID() {
		t.Fatalf("recover with a pending snapshot under another key: %v", err)
	}
	w.Close()
	s = openKeyed(t, dir, a)
	if err := s.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	waitDurable(t, s, "snap-p")
	dropLocal(t, s)
	mustOpen(t, s, "snap-p", map[string][]byte{"pages.img": img})
}
