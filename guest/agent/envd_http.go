package agent

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
)

// envdIOChunk is the size of the pieces /files reads and writes: uploads
// into the file, gzip-encoded answers onto the connection.
const envdIOChunk = 256 << 10

// envdHTTPError writes envd's error body {"code":<status>,"message":"…"}, which
// E2B's SDK reads (404 → FileNotFoundError for files, 400 → InvalidArgumentError).
func envdHTTPError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{status, msg})
}

// envdHTTPFail writes err (a connect error from the user or path checks, or a
// filesystem error) with the matching HTTP status.
func (e *envd) envdHTTPFail(w http.ResponseWriter, err error) {
	ce := new(connect.Error)
	if !errors.As(e.fsError(err), &ce) {
		envdHTTPError(w, http.StatusInternalServerError, err.Error())
		return
	}
	status := http.StatusInternalServerError
	switch ce.Code() {
	case connect.CodeNotFound:
		status = http.StatusNotFound
	case connect.CodeInvalidArgument, connect.CodeAlreadyExists:
		status = http.StatusBadRequest
	case connect.CodePermissionDenied:
		status = http.StatusForbidden
	case connect.CodeResourceExhausted:
		status = http.StatusInsufficientStorage
	}
	envdHTTPError(w, status, ce.Message())
}

// httpUser is the user of a /files request: ?username=, else the Basic
// authorization header, else the default user.
func httpUser(r *http.Request) (*envdUser, error) {
	if n := r.URL.Query().Get("username"); n != "" {
		return lookupUser(n)
	}
	return userOf(r.Header)
}

// handleEnvs answers the sandbox env (envd's GET /envs).
func (e *envd) handleEnvs(w http.ResponseWriter, r *http.Request) {
	env := e.srv.env
	if env == nil {
		env = map[string]string{}
	}
	writeJSON(w, http.StatusOK, env)
}

// handleGetFile answers a file's bytes (envd's GET /files?path=&username=),
// gzip-encoded when the request accepts gzip.
func (e *envd) handleGetFile(w http.ResponseWriter, r *http.Request) {
	u, err := httpUser(r)
	if err != nil {
		e.envdHTTPFail(w, err)
		return
	}
	p, err := u.resolve(r.URL.Query().Get("path"))
	if err != nil {
		e.envdHTTPFail(w, err)
		return
	}
	hp := e.host(p)
	f, st, err := openForRead(hp)
	if err != nil {
		switch {
		case errors.Is(err, fs.ErrNotExist):
			envdHTTPError(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
		case errors.Is(err, errNotReadable):
			envdHTTPError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is not a file that can be read whole (a named pipe or a socket)", p))
		default:
			e.envdHTTPFail(w, err)
		}
		return
	}
	defer f.Close()
	if st.IsDir() {
		envdHTTPError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", p))
		return
	}
	w.Header().Set("Vary", "Accept-Encoding")
	if acceptsGzip(r.Header.Get("Accept-Encoding")) && r.Header.Get("Range") == "" {
		ct := mime.TypeByExtension(filepath.Ext(p))
		if ct == "" {
			ct = "application/octet-stream"
		}
		w.Header().Set("Content-Type", ct)
		w.Header().Set("Content-Encoding", "gzip")
		// BestSpeed: the answer crosses the host's loopback or a LAN to the
		// client, and the default level spends several times the CPU of
		// level 1 on incompressible bytes (2.5x to 5x for 1 MiB of text or
		// of random bytes on the test machine) for little smaller output.
		// The compressor writes a few hundred bytes at a time: buffered, the
		// answer leaves in envdIOChunk pieces.
		bw := bufio.NewWriterSize(w, envdIOChunk)
		gw, _ := gzip.NewWriterLevel(bw, gzip.BestSpeed)
		if _, err := io.Copy(gw, f); err != nil {
			e.srv.log.Printf("envd: get %s: %v", p, err)
		}
		gw.Close()
		bw.Flush()
		return
	}
	if !st.Mode().IsRegular() {
		// procfs and devices: no seek, no size.
		w.Header().Set("Content-Type", "application/octet-stream")
		io.Copy(w, io.LimitReader(f, maxUnsizedRead))
		return
	}
	http.ServeContent(w, r, filepath.Base(p), st.ModTime(), f)
}

// acceptsGzip reports whether an Accept-Encoding value lists gzip with a
// non-zero quality.
func acceptsGzip(v string) bool {
	for _, part := range strings.Split(v, ",") {
		name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if !strings.EqualFold(strings.TrimSpace(name), "gzip") {
			continue
		}
		q := strings.ReplaceAll(strings.TrimSpace(params), " ", "")
		return q != "q=0" && q != "q=0.0" && q != "q=0.00" && q != "q=0.000"
	}
	return false
}

// writtenFile is one entry of the answer of POST /files.
type writtenFile struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"` // as read back from the file
}

// uploadBody is an upload's gzip stream or multipart part: its corrupt or cut
// data is the request's error (400), not the agent's; what names it.
type uploadBody struct {
	r    io.Reader
	what string
}

func (b uploadBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err != nil && err != io.EOF {
		err = connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: %w", b.what, err))
	}
	return n, err
}

// handlePostFiles writes files (envd's POST /files?path=&username=): the body
// of an application/octet-stream request is the file at ?path=; a
// multipart/form-data body carries one file per "file" part, at ?path= or, when
// it is absent, at the part's file name (which may hold directories). The body
// may be gzip-encoded (Content-Encoding: gzip). Missing parent directories are
// created; what is created is owned by the user. The X-Metadata-<key>
// headers become each file's whole metadata (envd_metadata.go). It answers
// [{"path","name","type":"file","metadata"?}].
func (e *envd) handlePostFiles(w http.ResponseWriter, r *http.Request) {
	u, err := httpUser(r)
	if err != nil {
		e.envdHTTPFail(w, err)
		return
	}
	md, err := metadataOf(r.Header)
	if err != nil {
		envdHTTPError(w, http.StatusBadRequest, err.Error())
		return
	}
	body := io.Reader(r.Body)
	if strings.EqualFold(strings.TrimSpace(r.Header.Get("Content-Encoding")), "gzip") {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			envdHTTPError(w, http.StatusBadRequest, "gzip body: "+err.Error())
			return
		}
		defer gz.Close()
		body = uploadBody{gz, "gzip body"}
	}
	query := r.URL.Query()
	hasPath := query.Has("path") && query.Get("path") != ""
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []writtenFile
	write := func(path string, src io.Reader) bool {
		p, err := u.resolve(path)
		if err != nil {
			e.envdHTTPFail(w, err)
			return false
		}
		for _, f := range out {
			if f.Path == p {
				envdHTTPError(w, http.StatusBadRequest, fmt.Sprintf("two files of one upload name the same path '%s'", p))
				return false
			}
		}
		hp := e.host(p)
		if err := e.writeAs(hp, src, u, md); err != nil {
			e.srv.log.Printf("envd: write %s: %v", p, err)
			e.envdHTTPFail(w, err)
			return false
		}
		out = append(out, writtenFile{Path: p, Name: filepath.Base(p), Type: "file", Metadata: metadataAt(hp)})
		return true
	}
	switch {
	case mt == "application/octet-stream":
		if !hasPath {
			envdHTTPError(w, http.StatusBadRequest, "path query parameter is required for an application/octet-stream upload")
			return
		}
		if !write(query.Get("path"), body) {
			return
		}
	case strings.HasPrefix(mt, "multipart/"):
		if params["boundary"] == "" {
			envdHTTPError(w, http.StatusBadRequest, "multipart body without a boundary")
			return
		}
		// multipart.Reader reads through a 4 KiB buffer and hands out parts
		// in pieces of that size; under gVisor every system call costs
		// microseconds, so the body is read, and each file written, in
		// envdIOChunk pieces (writeAs): a 1 MiB upload took 2 to 3 times as
		// long as the same bytes sent as application/octet-stream.
		mr := multipart.NewReader(bufio.NewReaderSize(body, envdIOChunk), params["boundary"])
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				envdHTTPError(w, http.StatusBadRequest, "multipart body: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			path := query.Get("path")
			if !hasPath {
				path = partFileName(part.Header.Get("Content-Disposition"))
				if path == "" {
					part.Close()
					envdHTTPError(w, http.StatusBadRequest, "a file part without a file name, and no path query parameter")
					return
				}
			}
			ok := write(path, uploadBody{part, "multipart part"})
			part.Close()
			if !ok {
				return
			}
		}
	default:
		envdHTTPError(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type %q: send multipart/form-data or application/octet-stream", r.Header.Get("Content-Type")))
		return
	}
	if out == nil {
		out = []writtenFile{}
	}
	b, _ := json.Marshal(out)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(b)
}

// partFileName is the filename of a Content-Disposition value with its
// directories (mime/multipart's FileName keeps only the base name).
func partFileName(cd string) string {
	_, params, err := mime.ParseMediaType(cd)
	if err != nil {
		return ""
	}
	return params["filename"]
}

// writeAs writes src to host path hp in place, as E2B's envd does (an existing
// file keeps its mode; a new one gets 0666 less the umask): missing parents are
// created owned by u, the file is owned by u, and md becomes its whole
// metadata (setMetadata).
func (e *envd) writeAs(hp string, src io.Reader, u *envdUser, md map[string]string) error {
	if err := mkdirAllAs(filepath.Dir(hp), u); err != nil {
		return err
	}
	st, err := os.Stat(hp)
	if err == nil && st.IsDir() {
		return &fs.PathError{Op: "write", Path: hp, Err: syscall.EISDIR}
	}
	existed := err == nil
	f, err := os.OpenFile(hp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		return err
	}
	if err := chown(hp, u); err != nil {
		f.Close()
		return err
	}
	// Without its ReadFrom, f cannot take the copy over from the buffer.
	bw := bufio.NewWriterSize(struct{ io.Writer }{f}, envdIOChunk)
	_, err = io.Copy(bw, src)
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		f.Close()
		return e.writeFailed(hp, existed, err)
	}
	if err := setMetadata(f, md); err != nil {
		if !xattrUnsupported(err) {
			f.Close()
			return err
		}
		e.srv.log.Printf("envd: %v: the file is written without its metadata", err)
	}
	return f.Close()
}

// writeFailed is the error of an upload to hp cut by err: the part written
// is not left to fill the sandbox (a file the write made is removed, one it
// truncated is left empty), and a full file system is named as the
// sandbox's own (its writable layer or /tmp lives in sandbox memory and has
// its size; the host's disk is not the one that is full).
func (e *envd) writeFailed(hp string, existed bool, err error) error {
	if existed {
		os.Truncate(hp, 0)
	} else {
		os.Remove(hp)
	}
	if !errors.Is(err, syscall.ENOSPC) && !errors.Is(err, syscall.EDQUOT) {
		return err
	}
	var sfs syscall.Statfs_t
	size := ""
	if syscall.Statfs(filepath.Dir(hp), &sfs) == nil {
		size = fmt.Sprintf(" of %d MiB", uint64(sfs.Blocks)*uint64(sfs.Bsize)>>20)
	}
	return fmt.Errorf("write %s: the sandbox's file system%s is full (the writable layer and /tmp live in sandbox memory; the host's disk is not full); nothing of this upload was kept: free space in the sandbox or create it with more memory: %w", hp, size, err)
}
