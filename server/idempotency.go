package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/node"
	"github.com/torpor/torpor/sandbox"
)

// Idempotent creates and forks (header Idempotency-Key, docs/api.md). A call
// with a key
//
//  1. chooses its sandboxes' ids and records them under the key (the
//     metadata store's IdempotencyKeys) before it makes anything;
//  2. makes the sandboxes with those ids;
//  3. records the status it answers, then answers.
//
// A retry with the key gets the sandboxes of the record, as they are now,
// with the recorded status: it waits for a call with the key still running
// in this server; after a crash that cut the call (no status recorded) it
// answers the sandboxes that exist, once usable (salvage: a clone the crash
// left in state error is resumed from the fork's snapshot, a create's
// sandbox left so is removed), or, when none is left, runs the call with the
// recorded ids. A call that failed without making any sandbox
// removes its record, so a retry runs again (a refusal of admission control
// is retried this way). The same key with another call (method, path or
// body) is 422 idempotency_key_reused.

// IdempotencyKeyTTL is how long a key's record is kept: a retry later than
// that makes new sandboxes.
const IdempotencyKeyTTL = 24 * time.Hour

// idempotency is the server's state for idempotent calls.
type idempotency struct {
	db metadata.IdempotencyKeys
	mu sync.Mutex
	// running holds, per key, a channel closed when the call holding the key
	// in this process ends.
	running map[string]chan struct{}
	// expiredAt is when records older than IdempotencyKeyTTL were last
	// removed (at most once a minute, before a claim).
	expiredAt time.Time
}

// idempotentCall is one create or fork: n sandboxes; run makes them with
// ids (nil: ids of its own choice) and returns the answer's status and body;
// view answers with the sandboxes ids that exist now (a replay).
type idempotentCall struct {
	n    int
	run  func(ctx context.Context, ids []string) (status int, body any, err error)
	view func(ctx context.Context, ids []string) any
}

// idempotencyKeyProblem says what is wrong with key k ("" when nothing): its
// length (1 to 255 bytes) or its first byte that is not printable ASCII.
func idempotencyKeyProblem(k string) string {
	if len(k) == 0 || len(k) > 255 {
		return fmt.Sprintf("want 1 to 255 printable ASCII characters, got %d bytes", len(k))
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x20 || k[i] > 0x7e {
			return fmt.Sprintf("want printable ASCII characters only (a UUID or hex digits), byte %d is 0x%02x", i, k[i])
		}
	}
	return ""
}

// serveIdempotent answers call c of request r, whose body is body, as the
// header Idempotency-Key asks (without one: c.run as it is).
func (s *Server) serveIdempotent(w http.ResponseWriter, r *http.Request, body []byte, c idempotentCall) {
	key := r.Header.Get(apiv1.IdempotencyKeyHeader)
	if key == "" {
		status, v, err := c.run(r.Context(), nil)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		writeJSON(w, status, v)
		return
	}
	if p := idempotencyKeyProblem(key); p != "" {
		s.fail(w, r, invalidArgument("%s: %s", apiv1.IdempotencyKeyHeader, p))
		return
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s %s\n", r.Method, r.URL.Path)
	h.Write(body)
	hash := h.Sum(nil)
	ctx := r.Context()
	done, err := s.idem.hold(ctx, key)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	defer done()
	s.idem.expire(ctx, s)
	ids := make([]string, c.n)
	for i := range ids {
		ids[i] = manager.NewSandboxID()
	}
	holder := s.idemHolder()
	rec, created, forward, err := s.claimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: key, RequestHash: hash, SandboxIDs: ids, CreatedAt: time.Now().UTC(), Holder: holder})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if forward != nil && s.cluster != nil {
		// The holder's node runs again and owns what the cut call made.
		s.log.Info("idempotent retry: the call's node runs a new server; forwarding the retry there", "key", key, "node", forward.Host)
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		s.cluster.forward(w, r, forward)
		return
	}
	if !created {
		if !bytes.Equal(rec.RequestHash, hash) {
			writeError(w, http.StatusUnprocessableEntity, apiv1.CodeIdempotencyReuse,
				fmt.Sprintf("%s %q was sent before with another call (method, path or body); send a new key for a new call", apiv1.IdempotencyKeyHeader, key))
			return
		}
		if rec.Status != 0 {
			s.replay(w, r, c, rec)
			return
		}
		// Recorded without a status and held by no call here: a crash cut
		// the call before it answered. What it made is the answer, once
		// usable (salvage); if it made nothing, or nothing usable, it runs
		// now with the recorded ids.
		made, err := s.salvage(ctx, rec.SandboxIDs)
		if err != nil {
			if holder != "" {
				// Nobody runs the call now: a retry elsewhere takes it over
				// instead of waiting for this server.
				if _, terr := s.idem.db.TakeIdempotencyKey(context.WithoutCancel(ctx), key, holder, ""); terr != nil {
					s.log.Warn("idempotency key: give up the call after a failed salvage", "key", key, "err", terr)
				}
			}
			s.fail(w, r, err)
			return
		}
		if len(made) > 0 {
			rec.Status = http.StatusCreated
			if err := s.idem.db.FinishIdempotencyKey(context.WithoutCancel(ctx), key, holder, rec.Status); err != nil {
				s.fail(w, r, err)
				return
			}
			s.replay(w, r, c, rec)
			return
		}
		ids = rec.SandboxIDs
	}
	manager.FaultPoint("idempotency-claimed")
	status, v, err := c.run(ctx, ids)
	wctx := context.WithoutCancel(ctx)
	if err != nil {
		status, _ = classify(err)
		if len(s.existing(wctx, ids)) == 0 {
			// Nothing made: a retry may run the call again.
			if derr := s.idem.db.DeleteIdempotencyKey(wctx, key, holder); derr != nil {
				s.log.Error("idempotency key: remove the record of a call that made nothing", "key", key, "err", derr)
			}
		} else if ferr := s.idem.db.FinishIdempotencyKey(wctx, key, holder, status); ferr != nil {
			s.log.Error("idempotency key: record a failed call's status", "key", key, "err", ferr)
		}
		s.fail(w, r, err)
		return
	}
	if err := s.idem.db.FinishIdempotencyKey(wctx, key, holder, status); err != nil {
		// The sandboxes exist and the record names them: a retry answers
		// them (as after a crash).
		s.log.Error("idempotency key: record the answer's status", "key", key, "err", err)
	}
	manager.FaultPoint("idempotency-recorded")
	writeJSON(w, status, v)
}

// idemHolderPoll is how often a retry checks the record of a call that
// another node's server still runs.
const idemHolderPoll = 100 * time.Millisecond

// idemHolder is this server process as idempotency records name it
// (metadata.IdempotencyKey.Holder): "" without nodes, else
// "<node>@<registration time, Unix ms>".
func (s *Server) idemHolder() string {
	if s.heartbeat == nil {
		return ""
	}
	return fmt.Sprintf("%s@%d", s.node, s.heartbeat.StartedAt().UnixMilli())
}

// idemWaitMax bounds how long a retry waits for the call another node's
// server runs with its key: then it is 503 with Retry-After (a create or a
// fork takes seconds; a call that runs longer is not waited on forever).
const idemWaitMax = time.Minute

// claimIdempotencyKey claims want's key for this server (the metadata
// store's ClaimIdempotencyKey) and returns the record: want (created), one
// with another request hash or a status (answered), or one without a
// status that this server may now salvage and run — its holder is this
// process's node's earlier server, or a server whose node is gone (lost,
// and its sandboxes fenced, or removed), taken over (TakeIdempotencyKey).
// While another node's live server holds the record (its call still runs
// there), it waits and reads it again every idemHolderPoll, up to
// idemWaitMax. When the holder is an earlier server of a node that runs
// again, the call is that node's to salvage (it owns what the cut call
// made): forward is its URL, and the caller forwards the call there.
// Errors: the database's; Unavailable (Retry-After) after idemWaitMax;
// ctx's when it ends first.
func (s *Server) claimIdempotencyKey(ctx context.Context, want metadata.IdempotencyKey) (rec metadata.IdempotencyKey, created bool, forward *url.URL, err error) {
	waited := time.Now()
	for {
		rec, created, err := s.idem.db.ClaimIdempotencyKey(ctx, want)
		if err != nil || created || rec.Status != 0 || !bytes.Equal(rec.RequestHash, want.RequestHash) || rec.Holder == want.Holder {
			return rec, created, nil, err
		}
		switch verdict, to := s.idemHolderState(ctx, rec); verdict {
		case holderGone:
			ok, err := s.idem.db.TakeIdempotencyKey(ctx, rec.Key, rec.Holder, want.Holder)
			if errors.Is(err, metadata.ErrNotFound) {
				continue // its call made nothing and freed the key: claim it
			}
			if ok {
				s.log.Info("idempotent retry: the server that ran the call is gone; taking the call over", "key", rec.Key, "was_held_by", rec.Holder)
			}
			if err != nil || ok {
				rec.Holder = want.Holder
				return rec, false, nil, err
			}
			continue // another retry took it first, or it was answered
		case holderRestarted:
			return rec, false, to, nil
		}
		if time.Since(waited) > idemWaitMax {
			name, _, _ := strings.Cut(rec.Holder, "@")
			return rec, false, nil, &sandbox.Error{Kind: sandbox.Unavailable, Op: "idempotent retry",
				Err: &idemRunningError{key: rec.Key, node: name, waited: time.Since(waited)}}
		}
		select {
		case <-ctx.Done():
			return metadata.IdempotencyKey{}, false, nil, ctx.Err()
		case <-time.After(idemHolderPoll):
		}
	}
}

// idemRunningError: a retry waited idemWaitMax for the call another node
// runs with its key.
type idemRunningError struct {
	key, node string
	waited    time.Duration
}

func (e *idemRunningError) Error() string {
	return fmt.Sprintf("the first call with %s %q still runs on node %s (waited %s): retry", apiv1.IdempotencyKeyHeader, e.key, e.node, e.waited.Round(time.Second))
}

// RetryAfter implements the retryable refusal (manager.RetryAfterSeconds).
func (e *idemRunningError) RetryAfter() time.Duration { return 5 * time.Second }

// holderVerdict is what a retry makes of an unanswered record's holder.
type holderVerdict int

const (
	// holderRunning: another node's server that still runs holds it, or
	// the holder's node is lost but still owns some of the call's
	// sandboxes (not fenced yet): wait.
	holderRunning holderVerdict = iota
	// holderGone: no server runs the call any more and none will salvage
	// it but a retry: take it over.
	holderGone
	// holderRestarted: the holder's node runs a later server, which owns
	// what the cut call made: forward the retry there.
	holderRestarted
)

// idemHolderState judges rec's holder (another server than this one): by
// its node's record (same start time and not lost: running; lost with the
// call's sandboxes still its own: running, until the others fence them;
// started again: restarted, with its URL) — a holder of this node's name,
// one that names no node (a record of one server, ""), or a node without a
// record is gone. A database error counts as running (not taken over on
// it).
func (s *Server) idemHolderState(ctx context.Context, rec metadata.IdempotencyKey) (holderVerdict, *url.URL) {
	name, ms, ok := strings.Cut(rec.Holder, "@")
	if !ok || name == s.node {
		return holderGone, nil
	}
	n, err := s.db.GetNode(ctx, name)
	if errors.Is(err, metadata.ErrNotFound) {
		return holderGone, nil
	}
	if err != nil {
		return holderRunning, nil
	}
	lost := node.StateOf(n, time.Now()) == node.StateLost
	if !lost && strconv.FormatInt(n.StartedAt.UnixMilli(), 10) != ms {
		if u, err := url.Parse(n.Advertise); err == nil {
			return holderRestarted, u
		}
		return holderGone, nil
	}
	if !lost {
		return holderRunning, nil
	}
	for _, id := range rec.SandboxIDs {
		if sb, err := s.db.GetSandbox(ctx, id); err == nil && sb.Owner == name {
			return holderRunning, nil
		}
	}
	return holderGone, nil
}

// replay answers a retry of the call recorded in rec: the recorded status
// with the sandboxes as they are now (2xx), or an error naming the
// sandboxes the failed first call left.
func (s *Server) replay(w http.ResponseWriter, r *http.Request, c idempotentCall, rec metadata.IdempotencyKey) {
	ctx := r.Context()
	made := s.existing(ctx, rec.SandboxIDs)
	if rec.Status < 200 || rec.Status > 299 {
		code := apiv1.CodeInternal
		if rec.Status < 500 {
			code = apiv1.CodeConflict
		}
		writeError(w, rec.Status, code, fmt.Sprintf("the first call with %s %q failed (status %d); the sandboxes it left: %s (see their state and error)",
			apiv1.IdempotencyKeyHeader, rec.Key, rec.Status, strings.Join(made, ", ")))
		return
	}
	if len(made) == 0 {
		s.fail(w, r, sandbox.Errorf(sandbox.Conflict, "the sandboxes made by the first call with %s %q (%s) were deleted since",
			apiv1.IdempotencyKeyHeader, rec.Key, strings.Join(rec.SandboxIDs, ", ")))
		return
	}
	writeJSON(w, rec.Status, c.view(ctx, made))
}

// salvage makes usable what a call cut by a crash before its answer left
// of sandboxes ids, and returns the ids that exist afterwards. A sandbox the
// restart's reconcile put in state error ("create interrupted by server
// restart", "lost on server restart") was never handed to anyone: one with a
// snapshot to resume from (a fork's clone: the fork's snapshot) is resumed
// from it, as the first call would have restored it; one without (a create's
// sandbox, whose instance never ran to the end) is deleted, so that the call
// makes it again under its recorded id. Errors: the resume's or the delete's
// (the record keeps no status then, and the next retry tries again).
func (s *Server) salvage(ctx context.Context, ids []string) ([]string, error) {
	var out []string
	for _, id := range ids {
		sb, err := s.Manager.Get(ctx, id)
		if err != nil {
			continue // not made, or deleted
		}
		if sb.State != sandbox.StateError {
			out = append(out, id)
			continue
		}
		if sb.Snapshot == nil {
			s.log.Info("idempotent retry: removing a sandbox its cut first call left unusable; the call makes it again",
				"sandbox", id, "error_was", sb.Error)
			if err := s.Manager.Delete(ctx, id); err != nil {
				return nil, fmt.Errorf("idempotent retry: remove %s, which the first call left in state error (%s): %w", id, sb.Error, err)
			}
			continue
		}
		s.log.Info("idempotent retry: resuming a sandbox its cut first call left in state error", "sandbox", id,
			"snapshot", sb.Snapshot.ID, "error_was", sb.Error)
		if _, err := s.Manager.Resume(ctx, id); err != nil {
			return nil, fmt.Errorf("idempotent retry: resume %s, which the first call left in state error (%s): %w", id, sb.Error, err)
		}
		out = append(out, id)
	}
	return out, nil
}

// existing returns those of ids that name sandboxes (not deleted).
func (s *Server) existing(ctx context.Context, ids []string) []string {
	var out []string
	for _, id := range ids {
		if _, err := s.Manager.Get(ctx, id); err == nil {
			out = append(out, id)
		}
	}
	return out
}

// hold makes the caller the one call of key in this process, waiting while
// another holds it; done releases it. Errors: ctx ended first.
func (i *idempotency) hold(ctx context.Context, key string) (done func(), err error) {
	for {
		i.mu.Lock()
		ch := i.running[key]
		if ch == nil {
			ch = make(chan struct{})
			if i.running == nil {
				i.running = map[string]chan struct{}{}
			}
			i.running[key] = ch
			i.mu.Unlock()
			return func() {
				i.mu.Lock()
				delete(i.running, key)
				i.mu.Unlock()
				close(ch)
			}, nil
		}
		i.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// expire removes the records older than IdempotencyKeyTTL, at most once a
// minute.
func (i *idempotency) expire(ctx context.Context, s *Server) {
	i.mu.Lock()
	due := time.Since(i.expiredAt) >= time.Minute
	if due {
		i.expiredAt = time.Now()
	}
	i.mu.Unlock()
	if !due {
		return
	}
	if n, err := i.db.DeleteIdempotencyKeysBefore(ctx, time.Now().Add(-IdempotencyKeyTTL)); err != nil {
		s.log.Warn("idempotency keys: expiry failed", "err", err)
	} else if n > 0 {
		s.log.Debug("idempotency keys expired", "count", n)
	}
}
