package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/snapshot/chunked"
	"github.com/torpor/torpor/snapshot/chunked/s3test"
)

// TestImagesFromS3: images are shared through the S3 bucket of the snapshot
// store. Two `torpor serve` processes, img-a (records in PostgreSQL) and
// img-b (its own SQLite file), with separate data directories and prefixes
// in one bucket: an image imported through img-a (a root filesystem holding
// only a static Go program and a marker file) makes a sandbox on img-b,
// which never saw the name nor the file; img-b fetched the file into its own
// data directory and now lists the name. Then a sandbox made from the image
// and hibernated on img-a resumes, its process continuing, on a server
// started with img-a's records (its database, store record and id) on a new
// data directory without the image (img-a's and img-b's data directories are
// gone): the file comes from the bucket. (img-b has records of its own, and
// the resume runs on img-a's: a PostgreSQL database takes one server at a
// time until sandboxes have owners, docs/multi-host.md. A server sharing the
// records but not the file is image/TestBucketImportFetch's.)
func TestImagesFromS3(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 10*time.Minute)
	s3 := s3test.Start(t)
	const bucket = "torpor-e2e-images"
	if _, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: s3.Endpoint, Bucket: bucket, AccessKey: s3.AccessKey,
		SecretKey: s3.SecretKey, Region: s3.Region, PathStyle: true, CreateBucket: true}); err != nil {
		t.Fatal(err)
	}
	dbURL := pgtest.Start(t).NewDatabase(t)
	bin := buildTorpor(t)
	goagent := goBuild(t, "./e2e/testdata/goagent")

	type node struct {
		name, dir, log string
		args           []string
		p              *serveProcess
		c              *client.Client
		ids            []string
	}
	var nodes []*node
	newNode := func(name, prefix string, extra ...string) *node {
		dir, err := os.MkdirTemp("", "torpor-e2e-"+name+"-")
		if err != nil {
			t.Fatal(err)
		}
		n := &node{name: name, dir: dir, log: filepath.Join(t.TempDir(), name+".log")}
		n.args = append([]string{"--node", name, "--data-dir", dir, "--runsc", servertest.Runsc(t), "--agent", servertest.AgentBinary(t),
			"--store", "s3", "--s3-endpoint", s3.Endpoint, "--s3-bucket", bucket, "--s3-prefix", prefix,
			"--s3-access-key", s3.AccessKey, "--s3-secret-key", s3.SecretKey, "--s3-region", s3.Region}, extra...)
		nodes = append(nodes, n)
		return n
	}
	up := func(n *node) {
		n.p = serve(t, bin, n.log, n.args...)
		n.c = client.New(n.p.url)
	}
	down := func(n *node) {
		for _, id := range n.ids {
			if err := n.c.DeleteSandbox(context.Background(), id); err != nil && !client.IsNotFound(err) {
				t.Errorf("%s: delete %s: %v", n.name, id, err)
			}
		}
		n.ids = nil
		n.p.stop(t)
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			if n.p != nil && n.p.done != nil {
				down(n)
			}
			removeDataDir(n.dir)
			if t.Failed() {
				log, _ := os.ReadFile(n.log)
				t.Logf("%s's log:\n%s", n.name, log)
			}
		}
	})
	a := newNode("img-a", "a/", "--database", dbURL)
	b := newNode("img-b", "b/")
	up(a)
	up(b)

	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	prog, err := os.ReadFile(goagent)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []struct {
		name string
		mode int64
		body []byte
	}{{"root/", 0o700, nil}, {"etc/marker", 0o644, []byte("imported through img-a\n")}, {"opt/goagent", 0o755, prog}} {
		h := &tar.Header{Name: e.name, Mode: e.mode, Size: int64(len(e.body)), Typeflag: tar.TypeReg}
		if strings.HasSuffix(e.name, "/") {
			h.Typeflag = tar.TypeDir
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write(e.body)
	}
	tw.Close()
	img, err := a.c.ImportImage(ctx, "counter", &tb, -1)
	if err != nil {
		t.Fatalf("import through img-a: %v", err)
	}
	file := filepath.Join("images", "sha256", strings.TrimPrefix(img.Digest, "sha256:")+".erofs")

	// img-b: the name is not in its records, the file not in its data directory.
	if imgs, err := b.c.ListImages(ctx); err != nil || len(imgs) != 0 {
		t.Fatalf("img-b's images before: %+v %v", imgs, err)
	}
	sb := create(t, b.c, apiv1.CreateSandboxRequest{Image: "counter"})
	b.ids = append(b.ids, sb.ID)
	if sb.ImageDigest != img.Digest {
		t.Errorf("img-b's sandbox has image %s, want %s", sb.ImageDigest, img.Digest)
	}
	if got := readFile(t, b.c, sb.ID, "/etc/marker"); string(got) != "imported through img-a\n" {
		t.Errorf("/etc/marker in img-b's sandbox: %q", got)
	}
	if _, err := os.Stat(filepath.Join(b.dir, file)); err != nil {
		t.Errorf("img-b did not keep the image: %v", err)
	}
	if imgs, err := b.c.ListImages(ctx); err != nil || len(imgs) != 1 || imgs[0].Name != "counter" || imgs[0].Digest != img.Digest {
		t.Errorf("img-b's images after the create: %+v %v", imgs, err)
	}
	down(b)

	// A sandbox of the image on img-a, its program running, hibernated.
	sa := create(t, a.c, apiv1.CreateSandboxRequest{Image: "counter"})
	a.ids = append(a.ids, sa.ID)
	const port = 8103
	if _, err := a.c.ExecBackground(ctx, sa.ID, apiv1.ExecRequest{Cmd: []string{"/opt/goagent", "8103"}}); err != nil {
		t.Fatal(err)
	}
	var before hzGoAgentState
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if before, err = hzGoState(ctx, a.c, sa.ID, port); err == nil && before.Subscribed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("goagent in %s not up: %+v %v", sa.ID, before, err)
		}
	}
	if h := hibernate(t, a.c, sa.ID); h.Snapshot == nil || !h.Snapshot.Durable {
		t.Fatalf("hibernate on img-a: %+v", h.Snapshot)
	}
	a.ids = nil // the sandbox moves on with the records
	a.p.stop(t)

	// img-a's records on a new data directory; no host copy of the image is left.
	moved := newNode("img-a", "a/", "--database", dbURL)
	for _, name := range []string{"store", "store-id", "guest"} {
		if out, err := exec.Command("cp", "-a", filepath.Join(a.dir, name), moved.dir+"/").CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", name, err, out)
		}
	}
	removeDataDir(a.dir)
	removeDataDir(b.dir)
	up(moved)
	moved.ids = append(moved.ids, sa.ID)
	after, err := hzGoState(ctx, moved.c, sa.ID, port)
	if err != nil {
		t.Fatalf("resume on the new data directory: %v", err)
	}
	if after.Generation <= before.Generation || after.HookGeneration != after.Generation || after.Secret != before.Secret {
		t.Errorf("goagent after the resume: %+v, before %+v; want the same process, its resume hook run for the new generation", after, before)
	}
	if _, err := os.Stat(filepath.Join(moved.dir, file)); err != nil {
		t.Errorf("the resume did not fetch the image into the new data directory: %v", err)
	}
	t.Logf("image %s: imported on img-a, a sandbox on img-b, resumed on a new data directory (generation %d → %d)",
		img.Digest, before.Generation, after.Generation)
}
