package agent

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"syscall"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// File metadata (envd 0.6.2): an upload's X-Metadata-<key>: <value> headers
// become the extended attributes user.e2b.<key> of the written file, with the
// key lower-cased (HTTP header names are case-insensitive), and EntryInfo
// reports them back, without the prefix. An upload replaces the whole set:
// keys it does not name are removed, so a file written again without
// metadata has none. A file system without user extended attributes (procfs,
// some volumes) keeps the file and no metadata, as E2B's envd does.
const (
	metadataHeaderPrefix = "X-Metadata-"
	metadataXattrPrefix  = "user.e2b."
	// maxMetadataKey is the longest key: Linux limits an attribute's name,
	// prefix included, to 255 bytes.
	maxMetadataKey = 255 - len(metadataXattrPrefix)
	// maxMetadataTotal bounds one file's metadata, names (with the prefix)
	// and values summed, in bytes: what one ext4 block holds, E2B's limit.
	maxMetadataTotal = 4096
)

// metadataOf returns the X-Metadata-* headers of h as keys (lower case, without
// the prefix) and values (a header sent twice: its first value); nil when
// there are none. A key or value outside printable ASCII, a key longer than
// maxMetadataKey or a set larger than maxMetadataTotal is an error (400).
func metadataOf(h http.Header) (map[string]string, error) {
	var md map[string]string
	total := 0
	for name, values := range h {
		if len(values) == 0 || len(name) <= len(metadataHeaderPrefix) || !strings.EqualFold(name[:len(metadataHeaderPrefix)], metadataHeaderPrefix) {
			continue
		}
		key, value := strings.ToLower(name[len(metadataHeaderPrefix):]), values[0]
		if len(key) > maxMetadataKey {
			return nil, fmt.Errorf("metadata key %q is longer than %d bytes", key, maxMetadataKey)
		}
		if err := printableASCII("key", key); err != nil {
			return nil, err
		}
		if err := printableASCII(fmt.Sprintf("value of key %q", key), value); err != nil {
			return nil, err
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = value
		total += len(metadataXattrPrefix) + len(key) + len(value)
	}
	if total > maxMetadataTotal {
		return nil, fmt.Errorf("metadata of %d bytes (keys with the prefix %q, and values): at most %d", total, metadataXattrPrefix, maxMetadataTotal)
	}
	return md, nil
}

func printableASCII(what, s string) error {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return fmt.Errorf("metadata %s has byte 0x%02x at %d: only printable ASCII", what, s[i], i)
		}
	}
	return nil
}

// xattrUnsupported reports whether err says the file system keeps no (user)
// extended attributes.
func xattrUnsupported(err error) bool {
	return errors.Is(err, syscall.ENOTSUP) || errors.Is(err, syscall.EOPNOTSUPP)
}

// setMetadata makes md the whole metadata of the open file f: attributes
// user.e2b.* that md lacks are removed, md's are set. A file system without
// user extended attributes is not an error when md is empty.
func setMetadata(f *os.File, md map[string]string) error {
	names, err := flistxattr(f)
	if err != nil {
		if xattrUnsupported(err) && len(md) == 0 {
			return nil
		}
		return fmt.Errorf("metadata of %s: %w", f.Name(), err)
	}
	fd := int(f.Fd())
	for _, n := range names {
		if k, ok := strings.CutPrefix(n, metadataXattrPrefix); ok {
			if _, keep := md[k]; !keep {
				if err := unix.Fremovexattr(fd, n); err != nil && !errors.Is(err, unix.ENODATA) {
					return fmt.Errorf("metadata of %s: remove %s: %w", f.Name(), n, err)
				}
			}
		}
	}
	for k, v := range md {
		if err := unix.Fsetxattr(fd, metadataXattrPrefix+k, []byte(v), 0); err != nil {
			return fmt.Errorf("metadata of %s: set %s: %w", f.Name(), metadataXattrPrefix+k, err)
		}
	}
	return nil
}

// metadataAt reads the metadata of host path hp (following a symlink): nil
// when it has none, when the file system keeps no extended attributes or the
// file cannot be read. Attributes that are not valid UTF-8 (set inside the
// sandbox with setfattr, say) are left out: EntryInfo's map needs UTF-8.
func metadataAt(hp string) map[string]string {
	names, err := listxattr(hp)
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, n := range names {
		k, ok := strings.CutPrefix(n, metadataXattrPrefix)
		if !ok {
			continue
		}
		v, err := getxattr(hp, n)
		if err != nil || !utf8.ValidString(k) || !utf8.Valid(v) {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[k] = string(v)
	}
	return md
}

// listxattr, flistxattr and getxattr call the system calls with a buffer that
// grows until the answer fits (another process may add attributes between
// the size query and the read).
func listxattr(hp string) ([]string, error) {
	return xattrNames(func(b []byte) (int, error) { return unix.Listxattr(hp, b) })
}

func flistxattr(f *os.File) ([]string, error) {
	fd := int(f.Fd())
	return xattrNames(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) })
}

func xattrNames(list func([]byte) (int, error)) ([]string, error) {
	b, err := xattrRead(list)
	if err != nil || len(b) == 0 {
		return nil, err
	}
	var names []string
	for _, n := range bytes.Split(bytes.TrimRight(b, "\x00"), []byte{0}) {
		names = append(names, string(n))
	}
	sort.Strings(names)
	return names, nil
}

func getxattr(hp, name string) ([]byte, error) {
	return xattrRead(func(b []byte) (int, error) { return unix.Getxattr(hp, name, b) })
}

func xattrRead(call func([]byte) (int, error)) ([]byte, error) {
	for range 4 {
		n, err := call(nil)
		if err != nil || n == 0 {
			return nil, err
		}
		b := make([]byte, n)
		n, err = call(b)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return b[:n], nil
	}
	return nil, unix.ERANGE
}
