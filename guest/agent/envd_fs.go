package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	"github.com/fsnotify/fsnotify"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
)

// entryInfo describes the entry at sandbox path p (host path hp) without
// following a final symlink, as E2B's envd does: a symlink's type and mode are
// its target's (type unspecified when the target is missing), symlink_target
// where it points, permissions Go's mode string ("-rw-r--r--", "drwxr-xr-x",
// "Lrwxrwxrwx"), owner and group by name (their number when unknown).
func (e *envd) entryInfo(p, hp string) (*filesystem.EntryInfo, error) {
	st, err := os.Lstat(hp)
	if err != nil {
		return nil, err
	}
	return e.entryOf(p, hp, st, nil), nil
}

// entryOf is entryInfo of an entry already stat'ed. names, when not nil,
// keeps the owner and group names found, for the next entries of one call.
func (e *envd) entryOf(p, hp string, st fs.FileInfo, names *idNames) *filesystem.EntryInfo {
	mode := st.Mode()
	ent := &filesystem.EntryInfo{
		Name:         st.Name(),
		Path:         p,
		Size:         st.Size(),
		Permissions:  mode.String(),
		ModifiedTime: timestamppb.New(st.ModTime()),
		Type:         fileType(mode),
		Mode:         uint32(mode.Perm()),
	}
	if mode&fs.ModeSymlink != 0 {
		target := p
		if t, err := filepath.EvalSymlinks(hp); err == nil {
			target = e.guest(t)
		}
		ent.SymlinkTarget = &target
		if tst, err := os.Stat(hp); err == nil {
			ent.Type, ent.Mode = fileType(tst.Mode()), uint32(tst.Mode().Perm())
		} else {
			ent.Type, ent.Mode = filesystem.FileType_FILE_TYPE_UNSPECIFIED, 0
		}
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		ent.Owner, ent.Group = names.of(sys.Uid, sys.Gid)
	}
	ent.Metadata = metadataAt(hp)
	return ent
}

func fileType(m fs.FileMode) filesystem.FileType {
	switch {
	case m.IsRegular():
		return filesystem.FileType_FILE_TYPE_FILE
	case m.IsDir():
		return filesystem.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		return filesystem.FileType_FILE_TYPE_SYMLINK
	default:
		return filesystem.FileType_FILE_TYPE_UNSPECIFIED
	}
}

// idNames keeps the names of the uids and gids one call has seen: each lookup
// reads /etc/passwd or /etc/group, a fraction of a millisecond under gVisor
// for every entry of a ListDir otherwise. A nil *idNames keeps none.
type idNames struct {
	owners, groups map[uint32]string
}

// of is ownerNames, remembered.
func (n *idNames) of(uid, gid uint32) (owner, group string) {
	if n == nil {
		return ownerNames(uid, gid)
	}
	owner, okU := n.owners[uid]
	group, okG := n.groups[gid]
	if okU && okG {
		return owner, group
	}
	owner, group = ownerNames(uid, gid)
	if n.owners == nil {
		n.owners, n.groups = map[uint32]string{}, map[uint32]string{}
	}
	n.owners[uid], n.groups[gid] = owner, group
	return owner, group
}

// ownerNames names uid and gid from the sandbox's user database, or gives
// their numbers (through userDB).
func ownerNames(uid, gid uint32) (owner, group string) { return userDB.names(uid, gid) }

// readNames is ownerNames without the cache.
func readNames(uid, gid uint32) (owner, group string) {
	owner, group = strconv.FormatUint(uint64(uid), 10), strconv.FormatUint(uint64(gid), 10)
	if u, err := user.LookupId(owner); err == nil {
		owner = u.Username
	}
	if g, err := user.LookupGroupId(group); err == nil {
		group = g.Name
	}
	return owner, group
}

// envdFilesystem serves filesystem.Filesystem. File contents go through
// /envd/files (envd_http.go). Files are changed with the agent's own rights
// (root in a sandbox), as E2B's envd does; what a call creates is owned by its
// user.
type envdFilesystem struct{ e *envd }

// pathOf resolves a request's path for the user its headers name; it returns
// the sandbox path and the host path.
func (h envdFilesystem) pathOf(hdr http.Header, p string) (*envdUser, string, string, error) {
	u, err := userOf(hdr)
	if err != nil {
		return nil, "", "", err
	}
	gp, err := u.resolve(p)
	if err != nil {
		return nil, "", "", err
	}
	return u, gp, h.e.host(gp), nil
}

func (h envdFilesystem) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	_, p, hp, err := h.pathOf(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	ent, err := h.e.entryInfo(p, hp)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: ent}), nil
}

func (h envdFilesystem) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	u, p, hp, err := h.pathOf(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(hp); err == nil {
		if st.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", p))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s exists and is not a directory", p))
	}
	if err := mkdirAllAs(hp, u); err != nil {
		return nil, h.e.fsError(err)
	}
	ent, err := h.e.entryInfo(p, hp)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: ent}), nil
}

func (h envdFilesystem) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	u, _, hsrc, err := h.pathOf(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	dst, err := u.resolve(req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	hdst := h.e.host(dst)
	if _, err := os.Lstat(hsrc); err != nil {
		return nil, h.e.fsError(err)
	}
	if err := mkdirAllAs(filepath.Dir(hdst), u); err != nil {
		return nil, h.e.fsError(err)
	}
	if err := os.Rename(hsrc, hdst); err != nil {
		return nil, h.e.fsError(err)
	}
	ent, err := h.e.entryInfo(dst, hdst)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: ent}), nil
}

func (h envdFilesystem) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	_, p, hp, err := h.pathOf(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	if err := os.RemoveAll(hp); err != nil {
		return nil, h.e.fsError(err)
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

// ListDir lists a directory (a symlink to one is followed) down to depth
// levels (0 is 1): entries of subdirectories come after their directory, each
// with its path under the path asked for; symlinks inside are not followed.
func (h envdFilesystem) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	_, p, hp, err := h.pathOf(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	st, err := os.Stat(hp)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", p))
	}
	real, err := filepath.EvalSymlinks(hp)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	var out []*filesystem.EntryInfo
	names := &idNames{}
	err = filepath.WalkDir(real, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == real {
				return err
			}
			return nil // an entry that vanished or cannot be read is left out
		}
		if path == real {
			return nil
		}
		rel, _ := filepath.Rel(real, path)
		level := strings.Count(rel, string(filepath.Separator)) + 1
		info, ierr := d.Info()
		if ierr == nil {
			out = append(out, h.e.entryOf(filepath.Join(p, rel), path, info, names))
		}
		if d.IsDir() && level >= depth {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return nil, h.e.fsError(err)
	}
	return connect.NewResponse(&filesystem.ListDirResponse{Entries: out}), nil
}

// watch is one directory watch: inotify through fsnotify, on the directory and,
// when recursive, on every directory below it (directories created later are
// added as their create event arrives).
type watch struct {
	e         *envd
	w         *fsnotify.Watcher
	root      string // host path of the watched directory
	recursive bool
	entries   bool // include_entry
}

func (h envdFilesystem) newWatch(hdr http.Header, path string, recursive, entries bool) (*watch, error) {
	_, p, hp, err := h.pathOf(hdr, path)
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(hp)
	if err != nil {
		return nil, h.e.fsError(err)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", p))
	}
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch %s: %w", p, err))
	}
	w := &watch{e: h.e, w: fw, root: hp, recursive: recursive, entries: entries}
	if err := w.add(hp); err != nil {
		fw.Close()
		return nil, h.e.fsError(err)
	}
	return w, nil
}

// add watches dir, and with recursive every directory below it.
func (w *watch) add(dir string) error {
	if !w.recursive {
		return w.w.Add(dir)
	}
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == dir {
				return err
			}
			return nil
		}
		if d.IsDir() {
			if err := w.w.Add(path); err != nil && path == dir {
				return err
			}
		}
		return nil
	})
}

// events turns one fsnotify event into envd's (one per operation it carries).
func (w *watch) events(ev fsnotify.Event) []*filesystem.FilesystemEvent {
	if w.recursive && ev.Has(fsnotify.Create) {
		if st, err := os.Lstat(ev.Name); err == nil && st.IsDir() {
			w.add(ev.Name)
		}
	}
	name, err := filepath.Rel(w.root, ev.Name)
	if err != nil {
		return nil
	}
	var entry *filesystem.EntryInfo
	if w.entries {
		entry, _ = w.e.entryInfo(w.e.guest(ev.Name), ev.Name)
	}
	var out []*filesystem.FilesystemEvent
	for _, op := range []struct {
		op fsnotify.Op
		t  filesystem.EventType
	}{
		{fsnotify.Create, filesystem.EventType_EVENT_TYPE_CREATE},
		{fsnotify.Rename, filesystem.EventType_EVENT_TYPE_RENAME},
		{fsnotify.Chmod, filesystem.EventType_EVENT_TYPE_CHMOD},
		{fsnotify.Write, filesystem.EventType_EVENT_TYPE_WRITE},
		{fsnotify.Remove, filesystem.EventType_EVENT_TYPE_REMOVE},
	} {
		if ev.Has(op.op) {
			out = append(out, &filesystem.FilesystemEvent{Name: name, Type: op.t, Entry: entry})
		}
	}
	return out
}

func (h envdFilesystem) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	w, err := h.newWatch(req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		return err
	}
	defer w.w.Close()
	ctx, done := h.e.openStream(ctx)
	defer done()
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	ka := keepaliveOf(req.Header())
	t := time.NewTimer(ka)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return streamEnd(ctx)
		case <-t.C:
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
			t.Reset(ka)
		case err := <-w.w.Errors:
			return connect.NewError(connect.CodeInternal, fmt.Errorf("watch: %v", err))
		case ev, ok := <-w.w.Events:
			if !ok {
				return connect.NewError(connect.CodeInternal, errors.New("watch: the watcher closed"))
			}
			for _, fe := range w.events(ev) {
				if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
					return err
				}
			}
			t.Reset(ka)
		}
	}
}

// maxPolledEvents bounds the events a polled watcher keeps between two
// GetWatcherEvents; older ones are dropped.
const maxPolledEvents = 10000

// polledWatcher is a watch whose events wait for GetWatcherEvents.
type polledWatcher struct {
	w      *watch
	mu     sync.Mutex
	events []*filesystem.FilesystemEvent
	err    error
	done   chan struct{}
}

func (h envdFilesystem) CreateWatcher(ctx context.Context, req *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	w, err := h.newWatch(req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		return nil, err
	}
	var b [8]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	pw := &polledWatcher{w: w, done: make(chan struct{})}
	go func() {
		for {
			select {
			case <-pw.done:
				return
			case err, ok := <-w.w.Errors:
				if !ok {
					return
				}
				pw.mu.Lock()
				pw.err = err
				pw.mu.Unlock()
			case ev, ok := <-w.w.Events:
				if !ok {
					return
				}
				fes := w.events(ev)
				pw.mu.Lock()
				pw.events = append(pw.events, fes...)
				if n := len(pw.events) - maxPolledEvents; n > 0 {
					pw.events = pw.events[n:]
				}
				pw.mu.Unlock()
			}
		}
	}()
	h.e.watchMu.Lock()
	h.e.watchers[id] = pw
	h.e.watchMu.Unlock()
	return connect.NewResponse(&filesystem.CreateWatcherResponse{WatcherId: id}), nil
}

func (h envdFilesystem) watcher(id string) (*polledWatcher, error) {
	h.e.watchMu.Lock()
	defer h.e.watchMu.Unlock()
	if pw := h.e.watchers[id]; pw != nil {
		return pw, nil
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
}

func (h envdFilesystem) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	pw, err := h.watcher(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	evs, werr := pw.events, pw.err
	pw.events, pw.err = nil, nil
	pw.mu.Unlock()
	if werr != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watcher %s: %v", req.Msg.GetWatcherId(), werr))
	}
	return connect.NewResponse(&filesystem.GetWatcherEventsResponse{Events: evs}), nil
}

func (h envdFilesystem) RemoveWatcher(ctx context.Context, req *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	id := req.Msg.GetWatcherId()
	h.e.watchMu.Lock()
	pw := h.e.watchers[id]
	delete(h.e.watchers, id)
	h.e.watchMu.Unlock()
	if pw == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
	}
	close(pw.done)
	pw.w.w.Close()
	return connect.NewResponse(&filesystem.RemoveWatcherResponse{}), nil
}
