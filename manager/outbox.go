package manager

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Snapshots on their way to the durable tier. A snapshot committed to this
// node's upload outbox (snapshot.AsyncStore.CommitAsync: an asynchronous
// hibernate, or a synchronous one whose commit fell back to it) is recorded
// with this node as its OutboxNode, and the record is cleared
// (metadata.Snapshots.SetSnapshotUploaded) only once the store reports that
// the snapshot's manifest, the last object of its upload, is in the bucket.
// Other nodes read durability from the record — their own stores know nothing
// of this node's outbox — and a resume there of a snapshot still in this
// node's outbox is a retryable 503 (UploadPendingError), not a corrupt
// snapshot.

// uploadRecordRetry bounds how long a failed write of "uploaded" to the
// database is retried (the database may be down for a while); a record that
// is not found is retried for uploadRecordAbsent only (it may be written a
// moment after a fast upload ended; else the snapshot was deleted).
const (
	uploadRecordRetry  = 10 * time.Minute
	uploadRecordAbsent = time.Minute
)

// UploadPendingRetry is the Retry-After of an UploadPendingError.
const UploadPendingRetry = 5 * time.Second

// UploadPendingError is a resume (or fork, or start) on this node of snapshot
// Snapshot, which node Node committed to its upload outbox and has not
// uploaded yet: its manifest is not in the bucket, so this node cannot read
// it. It is wrapped in a *sandbox.Error of kind Unavailable (503 with
// Retry-After): the call succeeds once the upload ends, or on Node.
type UploadPendingError struct {
	Snapshot, Node string
	Retry          time.Duration
}

func (e *UploadPendingError) Error() string {
	return fmt.Sprintf("snapshot %s is committed on node %s and waits in its upload outbox: it is not in the bucket yet, so no other node can read it; try again once node %s has uploaded it (or resume it there)",
		e.Snapshot, e.Node, e.Node)
}

// RetryAfter is how long the caller should wait before retrying.
func (e *UploadPendingError) RetryAfter() time.Duration { return e.Retry }

// outboxNodeOf is the OutboxNode to record for snapshot id, just committed by
// this node: this node while its store still holds it in the outbox, else "".
func (m *Manager) outboxNodeOf(ctx context.Context, id string) string {
	as, ok := m.cfg.Store.(snapshot.AsyncStore)
	if !ok {
		return ""
	}
	if d, err := as.Durable(ctx, id); err == nil && d {
		return ""
	}
	return m.cfg.Node
}

// watchUploads has the store tell the manager of every finished upload, and
// of every deferred commit's final sizes (snapshot.DeferredCommitter: a
// first commit acknowledged before its chunks were stored recorded its
// provisional ones).
func (m *Manager) watchUploads() {
	if dc, ok := m.cfg.Store.(snapshot.DeferredCommitter); ok {
		dc.OnCommitted(func(man snapshot.Manifest) {
			go m.recordRetrying(man.ID, func(ctx context.Context) error {
				return m.cfg.DB.SetSnapshotSizes(ctx, man.ID, man.LogicalBytes, man.StoredBytes, man.NewBytes)
			})
		})
	}
	if as, ok := m.cfg.Store.(snapshot.AsyncStore); ok {
		as.OnUploaded(func(id string) {
			go m.recordUploaded(id)
		})
	}
}

// recordUploaded writes that snapshot id, whose manifest the store has just
// put in the durable tier, is uploaded (recordRetrying).
func (m *Manager) recordUploaded(id string) {
	if m.recordRetrying(id, func(ctx context.Context) error { return m.cfg.DB.SetSnapshotUploaded(ctx, id) }) {
		m.log.Debug("snapshot uploaded: recorded durable", "snapshot", id)
	} else {
		m.log.Warn("snapshot uploaded but not recorded durable; the next start records it", "snapshot", id)
	}
}

// recordRetrying runs write, a change to snapshot id's record, retrying with
// backoff (500 ms doubling to 15 s) while the database does not answer
// (uploadRecordRetry) or has no record of it yet (uploadRecordAbsent: the
// manager writes it a moment after the store's commit returned). It reports
// whether write succeeded; the last error is logged.
func (m *Manager) recordRetrying(id string, write func(ctx context.Context) error) bool {
	start := time.Now()
	wait := 500 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := write(ctx)
		cancel()
		if err == nil {
			return true
		}
		limit := uploadRecordRetry
		if errors.Is(err, metadata.ErrNotFound) {
			limit = uploadRecordAbsent
		}
		if time.Since(start) > limit {
			m.log.Warn("snapshot record not updated", "snapshot", id, "err", err)
			return false
		}
		time.Sleep(wait)
		wait = min(2*wait, 15*time.Second)
	}
}

// recordUploads records durable every snapshot whose record names this
// node's outbox and that the store has uploaded since (an upload whose record
// a restart or a long database outage cut short). Reconcile runs it.
func (m *Manager) recordUploads(ctx context.Context, recs []*metadata.Snapshot) {
	as, ok := m.cfg.Store.(snapshot.AsyncStore)
	if !ok {
		return
	}
	for _, r := range recs {
		if r.OutboxNode != m.cfg.Node {
			continue
		}
		if d, err := as.Durable(ctx, r.ID); err == nil && d {
			if err := m.cfg.DB.SetSnapshotUploaded(ctx, r.ID); err != nil {
				m.log.Warn("reconcile: recording an uploaded snapshot durable", "snapshot", r.ID, "err", err)
			}
		}
	}
}

// uploadPending says why snapshot id, which the store does not have, cannot
// be opened here: an UploadPendingError (Unavailable) when its record names
// another node's outbox, else nil (it is gone).
func (m *Manager) uploadPending(ctx context.Context, id, op, sandboxID string) error {
	rec, err := m.cfg.DB.GetSnapshot(ctx, id)
	if err != nil || rec.OutboxNode == "" || rec.OutboxNode == m.cfg.Node {
		return nil
	}
	return &sandbox.Error{Kind: sandbox.Unavailable, Op: op, SandboxID: sandboxID,
		Err: &UploadPendingError{Snapshot: id, Node: rec.OutboxNode, Retry: UploadPendingRetry}}
}
