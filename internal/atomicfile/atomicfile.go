// Package atomicfile writes files so that a crash leaves either the old content or
// the new one at a path, never a torn mix: the bytes go to a temporary file in the
// same directory, which is fsynced, closed and renamed over the path, and then the
// directory is fsynced so the rename itself survives a power loss.
//
// Every durable small write of torpor's (store ids, manifests, the image index,
// the guest agent's uploads and resume state, the Go SDK's journal) goes through
// this package, so there is one implementation of the sequence to get right.
package atomicfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// WriteFile replaces path with data, created with mode perm (before the umask).
// It returns the first error of create, write, fsync, close, rename or the
// directory's fsync, wrapped with the path; on error the temporary file is
// removed and path is unchanged.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	return WriteFrom(path, bytes.NewReader(data), perm)
}

// WriteFrom replaces path with everything r yields until io.EOF, like WriteFile.
// A read error of r fails the write and leaves path unchanged.
func WriteFrom(path string, r io.Reader, perm os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	err = f.Chmod(perm)
	if err == nil {
		_, err = io.Copy(f, r)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := SyncDir(dir); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// SyncDir fsyncs directory dir, so that entries created, renamed or removed in it
// are durable. A file system that cannot sync a directory (os.ErrInvalid, as some
// FUSE and 9p mounts answer) is not an error: there is nothing more to do there.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}
