package agent

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
	"github.com/torpor/torpor/guest/proto"
)

// envd is the agent's implementation of E2B's envd (see envd*.go and the package
// doc): the process table, the polled watchers and the streams open on them.
type envd struct {
	srv *server

	mu      sync.Mutex
	procs   map[int]*envdProc // running processes started through Start, by pid
	streams map[*envdStream]struct{}

	watchMu  sync.Mutex
	watchers map[string]*polledWatcher
}

func newEnvd(s *server) *envd {
	return &envd{srv: s, procs: map[int]*envdProc{}, streams: map[*envdStream]struct{}{},
		watchers: map[string]*polledWatcher{}}
}

// mount adds envd's routes to mux: the Connect services at their own paths and
// the plain HTTP routes under proto.EnvdPrefix.
func (e *envd) mount(mux *http.ServeMux) {
	mux.Handle(processconnect.NewProcessHandler(envdProcess{e}))
	mux.Handle(filesystemconnect.NewFilesystemHandler(envdFilesystem{e}))
	mux.HandleFunc("GET "+proto.PathEnvdHealth, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET "+proto.PathEnvdEnvs, e.handleEnvs)
	mux.HandleFunc("GET "+proto.PathEnvdFiles, e.handleGetFile)
	mux.HandleFunc("POST "+proto.PathEnvdFiles, e.handlePostFiles)
	mux.HandleFunc(proto.EnvdPrefix+"/", func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case proto.PathEnvdHealth, proto.PathEnvdEnvs, proto.PathEnvdFiles:
			envdHTTPError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed on "+strings.TrimPrefix(r.URL.Path, proto.EnvdPrefix))
		default:
			envdHTTPError(w, http.StatusNotFound, "no such envd endpoint: "+strings.TrimPrefix(r.URL.Path, proto.EnvdPrefix))
		}
	})
}

// envdUser is the user a request runs as.
type envdUser struct {
	name, home string
	uid, gid   uint32
	groups     []uint32
}

// lookupUser finds name in the sandbox's user database (/etc/passwd and
// /etc/group: the agent is built without cgo), through userDB. An unknown
// user is invalid_argument. The user is shared: callers do not change it.
func lookupUser(name string) (*envdUser, error) {
	return userDB.user(name)
}

// readUser is lookupUser without the cache.
func readUser(name string) (*envdUser, error) {
	u, err := user.Lookup(name)
	if err != nil {
		msg := fmt.Sprintf("user %q does not exist in this sandbox", name)
		if name == proto.EnvdDefaultUser {
			msg += fmt.Sprintf(" (%q is the default when a call names no user: name one, e.g. \"root\", or use an image with a %q account)", name, name)
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New(msg))
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("user %q has uid %q gid %q", name, u.Uid, u.Gid))
	}
	eu := &envdUser{name: u.Username, home: u.HomeDir, uid: uint32(uid), gid: uint32(gid), groups: []uint32{uint32(gid)}}
	if eu.home == "" {
		eu.home = "/"
	}
	if gids, err := u.GroupIds(); err == nil {
		for _, g := range gids {
			if v, err := strconv.ParseUint(g, 10, 32); err == nil && uint32(v) != eu.gid {
				eu.groups = append(eu.groups, uint32(v))
			}
		}
	}
	return eu, nil
}

// userOf returns the user an envd call names with "Authorization: Basic
// base64(<user>:)" (the password is ignored: the host front authenticates), or
// proto.EnvdDefaultUser.
func userOf(h http.Header) (*envdUser, error) {
	name := proto.EnvdDefaultUser
	if a := h.Get("Authorization"); a != "" {
		scheme, cred, _ := strings.Cut(a, " ")
		if !strings.EqualFold(scheme, "Basic") {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("authorization scheme %q: envd takes Basic base64(<user>:)", scheme))
		}
		b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
		if err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("authorization: %v", err))
		}
		if n, _, _ := strings.Cut(string(b), ":"); n != "" {
			name = n
		}
	}
	return lookupUser(name)
}

// userEnv is the environment of a command u runs: the agent's defaults, the
// sandbox env, then HOME, USER and LOGNAME of u, then the request's envs.
func (s *server) userEnv(u *envdUser, req map[string]string) ([]string, string) {
	return s.mergeEnv(map[string]string{"HOME": u.home, "USER": u.name, "LOGNAME": u.name}, req)
}

// resolve turns a path of an envd request into the sandbox path it names: "~"
// and "~/…" are the user's home, a relative path is taken from the home, and the
// result is cleaned. "" is the home itself.
func (u *envdUser) resolve(p string) (string, error) {
	switch {
	case p == "~":
		p = u.home
	case strings.HasPrefix(p, "~/"):
		p = filepath.Join(u.home, p[2:])
	case strings.HasPrefix(p, "~"):
		return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %q: only ~ (the user's own home) is expanded", p))
	}
	if strings.ContainsRune(p, 0) {
		return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %q contains a NUL byte", p))
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(u.home, p)
	}
	return filepath.Clean(p), nil
}

// host returns the host path of sandbox path p (under Options.Root).
func (e *envd) host(p string) string {
	if e.srv.root == "" {
		return p
	}
	return filepath.Join(e.srv.root, p)
}

// guest returns the sandbox path of host path hp (the inverse of host).
func (e *envd) guest(hp string) string {
	if e.srv.root == "" {
		return hp
	}
	rel, err := filepath.Rel(e.srv.root, hp)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return hp
	}
	return filepath.Join("/", rel)
}

// chown gives host path hp to u when the agent may (it runs as root in a
// sandbox; an unprivileged agent, in tests, leaves files to itself).
func chown(hp string, u *envdUser) error {
	if os.Geteuid() != 0 {
		return nil
	}
	return os.Lchown(hp, int(u.uid), int(u.gid))
}

// mkdirAllAs creates host directory hp and its missing parents with mode 0755,
// each one it creates owned by u.
func mkdirAllAs(hp string, u *envdUser) error {
	var missing []string
	for d := hp; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err == nil {
			if !st.IsDir() {
				return &fs.PathError{Op: "mkdir", Path: d, Err: syscall.ENOTDIR}
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		missing = append(missing, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := os.Mkdir(missing[i], 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err := chown(missing[i], u); err != nil {
			return err
		}
	}
	return nil
}

// fsError maps a filesystem error to the Connect code E2B's SDK turns into the
// matching exception (NotFound → FileNotFoundError, …); the message names the
// sandbox path (host paths are rewritten).
func (e *envd) fsError(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	msg := err.Error()
	if e.srv.root != "" {
		msg = strings.ReplaceAll(msg, e.srv.root, "")
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = connect.CodeNotFound
	case errors.Is(err, fs.ErrExist), errors.Is(err, syscall.ENOTEMPTY):
		code = connect.CodeAlreadyExists
	case errors.Is(err, fs.ErrPermission):
		code = connect.CodePermissionDenied
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, fs.ErrInvalid),
		errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.ELOOP):
		code = connect.CodeInvalidArgument
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = connect.CodeResourceExhausted
	}
	return connect.NewError(code, errors.New(msg))
}

// envdStream is one open server stream of envd (Start, Connect, WatchDir). The
// agent cuts every open stream when a resume or fork is announced (POST
// /resume): the host's end of it did not survive the checkpoint, and the
// goroutine serving it must not wait for a write to fail.
type envdStream struct {
	cancel context.CancelCauseFunc
}

// errStreamCut ends a stream that a hibernate cut; its client already saw its
// connection close.
var errStreamCut = connect.NewError(connect.CodeUnavailable, errors.New("the sandbox was hibernated: this stream was cut; connect again"))

// openStream registers a stream; ctx is cancelled when the sandbox resumes.
// The returned function unregisters it.
func (e *envd) openStream(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	st := &envdStream{cancel: cancel}
	e.mu.Lock()
	e.streams[st] = struct{}{}
	e.mu.Unlock()
	return ctx, func() {
		e.mu.Lock()
		delete(e.streams, st)
		e.mu.Unlock()
		cancel(nil)
	}
}

// cutStreams ends every open envd stream (the processes keep running).
func (e *envd) cutStreams() int {
	e.mu.Lock()
	all := make([]*envdStream, 0, len(e.streams))
	for st := range e.streams {
		all = append(all, st)
	}
	e.mu.Unlock()
	for _, st := range all {
		st.cancel(errStreamCut)
	}
	return len(all)
}

// streamEnd is what a stream handler returns when its context ended: the cut's
// error, or the context's.
func streamEnd(ctx context.Context) error {
	if c := context.Cause(ctx); errors.Is(c, errStreamCut) {
		return errStreamCut
	}
	return ctx.Err()
}

// DefaultKeepalive is the interval of keepalive events on a quiet envd stream
// when the request has no Keepalive-Ping-Interval header (seconds; E2B's SDK
// sends 50).
const DefaultKeepalive = 90 * time.Second

// keepaliveOf reads the Keepalive-Ping-Interval header (whole seconds).
func keepaliveOf(h http.Header) time.Duration {
	if n, err := strconv.ParseInt(strings.TrimSpace(h.Get("Keepalive-Ping-Interval")), 10, 32); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	return DefaultKeepalive
}
