package gvisor

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
)

// Portable snapshots: runsc restore refuses a spec whose gVisor annotations
// differ from the checkpointed one's (runsc/specutils/restore.go,
// validateAnnotations; mount sources may change, the rootfs source may not),
// so a snapshot taken with the image at <data-dir>/images/sha256/<digest>.erofs
// could only be restored where the data directory has the same path. Sandboxes
// therefore boot from a path that is the same on every host:
// rootfsLinkDir/<digest>.erofs, a symlink to the image file (runsc opens it
// with os.Open, which follows it). An image is named by its content's digest,
// so any data directory's copy of it is a valid target.
const rootfsLinkDir = "/run/torpor/rootfs/sha256"

// rootfsRecord is the file, in a checkpoint's image directory, that records
// the rootfs source the instance was started with; Restore starts from the
// same. Snapshots without it (taken before) restore from the image's own path.
const rootfsRecord = "torpor-rootfs"

// rootfsAnnotation is the OCI annotation gVisor reads the rootfs image from.
const rootfsAnnotation = "dev.gvisor.spec.rootfs.source"

var digestName = regexp.MustCompile(`^[0-9a-f]{64}\.erofs$`)

var linkSeq atomic.Int64

// stableRootfs returns the host-independent path for image file image
// (absolute), making sure the symlink there resolves: image itself when it is
// not named <sha256>.erofs inside a sha256 directory (then the path is used as
// it is). Errors come from creating the symlink.
func stableRootfs(image string) (string, error) {
	if !digestName.MatchString(filepath.Base(image)) || filepath.Base(filepath.Dir(image)) != "sha256" {
		return image, nil
	}
	link := filepath.Join(rootfsLinkDir, filepath.Base(image))
	return link, ensureLink(link, image)
}

// ensureLink makes link a symlink to target unless it already resolves to an
// existing file (another data directory's copy of the same image). The link is
// replaced atomically (a new symlink renamed over it).
func ensureLink(link, target string) error {
	if cur, err := os.Readlink(link); err == nil && cur == target {
		return nil
	}
	if st, err := os.Stat(link); err == nil && st.Mode().IsRegular() {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		return fmt.Errorf("gvisor: rootfs link: %w", err)
	}
	tmp := fmt.Sprintf("%s.%d-%d.tmp", link, os.Getpid(), linkSeq.Add(1))
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return fmt.Errorf("gvisor: rootfs link: %w", err)
	}
	if err := os.Rename(tmp, link); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("gvisor: rootfs link: %w", err)
	}
	return nil
}

// restoreRootfs returns the rootfs source a restore from imageDir must use
// with image file image: the recorded one (its symlink re-made to point at
// image when it is one of rootfsLinkDir's), else image.
func restoreRootfs(imageDir, image string) (string, error) {
	b, err := os.ReadFile(filepath.Join(imageDir, rootfsRecord))
	if os.IsNotExist(err) {
		return image, nil
	}
	if err != nil {
		return "", fmt.Errorf("gvisor: %w", err)
	}
	rec := strings.TrimSpace(string(b))
	if !filepath.IsAbs(rec) {
		return "", fmt.Errorf("gvisor: %s: rootfs %q is not an absolute path", filepath.Join(imageDir, rootfsRecord), rec)
	}
	if filepath.Dir(rec) == rootfsLinkDir {
		if filepath.Base(rec) != filepath.Base(image) {
			return "", fmt.Errorf("gvisor: snapshot was taken from image %s, restore asked for %s", filepath.Base(rec), filepath.Base(image))
		}
		return rec, ensureLink(rec, image)
	}
	return rec, nil
}

// recordRootfs writes into checkpoint directory dir the rootfs source that
// instance id was started with (from its bundle's config.json).
func (e *Engine) recordRootfs(id, dir string) error {
	b, err := os.ReadFile(filepath.Join(e.bundle(id), "config.json"))
	if err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: %w", id, err)
	}
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: bundle config: %w", id, err)
	}
	src := spec.Annotations[rootfsAnnotation]
	if src == "" {
		return fmt.Errorf("gvisor: checkpoint %s: bundle config has no %s", id, rootfsAnnotation)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, rootfsRecord), []byte(src+"\n"), 0o644)
}
