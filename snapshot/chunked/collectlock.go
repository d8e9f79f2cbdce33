package chunked

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Several stores on one backend (nodes of a cluster sharing an S3 prefix)
// collect garbage one at a time, and never while any of them is committing,
// through a CollectLock (Config.CollectLock): commits hold it shared,
// Collect takes it exclusively or skips its round.
//
// Why that is enough, in the order things happen (node A commits, node B
// collects):
//
//  1. B takes the lock exclusively (try-lock: if any commit or upload holds it
//     shared, on any node, B skips this round and tries again later; a
//     waiting collector never queues commits behind it).
//  2. B re-lists the backend's pack indexes (every node's packs), then lists
//     every manifest in the backend and computes what they reference. No
//     commit runs anywhere (step 1), so every manifest that will ever name a
//     chunk B could delete is already written and listed — except those of
//     A's pending asynchronous snapshots, whose manifests are in A's outbox:
//     A holds the lock shared from such a commit until its outbox is empty
//     (holdForPending), so B does not get it meanwhile; and an upload, under
//     the lock and after step 5, refuses to write a manifest naming a chunk
//     the backend no longer has (upload.go: "not in the outbox").
//  3. Before its first deletion B writes a new collection generation
//     (gcGenKey); before every deletion it checks that its lock is still
//     held (a lost database session has released it: B stops). The window
//     left is one deletion long: if B's session ends after that check and a
//     commit starts, refreshes and names a chunk of the pack B is deleting
//     before the deletion lands, that commit's snapshot misses the chunk.
//     It needs B's database connection to fail in the middle of a
//     collection, the database to notice at once, and a commit to reuse an
//     unreferenced chunk within one S3 request's time.
//  4. B releases the lock.
//  5. A takes the lock shared for a commit, then reads the generation. If it
//     differs from the one its index was last refreshed at, some collection
//     may have deleted packs A's index still names: A re-lists the pack
//     indexes (dropping the packs gone) before it decides which chunks exist.
//     Only then does it deduplicate (parent matches, existence checks), write
//     its packs and its manifest.
//  6. After the manifest is written A checks that its lock is still held. A
//     session advisory lock is lost only with its session, which never comes
//     back, so held now means held since step 5: no collection ran in
//     between. If it was lost, A deletes the manifest it wrote and the commit
//     fails (the staged files stay; a retry works): a collection that ran
//     meanwhile may have deleted what it names, but nothing opens a
//     snapshot whose commit failed. (Only a failure to delete that manifest
//     leaves it; it is logged as an error.)
//  7. A releases the lock.
//
// Steps 1 and 5 exclude each other, so a collection either ends before a
// commit starts deciding (and the commit sees its generation and forgets the
// deleted packs) or starts after the commit's manifest is written (and the
// collection lists it). Deleted chunks were unreferenced when B listed, and
// nothing can reference them later without re-listing first.
//
// A collection on a shared backend keeps every copy of a referenced chunk
// (another node may read from any of them). It rewrites a mostly dead pack
// (repack, gc.go) as on a single store, but keeps in the new pack every chunk
// a manifest references, not only those its own index locates there (another
// node's may), and deletes the old pack only once the new one is durable in
// the backend, as a deletion of step 3 (lock still held, generation written).
// Another node's index still locates the moved chunks in the old pack until it
// refreshes: its next commit does first (step 5: the generation changed), and
// its opens as below (the moved chunk is then found in the new pack).
//
// Opens (resumes) take no lock, but their index must follow other stores'
// collections too: a collection deletes pack P with chunk c (unreferenced
// then), a later commit elsewhere stores c again in P', and an index filled
// before the collection still places c in P; an open reading c there finds
// it missing although the bucket has it (the cluster benchmark's failure).
// So a cold open re-lists the pack indexes when the generation changed since
// its last look (freshForOpen), its reload for a chunk it cannot place drops
// the packs that are gone (refreshKnown, not the merging loadKnown), and a
// chunk still missing where the index placed it (a collection overlapped
// that refresh) makes it refresh and read again (refreshAfterMissing).
// Every chunk a committed snapshot names stays in the bucket as long as the
// snapshot is listed, though not always in the same pack: a rewrite (repack)
// moves it to a new pack written before the old one is deleted, so a listing
// after the deletion finds it. One round can move several packs an open
// reads, one after another while the open reads again: the open reads again
// as long as each refresh finds the missing chunk in a new place
// (maxMissingRereads bounds it; TestClusterOpenAcrossSeveralRepacks).

// CollectLock is the lock by which stores sharing one backend keep garbage
// collection away from commits (see above). Every store on the backend must
// use the same lock (in a cluster: a PostgreSQL advisory lock on a key derived
// from the store id, metadata/postgres.DB.CollectLock).
//
// Shared blocks until the lock is held shared (only an exclusive holder
// delays it), or ctx ends. TryExclusive takes it exclusively only if nobody
// holds it: ok is false at once otherwise. Both return release (call it
// exactly once; it never fails) and held, which returns nil while the lock
// is still held and an error once it is lost (its database session ended).
// Errors: the lock's store cannot be reached.
type CollectLock interface {
	Shared(ctx context.Context) (release func(), held func(context.Context) error, err error)
	TryExclusive(ctx context.Context) (release func(), held func(context.Context) error, ok bool, err error)
}

// LocalCollectLock is a CollectLock for stores in one process (a
// sync.RWMutex): tests of several stores on one backend, and hosts that
// share a backend's directory between processes of one program. A store
// without Config.CollectLock uses none: it is the backend's only user.
type LocalCollectLock struct{ mu sync.RWMutex }

// Shared implements CollectLock; it never fails and is never lost.
func (l *LocalCollectLock) Shared(ctx context.Context) (func(), func(context.Context) error, error) {
	got := make(chan struct{})
	go func() { l.mu.RLock(); close(got) }()
	select {
	case <-got:
		return l.mu.RUnlock, heldAlways, nil
	case <-ctx.Done():
		go func() { <-got; l.mu.RUnlock() }()
		return nil, nil, ctx.Err()
	}
}

// TryExclusive implements CollectLock.
func (l *LocalCollectLock) TryExclusive(context.Context) (func(), func(context.Context) error, bool, error) {
	if !l.mu.TryLock() {
		return nil, nil, false, nil
	}
	return l.mu.Unlock, heldAlways, true, nil
}

func heldAlways(context.Context) error { return nil }

// ErrCollectBusy: Collect skipped its round because a commit (on this or
// another store sharing the backend) holds the CollectLock.
var ErrCollectBusy = errors.New("collect: skipped: a commit holds the collection lock")

// gcGenKey is the object in which a collection on a shared backend records
// its generation (random) before its first deletion.
const gcGenKey = "gc/generation"

// readGCGen returns the backend's collection generation ("" before the first).
func readGCGen(ctx context.Context, b Backend) (string, error) {
	rc, err := b.Get(ctx, gcGenKey)
	if isMissing(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	defer rc.Close()
	v, err := io.ReadAll(io.LimitReader(rc, 256))
	return string(v), err
}

// clusterState is what a store sharing its backend keeps for the
// CollectLock (Store.gc.cluster); nil fields without Config.CollectLock.
type clusterState struct {
	lock CollectLock
	// mu guards gen and the pending hold. Held across holdForPending's
	// Shared (which waits only while another store collects); no store
	// lock is taken under it, and lockCommit takes it only briefly.
	mu sync.Mutex
	// gen is the collection generation at which idx.known was last
	// refreshed (or written by this store's own collection).
	gen string
	// pendingRelease and pendingHeld hold the lock shared while
	// asynchronous snapshots wait in the outbox (their manifests are
	// invisible to other stores' collections); nil while none does.
	pendingRelease func()
	pendingHeld    func(context.Context) error
	// openGen is the collection generation at which the index was last
	// refreshed for a cold open (freshForOpen); its own lock, never held
	// with another.
	openMu  sync.Mutex
	openGen string
}

// freshForOpen brings the index up to date with other stores' collections
// before a cold open reads chunks from a shared backend: where a collection
// elsewhere deleted a pack this store's index still names, and a later commit
// stored the same chunk again in another pack, the open would read the
// deleted pack and find the chunk missing (the cluster benchmark's failure,
// TestClusterResumeAfterAnotherNodeCollected). One read of the generation per
// cold open; a listing of the pack indexes when it changed. Without
// Config.CollectLock it does nothing: no other store deletes. An unreachable
// backend is logged, not returned: the open may still be served by the cache.
//
// A refresh here may overlap a collection (no lock is taken), so it can keep a
// pack being deleted; that pack holds only unreferenced chunks, and an open
// that later meets one of its chunks in a newer snapshot refreshes again
// (Open's retry on a missing chunk). It never sets gen: commits refresh under
// the lock.
func (s *Store) freshForOpen(ctx context.Context) {
	c := s.gc.cluster
	if c == nil {
		return
	}
	gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	gen, err := readGCGen(gctx, s.b)
	cancel()
	if err != nil {
		s.log.Warn("snapshot open: collection generation unreadable; using the index as it is", "err", err)
		return
	}
	c.openMu.Lock()
	stale := gen != c.openGen
	c.openMu.Unlock()
	if !stale {
		return
	}
	if err := s.refreshKnown(ctx); err != nil {
		s.log.Warn("snapshot open: refreshing the pack index", "err", err)
		return
	}
	c.openMu.Lock()
	c.openGen = gen
	c.openMu.Unlock()
}

// chunkMissing is the *snapshot.CorruptError of a chunk that is in none of
// the places the index knows for it (errors.As finds the CorruptError): chunk
// id, looked for at in tier (nil: the index placed it nowhere).
type chunkMissing struct {
	*snapshot.CorruptError
	id   string
	tier Backend
	at   chunkLoc
}

func (e chunkMissing) Unwrap() error { return e.CorruptError }

// maxMissingRereads bounds how many times one open reads again after a chunk
// was missing (refreshAfterMissing).
const maxMissingRereads = 8

// refreshAfterMissing says whether an open that failed with err should be
// tried again: on a shared backend a chunk found missing may have been moved
// (another store's collection rewrote its pack) or deleted where this store's
// index placed it and stored again elsewhere by another store (a collection
// overlapping freshForOpen's refresh). The index is refreshed first, and the
// open is tried again only if the refresh found the chunk in another place
// than where it was missing: else it is missing. Elsewhere a missing chunk is
// missing.
func (s *Store) refreshAfterMissing(ctx context.Context, err error) bool {
	var m chunkMissing
	if s.gc.cluster == nil || !errors.As(err, &m) || ctx.Err() != nil {
		return false
	}
	if rerr := s.refreshKnown(ctx); rerr != nil {
		s.log.Warn("snapshot open: refreshing the pack index after a missing chunk", "err", rerr)
		return false
	}
	if tier, l, ok := s.locate(m.id); !ok || tier == m.tier && l == m.at {
		return false
	}
	s.log.Info("snapshot open: a chunk was missing where the index placed it; trying again with the index refreshed", "err", err)
	return true
}

// lockCommit takes the collection lock shared for a commit or an upload and,
// when another store's collection ran since this store's index was last
// refreshed, refreshes it (step 5 above). Without Config.CollectLock it does
// nothing. An error (the lock or, for a synchronous commit, the backend's
// generation cannot be read) fails the commit: it must not proceed unlocked.
func (s *Store) lockCommit(ctx context.Context, async bool) (release func(), held func(context.Context) error, err error) {
	c := s.gc.cluster
	if c == nil {
		return func() {}, heldAlways, nil
	}
	release, held, err = sharedRetrying(ctx, c.lock)
	if err != nil {
		return nil, nil, fmt.Errorf("collection lock: %w: %w", snapshot.ErrLockUnavailable, err)
	}
	// An asynchronous commit does not wait for a hung S3 (as Stage: 3 s).
	wait := 10 * time.Second
	if async {
		wait = 3 * time.Second
	}
	gctx, cancel := context.WithTimeout(ctx, wait)
	gen, err := readGCGen(gctx, s.b)
	cancel()
	if err != nil {
		if async {
			// The backend is out of reach (the reason to commit
			// asynchronously): no collection can delete in it either.
			// A collection that ran before the outage and since the last
			// refresh is the risk left; docs/snapshot-store.md says so.
			s.log.Warn("snapshot commit: collection generation unreadable; deduplicating against the index as it is", "err", err)
			return release, held, nil
		}
		release()
		return nil, nil, fmt.Errorf("collection generation: %w", err)
	}
	c.mu.Lock()
	stale := gen != c.gen
	c.mu.Unlock()
	if stale {
		if err := s.refreshKnown(ctx); err != nil {
			release()
			return nil, nil, err
		}
		c.mu.Lock()
		c.gen = gen
		c.mu.Unlock()
	}
	return release, held, nil
}

// Taking the collection lock for a commit is retried while its store (the
// database) does not answer, so that a database that blips (restarted,
// failed over) does not fail a hibernate outright: attempts commitLockTries
// times in all, the waits between them doubling from commitLockRetry, all
// within commitLockWait (and ctx). An attempt that waits for a collection
// holding the lock exclusively counts against commitLockWait too (a
// connection held unanswered cannot be told from it): a commit that gets no
// lock within it fails with snapshot.ErrLockUnavailable, its staged files
// kept (the manager commits them later).
const (
	commitLockTries = 5
	commitLockRetry = 500 * time.Millisecond
	commitLockWait  = 15 * time.Second
)

// sharedRetrying is lock.Shared, tried again (see commitLockTries) when it
// fails; the error is the last attempt's, saying how many failed.
func sharedRetrying(ctx context.Context, lock CollectLock) (release func(), held func(context.Context) error, err error) {
	start := time.Now()
	deadline := start.Add(commitLockWait)
	wait := commitLockRetry
	for try := 1; ; try++ {
		actx, cancel := context.WithDeadline(ctx, deadline)
		release, held, err = lock.Shared(actx)
		cancel()
		if err == nil {
			return release, held, nil
		}
		if ctx.Err() != nil || try == commitLockTries || time.Now().Add(wait).After(deadline) {
			return nil, nil, fmt.Errorf("%w (%d attempts in %s)", err, try, time.Since(start).Round(100*time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(wait):
		}
		wait *= 2
	}
}

// holdForPending takes the lock shared for as long as asynchronous snapshots
// wait in the outbox (released by releasePending), if not held yet or if the
// hold was lost (its session ended: the next upload's lockCommit then sees
// any collection that ran meanwhile, and an upload missing a chunk fails).
func (s *Store) holdForPending(ctx context.Context) error {
	c := s.gc.cluster
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pendingRelease != nil {
		if c.pendingHeld(ctx) == nil {
			return nil
		}
		s.log.Warn("snapshot store: the pending uploads' collection lock was lost; taking it again")
		c.pendingRelease()
		c.pendingRelease, c.pendingHeld = nil, nil
	}
	release, held, err := sharedRetrying(ctx, c.lock)
	if err != nil {
		return fmt.Errorf("collection lock: %w: %w", snapshot.ErrLockUnavailable, err)
	}
	c.pendingRelease, c.pendingHeld = release, held
	return nil
}

// releasePending releases the pending uploads' hold once the outbox has no
// pending snapshot (ctx nil: at once, Close). The outbox is listed under
// c.mu: an asynchronous commit writes its outbox manifest before it takes
// the hold (holdForPending, under c.mu) and holds its own lock until then,
// so a snapshot listed too late for this check takes the hold again.
func (s *Store) releasePending(ctx context.Context) {
	c := s.gc.cluster
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pendingRelease == nil {
		return
	}
	if ctx != nil {
		if ids, err := s.Pending(ctx); err != nil || len(ids) > 0 {
			return
		}
	}
	{
		c.pendingRelease()
		c.pendingRelease, c.pendingHeld = nil, nil
	}
}

// unlockedCommit undoes a synchronous commit's manifest written after its
// lock was lost (step 6 above) and returns the commit's error.
func (s *Store) unlockedCommit(ctx context.Context, target Backend, id string, lost error) error {
	if derr := target.Delete(context.WithoutCancel(ctx), manifestKey(id)); derr != nil {
		s.log.Error("snapshot commit: collection lock lost and its manifest could not be removed", "snapshot", id, "err", derr)
	}
	s.docs.forget(id)
	return fmt.Errorf("snapshot %s: commit: collection lock lost before the manifest was known safe: %w", id, lost)
}

// refreshKnown re-lists the backend's pack indexes and loose chunks: it
// drops from idx.known the packs and loose chunks that are gone (another
// store's collection deleted them) and reads the indexes of the packs it
// lacks (other stores' commits). A listing and one read per new pack, not a
// read of every index. Packs this store added while it ran stay.
func (s *Store) refreshKnown(ctx context.Context) error {
	s.idx.loadMu.Lock()
	defer s.idx.loadMu.Unlock()
	s.idx.beginLoad()
	defer s.idx.endLoad()
	s.idx.mu.Lock()
	before := make(map[string]bool, len(s.idx.known.packs))
	for pid := range s.idx.known.packs {
		before[pid] = true
	}
	s.idx.mu.Unlock()
	loose, err := s.b.List(ctx, "chunks/")
	if err != nil {
		return fmt.Errorf("snapshot store: refresh the pack index: list chunks: %w", err)
	}
	objs, err := s.b.List(ctx, "index/")
	if err != nil {
		return fmt.Errorf("snapshot store: refresh the pack index: list pack indexes: %w", err)
	}
	listed := map[string]bool{}
	var missing []string
	for _, o := range objs {
		pid, ok := strings.CutSuffix(path.Base(o.Key), ".json")
		if !ok || !validPackID(pid) {
			continue
		}
		listed[pid] = true
		if !before[pid] {
			missing = append(missing, pid)
		}
	}
	read := make([][]indexEntry, len(missing))
	errs := make([]error, len(missing))
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(s.workers, len(missing)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < len(missing); i = int(next.Add(1)) - 1 {
				read[i], errs[i] = readIndex(ctx, s.b, missing[i])
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		switch {
		case err == nil, errors.Is(err, fs.ErrNotExist): // or deleted since the listing
		case errors.Is(err, errUnreachable):
			return fmt.Errorf("snapshot store: refresh the pack index: %w", err)
		default:
			s.log.Warn("snapshot store: unreadable pack index skipped; its pack is garbage", "pack", missing[i], "err", err)
		}
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	var dropped []string
	for pid := range before {
		if _, ok := s.idx.known.packs[pid]; ok && !listed[pid] {
			dropped = append(dropped, s.idx.known.dropPack(pid)...)
		}
	}
	for i, pid := range missing {
		if _, ok := s.idx.known.packs[pid]; !ok && errs[i] == nil && !s.idx.gone[pid] {
			s.idx.known.addPack(pid, read[i])
		}
	}
	// Loose chunks (stores written before packs): only collections remove them.
	still := make(map[string]int64, len(loose))
	for _, o := range loose {
		still[path.Base(o.Key)] = o.Size
	}
	for id, l := range s.idx.known.locs {
		if _, ok := still[id]; l.Pack == "" && !ok {
			delete(s.idx.known.locs, id)
			dropped = append(dropped, id)
		}
	}
	for id, n := range still {
		if _, ok := s.idx.known.locs[id]; !ok && !s.idx.gone[looseGone(id)] {
			s.idx.known.locs[id] = chunkLoc{Len: n}
		}
	}
	s.idx.loaded = true
	if s.cache != nil {
		for _, id := range dropped {
			if _, ok := s.idx.known.locs[id]; !ok {
				s.cache.Remove(id)
			}
		}
	}
	return nil
}

// clusterRoundBudget bounds how long a collection on a shared backend keeps
// deleting (commits on every node wait for it meanwhile); what is left is
// collected in the next round.
var clusterRoundBudget = 5 * time.Second

// errRoundOver: the collection round's budget is spent (Collect returns
// normally and the automatic collection runs another round).
var errRoundOver = errors.New("collect: round budget spent")

// exclusiveRound is a collection's hold of the lock on a shared backend.
type exclusiveRound struct {
	s       *Store
	held    func(context.Context) error
	until   time.Time
	written bool // the generation is written
}

// beginRound takes the collection lock exclusively for a Collect on a shared
// backend (steps 1 and 2 in collectlock.go) and refreshes the index of packs;
// nil round and a no-op release without Config.CollectLock. Errors:
// ErrCollectBusy, the lock or the backend cannot be reached.
func (s *Store) beginRound(ctx context.Context, live []string) (round *exclusiveRound, release func(), err error) {
	c := s.gc.cluster
	if c == nil {
		return nil, func() {}, nil
	}
	if live != nil {
		return nil, nil, errors.New("collect: on a shared backend every snapshot is live: pass nil")
	}
	release, held, ok, err := c.lock.TryExclusive(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("collect: collection lock: %w", err)
	}
	if !ok {
		return nil, nil, ErrCollectBusy
	}
	gen, err := readGCGen(ctx, s.b)
	if err == nil {
		err = s.refreshKnown(ctx)
	}
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("collect: %w", err)
	}
	c.mu.Lock()
	c.gen = gen
	c.mu.Unlock()
	return &exclusiveRound{s: s, held: held, until: time.Now().Add(clusterRoundBudget)}, release, nil
}

// beforeDelete is called before each deletion of a collection: it checks
// the lock is still held and the round's budget not spent and, the first
// time, writes a new generation (step 3 above). Nil r (a store without a
// CollectLock) allows everything.
func (r *exclusiveRound) beforeDelete(ctx context.Context) error {
	return r.check(ctx, true, true)
}

// inBudget checks, before a pack is rewritten (repack), that the lock is still
// held and the round's budget not spent; it writes nothing.
func (r *exclusiveRound) inBudget(ctx context.Context) error {
	return r.check(ctx, true, false)
}

// beforeFinish is beforeDelete without the budget, for the deletion of a pack
// whose rewrite (repack) is written and durable: stopping there would leave
// both packs, and the next round would rewrite the old one again. The lock
// must still be held, and the generation is written as before any deletion.
func (r *exclusiveRound) beforeFinish(ctx context.Context) error {
	return r.check(ctx, false, true)
}

func (r *exclusiveRound) check(ctx context.Context, budget, deleting bool) error {
	if r == nil {
		return nil
	}
	if err := r.held(ctx); err != nil {
		return fmt.Errorf("collection lock lost: %w", err)
	}
	if budget && time.Now().After(r.until) {
		return errRoundOver
	}
	if !deleting || r.written {
		return nil
	}
	gen := fmt.Sprintf("%s-%d", rnd(), time.Now().UnixNano())
	if err := r.s.b.Put(ctx, gcGenKey, bytes.NewReader([]byte(gen)), int64(len(gen))); err != nil {
		return fmt.Errorf("collection generation: %w", err)
	}
	if err := syncTier(ctx, r.s.b); err != nil {
		return fmt.Errorf("collection generation: %w", err)
	}
	r.written = true
	c := r.s.gc.cluster
	c.mu.Lock()
	c.gen = gen // this store's index follows its own deletions
	c.mu.Unlock()
	return nil
}

// afterManifest is step 6 above for a commit whose manifest is written: a
// synchronous commit whose lock was lost meanwhile is undone (an error); an
// asynchronous one takes the pending uploads' hold before its own is
// released (its manifest is in the outbox, invisible to other stores).
func (s *Store) afterManifest(ctx context.Context, target Backend, id string, async bool, held func(context.Context) error) error {
	if s.gc.cluster == nil {
		return nil
	}
	if async {
		err := held(ctx)
		if err == nil {
			err = s.holdForPending(ctx)
		}
		if err != nil {
			_ = target.Delete(context.WithoutCancel(ctx), manifestKey(id))
			return fmt.Errorf("snapshot %s: commit: %w", id, err)
		}
		return nil
	}
	if err := held(ctx); err != nil {
		return s.unlockedCommit(ctx, target, id, err)
	}
	return nil
}
