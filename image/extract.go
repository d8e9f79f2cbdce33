package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"time"
)

// extractStats counts what extractTar did.
type extractStats struct {
	Entries int
	Skipped []string // device nodes, fifos and other entries not extracted
}

// cleanEntryName turns a tar entry name into a path relative to the root.
// Leading slashes and "./" are dropped (as GNU tar does); any ".." component
// is an error wrapping ErrInvalid. It returns "" for the root itself.
func cleanEntryName(name string) (string, error) {
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", invalidf("entry %q escapes the root (\"..\")", name)
		}
	}
	if strings.ContainsRune(name, 0) {
		return "", invalidf("entry %q has a NUL byte", name)
	}
	p := path.Clean("/" + name)
	if p == "/" {
		return "", nil
	}
	return p[1:], nil
}

// extractTar unpacks the tar stream r into the directory dir (which must
// exist). All file system access goes through os.Root, so neither ".." names
// nor symlinks in the archive can make it write outside dir; a ".." name is an
// error wrapping ErrInvalid. It keeps modes (incl. setuid, setgid, sticky),
// ownership (when run as root) and modification times, and creates
// directories, regular files, symlinks and hard links. Device nodes and fifos
// are skipped (and listed in the stats); a sparse file is an error wrapping
// ErrInvalid (its holes would be written out as zeros, whatever its size). A later entry replaces an earlier one
// of the same path, as in tar. Errors from reading r that show it is not a tar
// archive wrap ErrInvalid, as do entries whose path leads out of dir through a
// symlink of the archive (esc -> /tmp, then esc/file), which os.Root refuses.
func extractTar(ctx context.Context, r io.Reader, dir string) (st extractStats, err error) {
	defer func() {
		if escapesRoot(err) {
			err = invalidf("%v: the entry's path leads out of the image through a symlink the archive made", err)
		}
	}()
	root, err := os.OpenRoot(dir)
	if err != nil {
		return st, err
	}
	defer root.Close()
	isRoot := os.Geteuid() == 0

	type dirTime struct {
		name  string
		mtime time.Time
	}
	var dirTimes []dirTime

	tr := tar.NewReader(r)
	for {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if st.Entries == 0 && (errors.Is(err, tar.ErrHeader) || errors.Is(err, io.ErrUnexpectedEOF)) {
				return st, invalidf("not a tar archive: %v", err)
			}
			if errors.Is(err, tar.ErrHeader) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, tar.ErrInsecurePath) {
				return st, invalidf("corrupt tar archive after %d entries: %v", st.Entries, err)
			}
			return st, fmt.Errorf("read tar: %w", err)
		}
		st.Entries++
		if isSparse(hdr) {
			// Its holes read as zeros: a few KiB of archive could write a
			// file of any size (2^40 bytes filled the disk).
			return st, invalidf("entry %q: a sparse file (%d bytes): image archives must not hold sparse files (OCI image spec); archive it without --sparse", hdr.Name, hdr.Size)
		}
		name, err := cleanEntryName(hdr.Name)
		if err != nil {
			return st, err
		}
		mode := hdr.FileInfo().Mode()
		if name == "" {
			if hdr.Typeflag == tar.TypeDir {
				_ = root.Chmod(".", mode.Perm()|mode&(os.ModeSetuid|os.ModeSetgid|os.ModeSticky))
				if isRoot {
					_ = root.Lchown(".", hdr.Uid, hdr.Gid)
				}
			}
			continue
		}
		if parent := path.Dir(name); parent != "." {
			if err := mkdirAll(root, parent); err != nil {
				return st, fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
		}
		existing, lerr := root.Lstat(name)
		exists := lerr == nil
		// Replace what is there unless both are directories.
		if exists && !(existing.IsDir() && hdr.Typeflag == tar.TypeDir) {
			if err := root.RemoveAll(name); err != nil {
				return st, fmt.Errorf("entry %q: replace: %w", hdr.Name, err)
			}
			exists = false
		}

		switch hdr.Typeflag {
		case tar.TypeDir:
			if !exists {
				if err := root.Mkdir(name, 0o755); err != nil {
					return st, fmt.Errorf("entry %q: %w", hdr.Name, err)
				}
			}
			dirTimes = append(dirTimes, dirTime{name, hdr.ModTime})
		case tar.TypeReg, tar.TypeRegA:
			f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return st, fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
			_, err = io.Copy(f, ctxReader{ctx, tr})
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				if errors.Is(err, io.ErrUnexpectedEOF) {
					return st, invalidf("entry %q: truncated tar archive", hdr.Name)
				}
				return st, fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
		case tar.TypeSymlink:
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return st, fmt.Errorf("entry %q: symlink to %q: %w", hdr.Name, hdr.Linkname, err)
			}
			if isRoot {
				if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
					return st, fmt.Errorf("entry %q: %w", hdr.Name, err)
				}
			}
			continue // no chmod or chtimes on symlinks: they would follow the link
		case tar.TypeLink:
			target, err := cleanEntryName(hdr.Linkname)
			if err != nil {
				return st, fmt.Errorf("entry %q: hard link: %w", hdr.Name, err)
			}
			if target == "" {
				return st, invalidf("entry %q: hard link to the root", hdr.Name)
			}
			if err := root.Link(target, name); err != nil {
				return st, invalidf("entry %q: hard link to %q: %v", hdr.Name, hdr.Linkname, err)
			}
			continue // shares the target's inode, mode and owner
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			st.Skipped = append(st.Skipped, "/"+name)
			continue
		case tar.TypeXGlobalHeader:
			continue
		default:
			st.Skipped = append(st.Skipped, "/"+name)
			continue
		}

		if isRoot {
			if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
				return st, fmt.Errorf("entry %q: chown %d:%d: %w", hdr.Name, hdr.Uid, hdr.Gid, err)
			}
		}
		// After chown, which clears setuid/setgid bits.
		perm := mode.Perm() | mode&(os.ModeSetuid|os.ModeSetgid|os.ModeSticky)
		if err := root.Chmod(name, perm); err != nil {
			return st, fmt.Errorf("entry %q: chmod: %w", hdr.Name, err)
		}
		if hdr.Typeflag != tar.TypeDir && !hdr.ModTime.IsZero() {
			_ = root.Chtimes(name, hdr.ModTime, hdr.ModTime)
		}
	}
	if st.Entries == 0 {
		return st, invalidf("empty tar archive")
	}
	// Directory times last: creating entries inside changed them.
	for i := len(dirTimes) - 1; i >= 0; i-- {
		if d := dirTimes[i]; !d.mtime.IsZero() {
			_ = root.Chtimes(d.name, d.mtime, d.mtime)
		}
	}
	return st, nil
}

// isSparse says whether hdr is a sparse file: GNU's old format or PAX's
// GNU.sparse records (formats 0.0 to 1.0).
func isSparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

// escapesRoot reports whether err is os.Root's refusal of a path that leaves
// the root. Package os does not export that error; its text is matched (and
// TestImportRejects fails if it changes).
func escapesRoot(err error) bool {
	var pe *fs.PathError
	return errors.As(err, &pe) && pe.Err != nil && pe.Err.Error() == "path escapes from parent"
}

// mkdirAll creates dir and its parents (0755) inside root, replacing any
// non-directory in the way (tar semantics: the archive lists a file below it).
func mkdirAll(root *os.Root, dir string) error {
	fi, err := root.Stat(dir) // follows symlinks inside root: a/b with a -> usr/a is fine
	if err == nil {
		if fi.IsDir() {
			return nil
		}
		if err := root.Remove(dir); err != nil {
			return err
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if p := path.Dir(dir); p != "." {
		if err := mkdirAll(root, p); err != nil {
			return err
		}
	}
	if err := root.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// ctxReader stops reading when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
