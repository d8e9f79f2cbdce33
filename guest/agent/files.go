package agent

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/internal/atomicfile"
)

// maxUnsizedRead bounds files whose stat size is 0 (procfs and the like), read whole.
const maxUnsizedRead = 64 << 20

// filePath returns the cleaned absolute ?path= of r (under Options.Root), or
// writes a 400 and returns "".
func (s *server) filePath(w http.ResponseWriter, r *http.Request) string {
	p := r.URL.Query().Get("path")
	if p == "" || !filepath.IsAbs(p) {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "path must be absolute: "+strconv.Quote(p))
		return ""
	}
	return filepath.Join(s.root, filepath.Clean(p))
}

func (s *server) handleGetFile(w http.ResponseWriter, r *http.Request) {
	p := s.filePath(w, r)
	if p == "" {
		return
	}
	f, st, err := openForRead(p)
	if err != nil {
		fileError(w, err)
		return
	}
	defer f.Close()
	if st.IsDir() {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, p+" is a directory")
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	if size := st.Size(); size > 0 && st.Mode().IsRegular() {
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		io.CopyN(w, f, size)
		return
	}
	b, err := io.ReadAll(io.LimitReader(f, maxUnsizedRead))
	if err != nil {
		fileError(w, err)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	w.Write(b)
}

func (s *server) handlePutFile(w http.ResponseWriter, r *http.Request) {
	p := s.filePath(w, r)
	if p == "" {
		return
	}
	mode := os.FileMode(0o644)
	if m := r.URL.Query().Get("mode"); m != "" {
		v, err := strconv.ParseUint(m, 8, 32)
		if err != nil || v > 0o7777 {
			writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "mode must be octal, e.g. 0644: "+strconv.Quote(m))
			return
		}
		mode = os.FileMode(v & 0o777)
		if v&0o4000 != 0 {
			mode |= os.ModeSetuid
		}
		if v&0o2000 != 0 {
			mode |= os.ModeSetgid
		}
		if v&0o1000 != 0 {
			mode |= os.ModeSticky
		}
	}
	if st, err := os.Stat(p); err == nil && st.IsDir() {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, p+" is a directory")
		return
	}
	if err := writeFileAtomic(p, r.Body, mode); err != nil {
		s.log.Printf("put %s: %v", p, err)
		fileError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// writeFileAtomic replaces p with the bytes of src (atomicfile.WriteFrom:
// temporary file in p's directory, fsync, rename, fsync of the directory),
// mode mode. Missing parents are created 0755.
func writeFileAtomic(p string, src io.Reader, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return atomicfile.WriteFrom(p, src, mode)
}

// errNotReadable: a named pipe or a socket, which a file read does not take.
var errNotReadable = errors.New("not a file that can be read whole")

// openForRead opens the file at p for a file read and returns it with its
// stat. It opens without blocking (a named pipe with no writer would hold
// the read, and the sandbox's other calls behind it, until one came) and
// refuses a named pipe or a socket: errNotReadable (wrapped, naming p and
// what it is). Other errors are os.OpenFile's and Stat's.
func openForRead(p string) (*os.File, fs.FileInfo, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	switch t := st.Mode().Type(); {
	case t&fs.ModeNamedPipe != 0:
		f.Close()
		return nil, nil, fmt.Errorf("%s: a named pipe: %w (its reader would wait for a writer)", p, errNotReadable)
	case t&fs.ModeSocket != 0:
		f.Close()
		return nil, nil, fmt.Errorf("%s: a socket: %w", p, errNotReadable)
	}
	return f, st, nil
}

func fileError(w http.ResponseWriter, err error) {
	var mbe *http.MaxBytesError
	switch {
	case errors.Is(err, fs.ErrNotExist):
		writeError(w, http.StatusNotFound, proto.CodeNotFound, err.Error())
	case errors.Is(err, fs.ErrPermission), errors.Is(err, fs.ErrInvalid), errors.Is(err, syscall.ENOTDIR),
		errors.Is(err, syscall.EISDIR), errors.Is(err, errNotReadable), errors.As(err, &mbe):
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, err.Error())
	default:
		writeError(w, http.StatusInternalServerError, proto.CodeInternal, err.Error())
	}
}
