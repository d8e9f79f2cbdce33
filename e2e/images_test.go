package e2e

import (
	"archive/tar"
	"bytes"
	"testing"
	"time"

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
