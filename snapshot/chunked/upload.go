package chunked

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// Asynchronous upload: CommitAsync leaves a snapshot in the outbox (a local
// filesystem backend under Dir/outbox); uploadLoop moves it to the durable
// backend. See the package comment for the contract.

// maxUploadRetry caps the backoff between failed upload attempts.
const maxUploadRetry = 60 * time.Second

var _ snapshot.AsyncStore = (*Store)(nil)

// Durable implements snapshot.AsyncStore: false while id waits in the outbox.
func (s *Store) Durable(ctx context.Context, id string) (bool, error) {
	if err := checkID(id); err != nil {
		return false, err
	}
	pending, err := s.outbox.Exists(ctx, manifestKey(id))
	return !pending && err == nil, err
}

// Pending returns the ids of snapshots committed asynchronously and not yet
// uploaded, sorted.
func (s *Store) Pending(ctx context.Context) ([]string, error) {
	objs, err := s.outbox.List(ctx, "manifests/")
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, o := range objs {
		if id, ok := strings.CutSuffix(path.Base(o.Key), ".json"); ok && checkID(id) == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids, nil
}

// UploadNow asks the background upload to try again at once (tests and
// operators use it after fixing the backend, instead of waiting out the backoff).
func (s *Store) UploadNow() { s.kickUpload() }

func (s *Store) kickUpload() {
	select {
	case s.upKick <- struct{}{}:
	default:
	}
}

// uploadLoop uploads pending snapshots whenever kicked, at start-up, and after a
// failure with exponential backoff from upRetry to maxUploadRetry.
func (s *Store) uploadLoop() {
	defer close(s.upDone)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-s.closed
		cancel()
	}()
	wait := s.upRetry
	for {
		n, err := s.uploadPending(ctx)
		var retry <-chan time.Time
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			s.log.Warn("snapshot upload failed; retrying from the local copy", "err", err, "retry_in", wait.String())
			retry = time.After(wait)
			wait = min(2*wait, maxUploadRetry)
		default:
			if n > 0 {
				s.log.Info("snapshots uploaded", "count", n)
			}
			wait = s.upRetry
		}
		select {
		case <-s.closed:
			return
		case <-s.upKick:
		case <-retry:
		}
	}
}

// uploadPending uploads every pending snapshot, oldest first; it stops at the
// first failure. It returns how many it uploaded.
func (s *Store) uploadPending(ctx context.Context) (int, error) {
	ids, err := s.Pending(ctx)
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	if err := s.ensureKnown(ctx); err != nil {
		return 0, err
	}
	type item struct {
		id string
		d  doc
	}
	var items []item
	for _, id := range ids {
		d, err := s.readOutboxDoc(ctx, id)
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return 0, err
		}
		items = append(items, item{id, d})
	}
	sort.SliceStable(items, func(i, j int) bool {
		return items[i].d.Manifest.CreatedAt.Before(items[j].d.Manifest.CreatedAt)
	})
	for i, it := range items {
		if err := s.upload(ctx, it.id, it.d); err != nil {
			return i, fmt.Errorf("snapshot %s: upload: %w", it.id, err)
		}
	}
	return len(items), nil
}

// upload copies the chunks of pending snapshot id that the backend lacks from
// the outbox, makes them durable, writes the manifest, and only then removes the
// snapshot from the outbox.
func (s *Store) upload(ctx context.Context, id string, d doc) error {
	var need []string
	seen := map[string]bool{}
	s.mu.Lock()
	for _, fc := range d.Files {
		for _, r := range fc.Chunks {
			if r.ID == "" || seen[r.ID] {
				continue
			}
			seen[r.ID] = true
			if _, ok := s.known[r.ID]; !ok {
				need = append(need, r.ID)
			}
		}
	}
	s.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ids := make(chan string)
	var wg sync.WaitGroup
	var once sync.Once
	var firstErr error
	for w := 0; w < s.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for cid := range ids {
				if ctx.Err() != nil {
					continue
				}
				if err := s.uploadChunk(ctx, cid); err != nil {
					once.Do(func() { firstErr = err; cancel() })
				}
			}
		}()
	}
	for _, cid := range need {
		if ctx.Err() != nil {
			break
		}
		ids <- cid
	}
	close(ids)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if sy, ok := s.b.(Syncer); ok {
		if err := sy.Sync(ctx); err != nil {
			return err
		}
	}
	b, err := json.Marshal(d)
	if err != nil {
		return err
	}
	s.uploadMu.Lock()
	pending, err := s.outbox.Exists(ctx, manifestKey(id))
	if err == nil && pending { // not deleted meanwhile
		if err = s.b.Put(ctx, manifestKey(id), bytes.NewReader(b), int64(len(b))); err == nil {
			err = s.outbox.Delete(ctx, manifestKey(id))
		}
	}
	s.uploadMu.Unlock()
	if err != nil {
		return err
	}
	s.dropOutboxChunks(ctx, d)
	return nil
}

// uploadChunk copies one chunk from the outbox to the backend, checking its
// content on the way (a damaged local copy is not uploaded).
func (s *Store) uploadChunk(ctx context.Context, cid string) error {
	comp, ok := s.outboxChunk(ctx, cid)
	if !ok {
		return fmt.Errorf("chunk %s: not in the outbox", cid)
	}
	data, err := s.dec.DecodeAll(comp, nil)
	if err != nil || sha256Hex(data) != cid {
		return fmt.Errorf("chunk %s: the outbox copy is damaged", cid)
	}
	if err := s.b.Put(ctx, chunkKey(cid), bytes.NewReader(comp), int64(len(comp))); err != nil {
		return fmt.Errorf("chunk %s: %w", cid, err)
	}
	s.mu.Lock()
	s.known[cid] = int64(len(comp))
	s.mu.Unlock()
	return nil
}

// outboxChunk returns a chunk's stored bytes from the outbox, if it is there.
func (s *Store) outboxChunk(ctx context.Context, cid string) ([]byte, bool) {
	s.mu.Lock()
	_, ok := s.outKnown[cid]
	s.mu.Unlock()
	if !ok {
		return nil, false
	}
	r, err := s.outbox.Get(ctx, chunkKey(cid))
	if err != nil {
		return nil, false
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	return b, err == nil
}

func (s *Store) readOutboxDoc(ctx context.Context, id string) (doc, error) {
	var d doc
	r, err := s.outbox.Get(ctx, manifestKey(id))
	if err != nil {
		return d, err
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		return d, err
	}
	if err := json.Unmarshal(b, &d); err != nil {
		return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "outbox copy: " + err.Error()}
	}
	return d, nil
}

// dropOutboxChunks removes d's chunks from the outbox unless another pending
// snapshot references them or a commit in progress has pinned them.
func (s *Store) dropOutboxChunks(ctx context.Context, d doc) {
	still := s.outboxRefs(ctx)
	if still == nil {
		return // unsure: keep everything
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, fc := range d.Files {
		for _, r := range fc.Chunks {
			s.dropOutboxChunkLocked(ctx, r.ID, still)
		}
	}
}

// dropOutboxChunkLocked removes one outbox chunk if nothing needs it. The caller
// holds mu, so no commit can pick the chunk up between the check and the removal.
func (s *Store) dropOutboxChunkLocked(ctx context.Context, cid string, still map[string]bool) {
	if cid == "" || still[cid] || s.pins[cid] > 0 {
		return
	}
	if _, ok := s.outKnown[cid]; !ok {
		return
	}
	if err := s.outbox.Delete(ctx, chunkKey(cid)); err == nil {
		delete(s.outKnown, cid)
	}
}

// outboxRefs is the set of chunks the pending manifests reference; nil when
// one cannot be read.
func (s *Store) outboxRefs(ctx context.Context) map[string]bool {
	ids, err := s.Pending(ctx)
	if err != nil {
		return nil
	}
	refs := map[string]bool{}
	for _, id := range ids {
		d, err := s.readOutboxDoc(ctx, id)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil
		}
		for _, fc := range d.Files {
			for _, r := range fc.Chunks {
				if r.ID != "" {
					refs[r.ID] = true
				}
			}
		}
	}
	return refs
}

// cleanOutbox removes outbox chunks no pending manifest references (left by a
// crash mid-commit or mid-cleanup). Only at start-up: no commit is in progress.
func (s *Store) cleanOutbox(ctx context.Context) error {
	still := s.outboxRefs(ctx)
	if still == nil {
		return fmt.Errorf("snapshot store: outbox: a pending manifest is unreadable")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for cid := range s.outKnown {
		s.dropOutboxChunkLocked(ctx, cid, still)
	}
	return nil
}
