package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// sharedBucket is a bucket on a real S3 server (versitygw, stopped by its pid
// when the test ends) that the tests' stores share images through.
type sharedBucket struct {
	srv    *s3test.Server
	c      *minio.Client
	name   string
	bucket *Bucket
}

func startBucket(t testing.TB) *sharedBucket {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (ownership on import)")
	}
	srv := s3test.Start(t)
	const name = "torpor-images"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: srv.Endpoint, Bucket: name, AccessKey: srv.AccessKey,
		SecretKey: srv.SecretKey, Region: srv.Region, PathStyle: true, CreateBucket: true})
	if err != nil {
		t.Fatal(err)
	}
	c, _ := b.Client()
	bk, err := NewBucket(BucketConfig{Client: c, Bucket: name, Prefix: "images/"})
	if err != nil {
		t.Fatal(err)
	}
	return &sharedBucket{srv: srv, c: c, name: name, bucket: bk}
}

// host is one host's image store: its own directory, and db (nil: its own
// SQLite file) for its records.
func (sb *sharedBucket) host(t testing.TB, db metadata.Images) *Store {
	t.Helper()
	dir := t.TempDir()
	if db == nil {
		d, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		db = d
	}
	s, err := Open(filepath.Join(dir, "images"), db)
	if err != nil {
		t.Fatal(err)
	}
	s.SetBucket(sb.bucket)
	return s
}

func (sb *sharedBucket) object(t *testing.T, key string) []byte {
	t.Helper()
	o, err := sb.c.GetObject(context.Background(), sb.name, key, minio.GetObjectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	b, err := io.ReadAll(o)
	if err != nil {
		t.Fatalf("read %s: %v", key, err)
	}
	return b
}

func (sb *sharedBucket) putObject(t *testing.T, key string, b []byte) {
	t.Helper()
	if _, err := sb.c.PutObject(context.Background(), sb.name, key, bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (sb *sharedBucket) exists(t *testing.T, key string) bool {
	t.Helper()
	_, err := sb.c.StatObject(context.Background(), sb.name, key, minio.StatObjectOptions{})
	if err != nil && !notFoundErr(err) {
		t.Fatal(err)
	}
	return err == nil
}

// rootfs is a small root-filesystem tarball with a marker file and, for a
// non-zero size, a file of that many random bytes (so that images differ and
// a download takes a while).
func rootfs(t *testing.T, marker string, size int) []byte {
	t.Helper()
	blob := make([]byte, size)
	rand.Read(blob)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range []struct {
		name string
		body []byte
	}{{"etc/marker", []byte(marker)}, {"opt/blob", blob}} {
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(e.body)
	}
	tw.Close()
	return buf.Bytes()
}

// assertEmptyStore fails unless s holds no image file and no temporary file.
func assertEmptyStore(t *testing.T, s *Store) {
	t.Helper()
	for _, d := range []string{"sha256", "tmp"} {
		ents, err := os.ReadDir(filepath.Join(s.Dir(), d))
		if err != nil || len(ents) != 0 {
			t.Errorf("%s/%s after the failed fetch: %d entries %v", s.Dir(), d, len(ents), err)
		}
	}
}

// TestBucketImportFetch: an import on one host uploads the image's file under
// its digest and then its name's manifest; a host with its own records that
// never saw the name finds it in the bucket, fetches the file (verified, 0444,
// the same bytes) and records the name; a host sharing the first one's
// records fetches the file by the recorded digest; Has answers from the
// manifest without a download; unknown names and digests are ErrNotFound.
func TestBucketImportFetch(t *testing.T) {
	sb := startBucket(t)
	ctx := context.Background()
	a := sb.host(t, nil)
	img, err := a.Import(ctx, "tiny", bytes.NewReader(rootfs(t, "from a", 0)), nil)
	if err != nil {
		t.Fatal(err)
	}
	local, err := os.ReadFile(a.Path(img.Digest))
	if err != nil {
		t.Fatal(err)
	}
	if got := sb.object(t, sb.bucket.BytesKey(img.Digest)); !bytes.Equal(got, local) {
		t.Fatalf("bucket object %s: %d bytes, not the image's %d", sb.bucket.BytesKey(img.Digest), len(got), len(local))
	}
	var m nameManifest
	if err := json.Unmarshal(sb.object(t, "images/names/tiny.json"), &m); err != nil || m.Digest != img.Digest ||
		m.Bytes != img.Bytes || m.Source != "import:rootfs-tar" {
		t.Fatalf("name manifest %+v %v, want digest %s, %d bytes, source import:rootfs-tar", m, err, img.Digest, img.Bytes)
	}

	b := sb.host(t, nil)
	if ok, err := b.Has(ctx, "tiny"); err != nil || !ok || b.downloads.Load() != 0 {
		t.Fatalf("Has(tiny) on a host that never saw it: %v %v, %d downloads", ok, err, b.downloads.Load())
	}
	got, p, err := b.Get(ctx, "tiny")
	if err != nil || got.Digest != img.Digest || got.Source != img.Source || p != b.Path(img.Digest) {
		t.Fatalf("Get(tiny) on a host that never saw it: %+v %s %v, want %s", got, p, err, img.Digest)
	}
	checkStored(t, b, img)
	if rec, err := b.db.GetImage(ctx, "tiny"); err != nil || rec.Digest != img.Digest {
		t.Errorf("the fetched name is not in the host's records: %+v %v", rec, err)
	}
	if _, _, err := b.Get(ctx, img.Digest); err != nil || b.downloads.Load() != 1 {
		t.Errorf("Get(digest) after the fetch: %v, %d downloads (want 1)", err, b.downloads.Load())
	}
	if imgs, err := b.List(ctx); err != nil || len(imgs) != 1 || imgs[0].Name != "tiny" {
		t.Errorf("List after the fetch: %+v %v", imgs, err)
	}

	shared := sb.host(t, a.db)
	if _, _, err := shared.Get(ctx, "tiny"); err != nil || shared.downloads.Load() != 1 {
		t.Fatalf("Get(tiny) on a host sharing the records: %v, %d downloads", err, shared.downloads.Load())
	}
	checkStored(t, shared, img)

	c := sb.host(t, nil)
	if _, _, err := c.Get(ctx, "nosuch"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(nosuch): %v, want ErrNotFound", err)
	}
	if ok, err := c.Has(ctx, "nosuch"); ok || err != nil {
		t.Errorf("Has(nosuch): %v %v", ok, err)
	}
	unknown := "sha256:" + strings.Repeat("ab", 32)
	if _, _, err := c.Get(ctx, unknown); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), unknown) {
		t.Errorf("Get(%s): %v, want ErrNotFound naming it", unknown, err)
	}
	assertEmptyStore(t, c)
}

// TestBucketCorrupt: a bucket object whose bytes do not hash to its digest
// (one byte flipped; cut short) is refused with ErrCorrupt naming the digest
// and the key, and leaves nothing in the store; the name is not recorded.
func TestBucketCorrupt(t *testing.T) {
	sb := startBucket(t)
	ctx := context.Background()
	img, err := sb.host(t, nil).Import(ctx, "tiny", bytes.NewReader(rootfs(t, "x", 0)), nil)
	if err != nil {
		t.Fatal(err)
	}
	key := sb.bucket.BytesKey(img.Digest)
	good := sb.object(t, key)
	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 1
	for _, tc := range []struct {
		what string
		body []byte
	}{{"a flipped byte", flipped}, {"cut short", good[:len(good)-4096]}} {
		sb.putObject(t, key, tc.body)
		for _, ref := range []string{"tiny", img.Digest} {
			s := sb.host(t, nil)
			_, _, err := s.Get(ctx, ref)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), img.Digest) || !strings.Contains(err.Error(), key) {
				t.Errorf("%s, Get(%s): %v, want ErrCorrupt naming %s and %s", tc.what, ref, err, img.Digest, key)
			}
			assertEmptyStore(t, s)
			if _, err := s.db.GetImage(ctx, "tiny"); !errors.Is(err, metadata.ErrNotFound) {
				t.Errorf("%s: the name was recorded from a corrupt image: %v", tc.what, err)
			}
		}
	}
	sb.putObject(t, key, good)
	if _, _, err := sb.host(t, nil).Get(ctx, "tiny"); err != nil {
		t.Fatalf("after the object is mended: %v", err)
	}
}

// TestBucketConcurrentFetch: 8 concurrent first uses of one image on a host
// (by name and by digest) download it once; the caller that started the
// download giving up does not stop it for the others.
func TestBucketConcurrentFetch(t *testing.T) {
	sb := startBucket(t)
	ctx := context.Background()
	a := sb.host(t, nil)
	img, err := a.Import(ctx, "big", bytes.NewReader(rootfs(t, "big", 32<<20)), nil)
	if err != nil {
		t.Fatal(err)
	}
	b := sb.host(t, a.db)
	gone, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, ref := ctx, img.Digest
			if i == 0 {
				c = gone
			}
			if i%2 == 1 {
				ref = "big"
			}
			_, _, errs[i] = b.Get(c, ref)
		}()
	}
	time.Sleep(5 * time.Millisecond)
	cancel()
	wg.Wait()
	for i, err := range errs {
		if i == 0 {
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("the canceled caller: %v", err)
			}
			continue
		}
		if err != nil {
			t.Errorf("caller %d: %v", i, err)
		}
	}
	if n := b.downloads.Load(); n != 1 {
		t.Errorf("%d downloads for 8 concurrent uses, want 1", n)
	}
	checkStored(t, b, img)
	if ents, _ := os.ReadDir(filepath.Join(b.Dir(), "tmp")); len(ents) != 0 {
		t.Errorf("temporary files left: %v", ents)
	}
}

// TestBucketUnreachable: an import while S3 is down fails, naming the
// bucket, and records nothing (the same import succeeds once S3 is back);
// an image a host had before it had a bucket is uploaded on its first use
// by name, without taking back the name's manifest another host wrote.
func TestBucketUnreachable(t *testing.T) {
	sb := startBucket(t)
	ctx := context.Background()
	a := sb.host(t, nil)
	sb.srv.Stop()
	tarball := rootfs(t, "down", 0)
	if _, err := a.Import(ctx, "down", bytes.NewReader(tarball), nil); err == nil || !strings.Contains(err.Error(), sb.bucket.String()) {
		t.Fatalf("import with S3 down: %v, want an error naming %s", err, sb.bucket)
	}
	if _, err := a.db.GetImage(ctx, "down"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("the failed import recorded its name: %v", err)
	}
	sb.srv.Restart()
	img, err := a.Import(ctx, "down", bytes.NewReader(tarball), nil)
	if err != nil {
		t.Fatalf("import once S3 is back: %v", err)
	}
	if !sb.exists(t, sb.bucket.BytesKey(img.Digest)) {
		t.Fatal("not uploaded")
	}

	// An older host: images made without a bucket, one of them under a name
	// another host has since given to another image.
	old := sb.host(t, nil)
	old.SetBucket(nil)
	mine, err := old.Import(ctx, "mine", bytes.NewReader(rootfs(t, "mine", 0)), nil)
	if err != nil {
		t.Fatal(err)
	}
	stale, err := old.Import(ctx, "down", bytes.NewReader(rootfs(t, "stale", 0)), nil)
	if err != nil {
		t.Fatal(err)
	}
	old.SetBucket(sb.bucket)
	for _, im := range []sandbox.Image{mine, stale} {
		if _, _, err := old.Get(ctx, im.Name); err != nil {
			t.Fatal(err)
		}
		if !sb.exists(t, sb.bucket.BytesKey(im.Digest)) {
			t.Errorf("%s (%s) not uploaded on its first use", im.Name, im.Digest)
		}
	}
	var m nameManifest
	if err := json.Unmarshal(sb.object(t, "images/names/mine.json"), &m); err != nil || m.Digest != mine.Digest {
		t.Errorf("manifest of mine: %+v %v, want %s", m, err, mine.Digest)
	}
	if err := json.Unmarshal(sb.object(t, "images/names/down.json"), &m); err != nil || m.Digest != img.Digest {
		t.Errorf("manifest of down: %+v %v, want the other host's %s, not %s", m, err, img.Digest, stale.Digest)
	}
}

// BenchmarkBucketFetch measures a first use's download of a built image (the
// smallest file in the host's build cache; skipped without one) from a local
// S3 server into a store, with a local copy of the same file (copy, fsync)
// in each iteration as the baseline: fetch_per_copy is their ratio.
func BenchmarkBucketFetch(b *testing.B) {
	files, _ := filepath.Glob(filepath.Join(BuildCacheFromEnv(), "*.erofs"))
	src, size := "", int64(0)
	for _, f := range files {
		if fi, err := os.Stat(f); err == nil && (src == "" || fi.Size() < size) {
			src, size = f, fi.Size()
		}
	}
	if src == "" {
		b.Skip("no built image in the build cache (make setup)")
	}
	sb := startBucket(b)
	ctx := context.Background()
	a := sb.host(b, nil)
	tmp, err := copyToTemp(src, a.tmpDir())
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	img, err := a.store(ctx, "bench", "bench", tmp, io.Discard)
	if err != nil {
		b.Fatal(err)
	}
	upload := time.Since(start)
	b.SetBytes(size)
	b.ResetTimer()
	var fetch, local time.Duration
	for range b.N {
		s := sb.host(b, nil)
		t0 := time.Now()
		if _, _, err := s.Get(ctx, img.Digest); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		c, err := copyToTemp(src, s.tmpDir())
		if err != nil {
			b.Fatal(err)
		}
		fetch, local = fetch+t1.Sub(t0), local+time.Since(t1)
		os.Remove(c)
		os.Remove(s.Path(img.Digest))
	}
	b.ReportMetric(fetch.Seconds()/float64(b.N), "fetch_s")
	b.ReportMetric(float64(fetch)/float64(local), "fetch_per_copy")
	b.ReportMetric(upload.Seconds(), "upload_s")
}

// TestHasWithoutBucket: without a bucket Has is what Get finds: a recorded
// name whose file is here, not one whose file is gone, not an unknown one.
func TestHasWithoutBucket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (ownership on import)")
	}
	ctx := context.Background()
	s := newStore(t)
	img, err := s.Import(ctx, "here", bytes.NewReader(rootfs(t, "here", 0)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Has(ctx, "here"); !ok || err != nil {
		t.Errorf("Has(here): %v %v", ok, err)
	}
	if ok, err := s.Has(ctx, "nosuch"); ok || err != nil {
		t.Errorf("Has(nosuch): %v %v", ok, err)
	}
	if err := os.Remove(s.Path(img.Digest)); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Has(ctx, "here"); ok || err != nil {
		t.Errorf("Has(here) without its file: %v %v", ok, err)
	}
	if _, err := s.Has(ctx, "Bad Name"); !errors.Is(err, ErrInvalid) {
		t.Errorf("Has(Bad Name): %v, want ErrInvalid", err)
	}
}
