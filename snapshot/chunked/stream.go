package chunked

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/torpor/torpor/snapshot"
)

// Streaming opens: a cold resume that starts before its bytes are local.
//
// OpenStream, for a snapshot with no opened copy on this host, fetches it
// into a build directory as Open does and serves that directory read-only
// through FUSE (go-fuse) while it fills: a read of a range whose chunks have
// not arrived blocks until they are fetched and verified (sha256 against
// their ids, as every cold open), never returns a hole. Chunks are fetched
// in this order: every file but the memory file (the largest: pages.img for
// gVisor), then the chunks of the memory file that the last streamed resume
// of this snapshot or of its parent read before it was answered (the
// recorded working set, stored beside the manifest as workingsets/<id>.json),
// then the rest in file order; a read of a range not fetched yet moves its
// fetches to the front. Once every chunk is there the build directory becomes
// the opened copy, as after Open, and once the caller released the stream
// (its restore returned) and the last descriptor of a served file is closed
// (runsc --background closes pages.img when it has loaded every page) the
// mount goes away.
//
// What it buys depends on the restore: runsc restore without --background
// reads every byte of pages.img before it returns, so the stream only
// overlaps the fetch with the restore's other work; with --background the
// application runs once the kernel state is loaded and pages stream in
// behind it, a page the application touches first fetched first.
//
// Not streamed (OpenStream falls back to Open): a snapshot whose opened copy
// is on this host (a warm resume), a store with an encryption key (the build
// directory is plain text that must not outlive its restore), and a host
// where FUSE cannot be mounted (no /dev/fuse, not root): the first such
// failure is logged.

// streamSpan bounds a streaming fetch: smaller than a cold open's (a whole
// pack) so that a read waiting on a fetch waits for 2 MiB, not 8.
const streamSpan = 2 << 20

// workingSetKey is the backend object holding the working set recorded at
// the last streamed resume of a snapshot of sandbox id. It is kept per
// sandbox, not per snapshot: each hibernate makes a new snapshot and the
// previous one is usually deleted, while the chunks a resume needs are
// mostly the same from one snapshot to the next. Collect removes the record
// of a sandbox with no live snapshot.
func workingSetKey(sandboxID string) string { return "workingsets/" + sandboxID + ".json" }

// workingSet is the stored form of a recorded working set: the ids of the
// memory file's chunks a resume read on demand before it was answered, in
// the order of their first read (resumeRecord). Chunk ids survive a diff
// hibernate wherever memory did not change, so the next snapshot of the
// sandbox finds most of them.
type workingSet struct {
	Snapshot string   `json:"snapshot"` // the snapshot it was recorded on
	File     string   `json:"file"`
	Chunks   []string `json:"chunks"`
}

// collectWorkingSets removes the working sets of sandboxes not in keep
// (Collect; best effort, failures logged).
func (s *Store) collectWorkingSets(ctx context.Context, keep map[string]bool) {
	objs, err := s.b.List(ctx, "workingsets/")
	if err != nil {
		s.log.Warn("snapshot store: listing working sets failed", "err", err)
		return
	}
	for _, o := range objs {
		sbx := strings.TrimSuffix(path.Base(o.Key), ".json")
		if keep[sbx] {
			continue
		}
		if err := s.b.Delete(ctx, o.Key); err != nil && !isMissing(err) {
			s.log.Warn("snapshot store: deleting a working set failed", "key", o.Key, "err", err)
		}
	}
}

// streams are the live streams of a store (Close unmounts them).
type streams struct {
	mu       sync.Mutex
	live     map[*stream]struct{}
	disabled bool // a mount failed: streaming is off for this store
}

// stream is one streaming open.
type stream struct {
	s     *Store
	id    string
	d     doc
	build string // the files being fetched (open/.build-…)
	mnt   string // where they are served (open/.stream-…)
	plan  *fetchPlan
	big   int       // the memory file: the largest
	start [][]int64 // start[file][chunk]: the chunk's offset
	srv   *fuse.Server
	ctx   context.Context
	stop  context.CancelFunc
	// unlock releases the snapshot's opening lock, held until every chunk
	// is fetched (an Open of the same snapshot waits for the copy).
	unlock func()

	mu      sync.Mutex
	state   []uint8         // per fetch: pending, running, fetched
	fetched []chan struct{} // per fetch: closed once fetched
	urgent  []int32         // fetches a read waits on, most recent last
	order   []int32         // the fetch order (hinted first)
	next    int             // next index of order to take
	left    int             // fetches not fetched
	err     error           // the first fetch error: reads fail with EIO
	failed  chan struct{}   // closed with err
	handles int             // open descriptors of served files
	// released: the caller's restore returned; done: every chunk fetched
	// (or the stream failed); gone: unmounted.
	released, done, gone bool
	discard              bool // the build directory goes with the mount
	// The working set being recorded (await): the memory file's chunks
	// read on demand, first read first, until every chunk is fetched.
	// unfetched is the first fetch (in file order) not fetched yet.
	seen      map[string]bool
	touched   []string
	unfetched int32
	resumedOK bool // the caller's sandbox answered (Resumed)
	recorded  bool
	hinted    int // chunks of the working set used as a hint
	// interrupted counts the reads the kernel interrupted while they
	// waited (logged at the end).
	interrupted atomic.Int64
}

const (
	pending uint8 = iota
	running
	fetched
)

// OpenStream implements snapshot.Streamer (above). Errors are Open's: a
// snapshot the store does not have is snapshot.ErrNotFound; a failed fetch
// after OpenStream returned fails the reads that wait on it (EIO) and is
// logged.
func (s *Store) OpenStream(ctx context.Context, id string) (snapshot.Streamed, error) {
	plain := func() (snapshot.Streamed, error) {
		dir, m, err := s.Open(ctx, id)
		return snapshot.Streamed{Dir: dir, Manifest: m, Resumed: func() {}, Release: func() { s.Release(id) }}, err
	}
	s.streams.mu.Lock()
	off := s.streams.disabled
	s.streams.mu.Unlock()
	if off || s.key != nil {
		return plain()
	}
	if _, err := os.Stat(s.opened(id)); err == nil {
		return plain()
	}
	d, err := s.openDoc(ctx, id)
	if err != nil {
		return snapshot.Streamed{Manifest: d.Manifest}, err
	}
	if d.key != nil || len(d.Files) == 0 {
		return plain()
	}
	unlock := s.opening.lock(id)
	if _, err := os.Stat(s.opened(id)); err == nil { // built meanwhile
		unlock()
		return plain()
	}
	s.freshForOpen(ctx)
	st, err := s.startStream(ctx, id, d, unlock)
	if err != nil {
		unlock()
		var perr *mountError
		if errors.As(err, &perr) {
			s.streams.mu.Lock()
			s.streams.disabled = true
			s.streams.mu.Unlock()
			s.log.Warn("snapshot store: cannot serve snapshots through FUSE; cold resumes read whole copies", "err", err)
			return plain()
		}
		return snapshot.Streamed{Manifest: d.Manifest}, err
	}
	var once sync.Once
	return snapshot.Streamed{Dir: st.mnt, Manifest: d.Manifest, Streaming: true,
		Resumed: func() { once.Do(st.resumed) }, Release: st.release}, nil
}

// mountError is a failure to mount the FUSE file system.
type mountError struct{ err error }

func (e *mountError) Error() string { return "fuse mount: " + e.err.Error() }
func (e *mountError) Unwrap() error { return e.err }

func (s *Store) startStream(ctx context.Context, id string, d doc, unlock func()) (*stream, error) {
	tag := id + "-" + rnd()
	st := &stream{s: s, id: id, d: d, unlock: unlock, seen: map[string]bool{},
		build: filepath.Join(s.dir, "open", ".build-"+tag), mnt: filepath.Join(s.dir, "open", ".stream-"+tag),
		failed: make(chan struct{})}
	p, err := s.plan(ctx, id, st.build, d, streamSpan)
	st.plan = p
	fail := func(err error) (*stream, error) {
		p.close()
		_ = os.RemoveAll(st.build)
		_ = os.Remove(st.mnt)
		return nil, err
	}
	if err != nil {
		return fail(err)
	}
	st.big = biggest(d)
	st.start = make([][]int64, len(d.Files))
	for fi, fc := range d.Files {
		st.start[fi] = make([]int64, len(fc.Chunks))
		var off int64
		for j, r := range fc.Chunks {
			st.start[fi][j] = off
			off += r.Len
		}
	}
	n := len(p.fetches)
	st.state, st.fetched, st.left = make([]uint8, n), make([]chan struct{}, n), n
	for i := range st.fetched {
		st.fetched[i] = make(chan struct{})
	}
	st.order = st.fetchOrder(s.workingSetHint(ctx, d))
	if err := os.MkdirAll(st.mnt, 0o700); err != nil {
		return fail(err)
	}
	root := &streamDir{st: st, path: ""}
	timeout := time.Hour // the files never change
	srv, err := fs.Mount(st.mnt, root, &fs.Options{
		EntryTimeout: &timeout, AttrTimeout: &timeout,
		MountOptions: fuse.MountOptions{AllowOther: true, DirectMount: true, FsName: "torpor-" + id, Name: "torpor",
			MaxBackground: 64, MaxReadAhead: 1 << 20, DisableXAttrs: true},
	})
	if err != nil {
		return fail(&mountError{err})
	}
	st.srv = srv
	st.ctx, st.stop = context.WithCancel(context.Background())
	s.streams.mu.Lock()
	if s.streams.live == nil {
		s.streams.live = map[*stream]struct{}{}
	}
	s.streams.live[st] = struct{}{}
	s.streams.mu.Unlock()
	if st.left == 0 {
		go st.complete()
	}
	for w := 0; w < s.workers && w < n; w++ {
		go st.work()
	}
	return st, nil
}

// fetchOrder is the order fetches are taken in when no read waits: the
// small files', then those holding the hint's chunks (in its order), then
// the memory file's others. It sets hinted.
func (st *stream) fetchOrder(hint []string) []int32 {
	p := st.plan
	taken := make([]bool, len(p.fetches))
	var order []int32
	add := func(f int32) {
		if f >= 0 && !taken[f] {
			taken[f] = true
			order = append(order, f)
		}
	}
	for i, ft := range p.fetches {
		if ft.file != st.big {
			add(int32(i))
		}
	}
	if len(hint) > 0 {
		at := map[string]int32{}
		for j, r := range st.d.Files[st.big].Chunks {
			if r.ID != "" {
				if _, dup := at[r.ID]; !dup {
					at[r.ID] = p.of[st.big][j]
				}
			}
		}
		for _, c := range hint {
			if f, ok := at[c]; ok {
				st.hinted++
				add(f)
			}
		}
	}
	for i := range p.fetches {
		add(int32(i))
	}
	return order
}

// workingSetHint reads the working set recorded for d's sandbox; nil when
// there is none (or it cannot be read).
func (s *Store) workingSetHint(ctx context.Context, d doc) []string {
	sbx := d.Manifest.SandboxID
	if sbx == "" || checkID(sbx) != nil {
		return nil
	}
	b, err := getAll(ctx, s.b, workingSetKey(sbx))
	if err != nil {
		return nil
	}
	var ws workingSet
	if json.Unmarshal(b, &ws) != nil || ws.File != d.Files[biggest(d)].Name {
		return nil
	}
	return ws.Chunks
}

func biggest(d doc) int {
	big := 0
	for i, f := range d.Manifest.Files {
		if f.Bytes > d.Manifest.Files[big].Bytes {
			big = i
		}
	}
	return big
}

// work fetches until no fetch is pending.
func (st *stream) work() {
	for {
		i := st.take()
		if i < 0 {
			return
		}
		ft := st.plan.fetches[i]
		err := st.s.runFetch(st.ctx, st.id, st.d.Files[ft.file].Name, st.d.key, ft, true)
		st.finish(i, err)
	}
}

// take returns the next pending fetch (one a read waits on first), marked
// running, or -1.
func (st *stream) take() int32 {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.err != nil {
		return -1
	}
	for len(st.urgent) > 0 {
		i := st.urgent[len(st.urgent)-1]
		st.urgent = st.urgent[:len(st.urgent)-1]
		if st.state[i] == pending {
			st.state[i] = running
			return i
		}
	}
	for st.next < len(st.order) {
		i := st.order[st.next]
		st.next++
		if st.state[i] == pending {
			st.state[i] = running
			return i
		}
	}
	return -1
}

func (st *stream) finish(i int32, err error) {
	st.mu.Lock()
	if err != nil {
		if st.err == nil {
			st.err = err
			close(st.failed)
			st.stop()
			st.s.log.Error("snapshot store: streaming a snapshot failed; reads of what is missing fail", "snapshot", st.id, "err", err)
			go st.complete()
		}
		st.mu.Unlock()
		return
	}
	st.state[i] = fetched
	close(st.fetched[i])
	for int(st.unfetched) < len(st.state) && st.state[st.unfetched] == fetched {
		st.unfetched++
	}
	st.left--
	last := st.left == 0 && st.err == nil // a failure has completed the stream already
	st.mu.Unlock()
	if last {
		st.complete()
	}
}

// complete runs once every chunk is fetched, or after the first failure:
// the build directory becomes the opened copy (or is removed), the opening
// lock goes and the mount follows when nothing reads it any more.
func (st *stream) complete() {
	st.mu.Lock()
	failed := st.err != nil
	st.mu.Unlock()
	s := st.s
	if _, known := s.docs.get(st.id); !failed && !known {
		// Deleted meanwhile (Delete forgets the manifest): no copy to keep;
		// the files serve the restore until the mount goes.
		st.mu.Lock()
		st.discard = true
		st.mu.Unlock()
		failed = true
	}
	if !failed {
		if err := os.Rename(st.build, s.opened(st.id)); err != nil {
			s.log.Warn("snapshot store: keeping a streamed copy failed", "snapshot", st.id, "err", err)
		} else {
			d := st.d
			if d.keys == nil {
				d.keys = st.plan.keys
				s.docs.put(st.id, d)
			}
			s.useOpened(st.id)
		}
	}
	st.unlock()
	s.log.Info("snapshot store: streamed snapshot fetched", "snapshot", st.id, "failed", failed,
		"hinted_chunks", st.hinted, "interrupted_reads", st.interrupted.Load())
	st.mu.Lock()
	st.done = true
	st.mu.Unlock()
	st.storeWorkingSet()
	st.maybeUnmount()
}

// await blocks until the chunks of file fi in [off, end) are fetched,
// moving their fetches to the front; it records them while recording.
func (st *stream) await(ctx context.Context, fi int, off, end int64) error {
	starts := st.start[fi]
	j := sort.Search(len(starts), func(i int) bool { return starts[i] > off }) - 1
	var wait []chan struct{}
	st.mu.Lock()
	if st.err != nil {
		st.mu.Unlock()
		return st.err
	}
	last := int32(-1)
	for ; j >= 0 && j < len(starts) && starts[j] < end; j++ {
		f := st.plan.of[fi][j]
		if fi == st.big && !st.done && f >= st.unfetched+loaderWindow/streamSpan {
			if c := st.d.Files[fi].Chunks[j].ID; c != "" && !st.seen[c] {
				st.seen[c] = true
				st.touched = append(st.touched, c)
			}
		}
		if f < 0 || f == last {
			continue
		}
		last = f
		switch st.state[f] {
		case fetched:
			continue
		case pending:
			st.urgent = append(st.urgent, f)
		}
		wait = append(wait, st.fetched[f])
	}
	st.mu.Unlock()
	for _, w := range wait {
		stalled := time.NewTimer(stallWarning)
		for waiting := true; waiting; {
			select {
			case <-w:
				waiting = false
			case <-st.failed:
				stalled.Stop()
				return st.err
			case <-ctx.Done():
				stalled.Stop()
				return ctx.Err()
			case <-stalled.C:
				st.mu.Lock()
				nRunning, nPending := 0, 0
				for _, x := range st.state {
					switch x {
					case running:
						nRunning++
					case pending:
						nPending++
					}
				}
				st.s.log.Warn("snapshot store: a read of a streamed snapshot waits", "snapshot", st.id,
					"file", st.d.Files[fi].Name, "off", off, "end", end, "fetches_running", nRunning, "fetches_pending", nPending,
					"fetches_left", st.left, "urgent", len(st.urgent))
				st.mu.Unlock()
			}
		}
		stalled.Stop()
	}
	return nil
}

// stallWarning is how long a read waits before the stream logs its state.
const stallWarning = 5 * time.Second

// loaderWindow is how far ahead of its progress runsc's page loader reads:
// 128 reads of 256 KiB in flight (stateio's pages-file defaults), so the
// loader never reads further than this beyond the first byte not fetched
// yet. A read of the memory file further ahead is on demand (a page the
// application touched), not the loader's sequential pass: that is what the
// working set records.
const loaderWindow = 128 * 256 << 10

// resumed marks the resume answered: the working set recorded until every
// chunk is fetched is then stored.
func (st *stream) resumed() {
	st.mu.Lock()
	st.resumedOK = true
	st.mu.Unlock()
	st.storeWorkingSet()
}

// storeWorkingSet stores the recorded working set, once, when the resume was
// answered and every chunk is fetched (in the background; a failure is
// logged). A stream that failed records nothing.
func (st *stream) storeWorkingSet() {
	st.mu.Lock()
	if st.recorded || !st.resumedOK || !st.done || st.err != nil {
		st.mu.Unlock()
		return
	}
	st.recorded = true
	ws := workingSet{Snapshot: st.id, File: st.d.Files[st.big].Name, Chunks: st.touched}
	sbx := st.d.Manifest.SandboxID
	st.mu.Unlock()
	if sbx == "" || checkID(sbx) != nil {
		return
	}
	go func() {
		b, err := json.Marshal(ws)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			err = st.s.b.Put(ctx, workingSetKey(sbx), bytes.NewReader(b), int64(len(b)))
			cancel()
		}
		if err != nil {
			st.s.log.Warn("snapshot store: recording a working set failed", "snapshot", st.id, "err", err)
		} else {
			st.s.log.Debug("snapshot store: working set recorded", "snapshot", st.id, "chunks", len(ws.Chunks), "hinted", st.hinted)
		}
	}()
}

// release is the caller's: its restore returned.
func (st *stream) release() {
	st.mu.Lock()
	st.released = true
	st.mu.Unlock()
	st.maybeUnmount()
}

func (st *stream) maybeUnmount() {
	st.mu.Lock()
	if st.gone || !st.released || !st.done || st.handles > 0 {
		st.mu.Unlock()
		return
	}
	st.gone = true
	st.mu.Unlock()
	go st.unmount(false)
}

// unmount removes the mount (detached when forced: a reader gets ENOTCONN)
// and what the stream leaves behind.
func (st *stream) unmount(force bool) {
	if force {
		// A reader may hold a descriptor for long (the sandbox loading
		// pages): detach, and do not wait for the connection to end.
		st.stop()
		_ = unix.Unmount(st.mnt, unix.MNT_DETACH)
	} else {
		if err := st.srv.Unmount(); err != nil {
			_ = unix.Unmount(st.mnt, unix.MNT_DETACH)
		}
		st.srv.Wait()
	}
	_ = os.Remove(st.mnt)
	st.plan.close()
	st.mu.Lock()
	failed := st.err != nil || st.discard
	st.mu.Unlock()
	if failed || force {
		_ = os.RemoveAll(st.build) // renamed away when complete
	}
	st.s.streams.mu.Lock()
	delete(st.s.streams.live, st)
	st.s.streams.mu.Unlock()
}

// closeWait is how long Close waits for streams to finish by themselves: a
// restore still loading pages from a mount that goes fails (ENOTCONN), and
// its sandbox with it.
const closeWait = 30 * time.Second

// closeStreams unmounts every stream (Close), after waiting up to closeWait
// for them to end by themselves.
func (s *Store) closeStreams() {
	var live []*stream
	for deadline := time.Now().Add(closeWait); ; time.Sleep(20 * time.Millisecond) {
		s.streams.mu.Lock()
		live = live[:0]
		for st := range s.streams.live {
			live = append(live, st)
		}
		s.streams.mu.Unlock()
		if len(live) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for _, st := range live {
		st.mu.Lock()
		gone := st.gone
		st.gone = true
		st.mu.Unlock()
		if !gone {
			st.unmount(true)
		}
	}
}

// removeStaleStreams detaches and removes the mounts a crashed process left
// (New): their server is gone, so they answer ENOTCONN.
func removeStaleStreams(dir string) {
	ents, _ := os.ReadDir(filepath.Join(dir, "open"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".stream-") {
			p := filepath.Join(dir, "open", e.Name())
			_ = unix.Unmount(p, unix.MNT_DETACH)
			_ = os.Remove(p)
		}
	}
}

// streamDir is a directory of a served snapshot ("" the root).
type streamDir struct {
	fs.Inode
	st   *stream
	path string
}

var _ = (fs.NodeOnAdder)((*streamDir)(nil))

// OnAdd adds the snapshot's files (the root) and their directories.
func (r *streamDir) OnAdd(ctx context.Context) {
	if r.path != "" {
		return
	}
	for fi, fc := range r.st.d.Files {
		parent := &r.Inode
		parts := strings.Split(fc.Name, "/")
		for k, part := range parts[:len(parts)-1] {
			ch := parent.GetChild(part)
			if ch == nil {
				ch = parent.NewPersistentInode(ctx, &streamDir{st: r.st, path: strings.Join(parts[:k+1], "/")},
					fs.StableAttr{Mode: fuse.S_IFDIR})
				parent.AddChild(part, ch, false)
			}
			parent = ch
		}
		f := &streamFile{st: r.st, fi: fi, size: r.st.d.Manifest.Files[fi].Bytes}
		parent.AddChild(parts[len(parts)-1], parent.NewPersistentInode(ctx, f, fs.StableAttr{Mode: fuse.S_IFREG}), false)
	}
}

// streamFile is one file of a served snapshot.
type streamFile struct {
	fs.Inode
	st   *stream
	fi   int
	size int64
}

var (
	_ = (fs.NodeGetattrer)((*streamFile)(nil))
	_ = (fs.NodeOpener)((*streamFile)(nil))
	_ = (fs.NodeReader)((*streamFile)(nil))
	_ = (fs.NodeReleaser)((*streamFile)(nil))
)

func (f *streamFile) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFREG | 0o444
	out.Size = uint64(f.size)
	out.Blocks = (uint64(f.size) + 511) / 512
	out.Nlink = 1
	return 0
}

func (f *streamFile) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	f.st.mu.Lock()
	f.st.handles++
	f.st.mu.Unlock()
	// A handle of its own: go-fuse tells Release only of opens that
	// returned one.
	return &streamHandle{}, fuse.FOPEN_KEEP_CACHE, 0
}

// streamHandle is an open descriptor of a served file.
type streamHandle struct{}

func (f *streamFile) Release(ctx context.Context, fh fs.FileHandle) syscall.Errno {
	f.st.mu.Lock()
	f.st.handles--
	f.st.mu.Unlock()
	f.st.maybeUnmount()
	return 0
}

func (f *streamFile) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if off >= f.size || len(dest) == 0 {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), f.size)
	// Not ctx: the kernel interrupts a waiting read whenever its thread
	// gets a signal, and gVisor's sentry signals its threads all the time;
	// an EINTR would fail runsc's page loading (and the sandbox with it). A
	// read ends when its bytes are there or the stream failed.
	err := f.st.await(context.Background(), f.fi, off, end)
	if ctx.Err() != nil {
		f.st.interrupted.Add(1)
	}
	if err != nil {
		return nil, syscall.EIO
	}
	// Spliced from the build file where the kernel allows, else read
	// into dest: no copy through this process's memory.
	return fuse.ReadResultFd(f.st.plan.files[f.fi].Fd(), off, int(end-off)), 0
}
