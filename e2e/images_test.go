package e2e

import (
	"archive/tar"
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server/servertest"
)

// TestImageImportNoSilentReplace: importing over an existing image name is refused
// (409) unless the caller asks to replace it; the name keeps its image meanwhile.
func TestImageImportNoSilentReplace(t *testing.T) {
	srv := start(t, servertest.Options{})
	ctx := ctxFor(t, 2*time.Minute)
	tarball := func(content string) []byte {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		tw.WriteHeader(&tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755})
		tw.WriteHeader(&tar.Header{Name: "etc/marker", Mode: 0o644, Size: int64(len(content))})
		tw.Write([]byte(content))
		tw.Close()
		return b.Bytes()
	}
	first, err := srv.Client.ImportImage(ctx, "tiny", bytes.NewReader(tarball("one")), -1)
	if err != nil {
		t.Fatal(err)
	}
	_, err = srv.Client.ImportImage(ctx, "tiny", bytes.NewReader(tarball("two")), -1)
	if !client.IsConflict(err) {
		t.Fatalf("second import of the same name: %v, want 409 conflict", err)
	}
	imgs, _ := srv.Client.ListImages(ctx)
	for _, im := range imgs {
		if im.Name == "tiny" && im.Digest != first.Digest {
			t.Fatalf("the refused import changed the name's image")
		}
	}
	second, err := srv.Client.ReplaceImage(ctx, "tiny", bytes.NewReader(tarball("two")), -1)
	if err != nil || second.Digest == first.Digest {
		t.Fatalf("replace: %v (digest %s, first %s)", err, second.Digest, first.Digest)
	}
}

// TestImageBuildRefusesBuiltin: a build under a built-in image's name is refused
// with 409 before anything is built (a new-user trial's `{"name":"base",
// "packages":[]}` answered 200 and pointed base at a bare minbase, without
// python3, breaking every later default create); the name keeps its image.
func TestImageBuildRefusesBuiltin(t *testing.T) {
	srv := start(t, servertest.Options{})
	ctx := ctxFor(t, 2*time.Minute)
	before, err := srv.Client.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range []string{`{"name":"base","packages":[]}`, `{"name":"base","packages":["git"]}`, `{"name":"e2b-base","packages":["python3"]}`} {
		res := rawCall(t, "POST", srv.URL+"/v1/images/build", "application/json", []byte(body))
		if res.Status != 409 || res.Err.Code != apiv1.CodeConflict || !strings.Contains(res.Err.Message, "built-in image") ||
			!strings.Contains(res.Err.Message, "another name") {
			t.Errorf("build %s: HTTP %d %+v, want 409 conflict saying it is a built-in image and to use another name", body, res.Status, res.Err)
		}
	}
	after, err := srv.Client.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("images before %+v, after the refused builds %+v", before, after)
	}
	for i := range after {
		if after[i].Name != before[i].Name || after[i].Digest != before[i].Digest {
			t.Errorf("image %s changed: %s -> %s", after[i].Name, before[i].Digest, after[i].Digest)
		}
	}
}
