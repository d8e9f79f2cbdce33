// Package image stores the read-only, content-addressed root filesystems that
// torpor sandboxes start from.
//
// An image is one EROFS file at <dir>/sha256/<hex>.erofs, where <hex> is the
// SHA-256 of that file; the digest "sha256:<hex>" is the image's identity. The
// files are written once (temp file, fsync, rename) with mode 0444 and are never
// changed or deleted by this package, so a digest recorded in a snapshot stays
// valid even after its name has been given to a newer build. Names ("base",
// "py-git") map to digests in the SQLite table "images", which Open creates.
//
// Images come from two sources:
//
//   - Build runs mmdebstrap (Debian bookworm, variant minbase, plus the given
//     packages) into a temporary directory.
//   - Import takes a "docker save" archive, an OCI image-layout archive or a
//     plain root-filesystem tarball (each optionally gzip-compressed), flattens
//     the layers with go-containerregistry and extracts them safely.
//
// Both then prepare the tree for gVisor (runsc) and pack it with
// "mkfs.erofs -E noinline_data" without compression, because gVisor's EROFS
// reader supports no incompatible features (docs/decisions/erofs-root.md). Preparing
// means:
//
//   - /.torpor exists, is empty and has mode 0755: the engine bind-mounts the
//     guest agent there;
//   - /etc/hostname is "sandbox" and /etc/hosts maps localhost (127.0.0.1 and
//     ::1) and "sandbox", so getfqdn() and friends answer at once;
//   - /etc/resolv.conf names no nameserver, so DNS lookups fail fast instead of
//     timing out (a sandbox has no reachable resolver);
//   - /tmp exists with mode 1777;
//   - where a Debian python3 is installed, /usr/lib/python3/dist-packages/torpor.pth
//     names /.torpor/python, where the manager puts torpor's Python SDK, so
//     `import torpor.resume` works in every sandbox.
//
// The engine gives gVisor the file as the root filesystem with the annotations
// dev.gvisor.spec.rootfs.source=<Store.Path(digest)>,
// dev.gvisor.spec.rootfs.type=erofs and dev.gvisor.spec.rootfs.overlay=memory.
//
// Two images are built in (Builtins), each made on first use by EnsureBuiltin
// and kept in the host's build cache (SetBuildCache) by recipe: "base"
// (BasePackages, torpor's default) and "e2b-base", the image of E2B's template
// "base" (docs/e2b.md): E2BBasePackages and E2B's account "user" (uid 1000,
// passwordless sudo), made by mmdebstrap customize hooks. A recipe's packages
// and hooks make the image's Source, e.g.
// "mmdebstrap:ca-certificates,coreutils,procps,python3".
//
// With a bucket (SetBucket; a server with an S3 snapshot store sets one), the
// stores of several hosts share their images through it: builds and imports
// upload the file under its digest, then the name's manifest, and a store
// that lacks a name or a digest a caller needs fetches it, checks its SHA-256
// and keeps it (Bucket, SetBucket; docs/multi-host.md). Images in the bucket
// are not encrypted.
//
// Temporary files and trees live in <dir>/tmp (same file system as the store,
// so the final rename is atomic); Open removes what a crashed process left
// there. The package needs root for Build (mmdebstrap) and to keep file
// ownership on Import.
package image
