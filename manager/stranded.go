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

// Stranded hibernates. A hibernate whose checkpoint is complete (the engine
// has stopped the instance: its memory is in the staged files only) but
// whose commit failed — the database that holds the collection lock did not
// answer, or the store failed otherwise — keeps the staged checkpoint
// instead of throwing it away, and this node commits it in the background
// (to its local packs and the upload outbox when the durable tier is down)
// and records the sandbox hibernated on it once the database answers again.
// If meanwhile the sandbox was fenced (this node fenced itself, or another
// node declared it lost: state error, no owner, a new lease token), the
// snapshot is still recorded as the sandbox's, under a new lease of its own,
// provided nobody resumed the sandbox since: its generation and its last
// snapshot are those of the hibernate. Otherwise (resumed, deleted) the
// checkpoint is deleted.

// strandedRetry is how often a stranded hibernate's commit and record are
// tried again.
const strandedRetry = 2 * time.Second

// stranded is one hibernate whose staged checkpoint waits for its commit or
// its record.
type stranded struct {
	sandboxID, snapID string
	man               snapshot.Manifest
	async             bool
	// generation and parent are the sandbox's generation and last snapshot
	// at the hibernate: a record that still has both was not resumed since.
	generation int64
	parent     string
	start, at  time.Time
	committed  bool
}

// StrandedError is a hibernate whose checkpoint is complete and kept on this
// node's disk but whose commit failed (Cause); this node commits and records
// it in the background (see above). Wrapped in a *sandbox.Error of kind
// Unavailable.
type StrandedError struct {
	Snapshot string
	Cause    error
}

func (e *StrandedError) Error() string {
	return fmt.Sprintf("the checkpoint is complete and kept on this node's disk as snapshot %s, but its commit failed (%v): "+
		"this node commits it in the background and records the sandbox hibernated on it once the database answers again; nothing is lost",
		e.Snapshot, e.Cause)
}

// RetryAfter is how long the caller should wait before looking again.
func (e *StrandedError) RetryAfter() time.Duration { return 5 * time.Second }

// Unwrap is the commit's error.
func (e *StrandedError) Unwrap() error { return e.Cause }

// strand keeps the complete staged checkpoint snapID of sandbox s (state
// hibernating, its instance gone) whose commit failed with cause, and starts
// the background work that commits and records it. It returns the error the
// hibernate answers.
func (m *Manager) strand(s *metadata.Sandbox, snapID string, man snapshot.Manifest, async bool, start, at time.Time, cause error) error {
	st := &stranded{sandboxID: s.ID, snapID: snapID, man: man, async: async,
		generation: s.Generation, parent: man.Parent, start: start, at: at}
	m.mu.Lock()
	if m.strandedHib == nil {
		m.strandedHib = map[string]*stranded{}
	}
	m.strandedHib[snapID] = st
	first := !m.strandedLoop
	m.strandedLoop = true
	m.mu.Unlock()
	m.log.Warn("hibernate: commit failed; keeping the complete checkpoint on local disk and committing it in the background",
		"sandbox", s.ID, "snapshot", snapID, "err", cause)
	if first {
		go m.finishStrandedLoop()
	}
	return &sandbox.Error{Kind: sandbox.Unavailable, Op: "hibernate", SandboxID: s.ID,
		Err: &StrandedError{Snapshot: snapID, Cause: cause}}
}

// markStrandedCommitted notes that stranded hibernate snapID committed (only
// its record failed).
func (m *Manager) markStrandedCommitted(snapID string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if st := m.strandedHib[snapID]; st != nil {
		st.committed = true
	}
}

// finishStrandedLoop tries the stranded hibernates every strandedRetry until
// none is left.
func (m *Manager) finishStrandedLoop() {
	for {
		time.Sleep(strandedRetry)
		if m.FinishStranded(context.Background()) == 0 {
			m.mu.Lock()
			if len(m.strandedHib) == 0 {
				m.strandedLoop = false
				m.mu.Unlock()
				return
			}
			m.mu.Unlock()
		}
	}
}

// FinishStranded tries once to commit and record every stranded hibernate
// and returns how many are left. ReleaseOwned runs it before it gives up
// this node's sandboxes, so that a hibernate the outage interrupted ends
// hibernated rather than in error.
func (m *Manager) FinishStranded(ctx context.Context) int {
	m.strandedMu.Lock() // one pass at a time: a pass acts on what the last one left
	defer m.strandedMu.Unlock()
	m.mu.Lock()
	var list []*stranded
	for _, st := range m.strandedHib {
		list = append(list, st)
	}
	m.mu.Unlock()
	left := 0
	for _, st := range list {
		if done := m.finishStranded(ctx, st); done {
			m.mu.Lock()
			delete(m.strandedHib, st.snapID)
			m.mu.Unlock()
		} else {
			left++
		}
	}
	return left
}

// finishStranded commits st's checkpoint if it is not yet, then records it
// under the sandbox's lock; it reports whether st is done with (recorded,
// or dropped because the sandbox changed since).
func (m *Manager) finishStranded(ctx context.Context, st *stranded) bool {
	unlock, err := m.lock(ctx, st.sandboxID)
	if err != nil {
		return false
	}
	defer unlock()
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	s, err := m.cfg.DB.GetSandbox(cctx, st.sandboxID)
	if errors.Is(err, metadata.ErrNotFound) {
		m.dropStranded(cctx, st, "the sandbox was deleted")
		return true
	}
	if err != nil {
		return false // the database is still away
	}
	if s.SnapshotID == st.snapID {
		return true // recorded (by an earlier pass, or a fence that found it committed)
	}
	mine := s.Owner == m.cfg.Node && s.State == sandbox.StateHibernating && s.PendingSnapshot == st.snapID
	fenced := s.Owner == "" && s.State == sandbox.StateError && s.Generation == st.generation && s.SnapshotID == st.parent
	if s.Deleting || !(mine || fenced) {
		m.dropStranded(cctx, st, fmt.Sprintf("the sandbox changed since (state %s, owner %q, generation %d, snapshot %q)",
			s.State, s.Owner, s.Generation, s.SnapshotID))
		return true
	}
	if !st.committed {
		man, err := m.commitSnapshot(cctx, st.snapID, st.man, st.async)
		if err != nil {
			m.log.Debug("stranded hibernate: commit failed again", "sandbox", st.sandboxID, "snapshot", st.snapID, "err", err)
			return false
		}
		st.man, st.committed = man, true
	}
	if mine {
		if _, err := m.recordSnapshot(cctx, s, st.man, st.start, st.at, false); err != nil {
			return false
		}
	} else if err := m.recordFencedHibernate(cctx, s, st.man, m.cfg.Node); err != nil {
		return false
	}
	m.log.Warn("stranded hibernate committed and recorded: the sandbox is hibernated on it", "sandbox", st.sandboxID,
		"snapshot", st.snapID, "was_fenced", fenced)
	return true
}

// dropStranded deletes st's checkpoint (committed or staged): its sandbox
// does not resume from it.
func (m *Manager) dropStranded(ctx context.Context, st *stranded, why string) {
	m.log.Warn("stranded hibernate dropped: "+why, "sandbox", st.sandboxID, "snapshot", st.snapID)
	if st.committed {
		_ = m.cfg.Store.Delete(ctx, st.snapID)
	} else {
		_ = m.cfg.Store.Abort(ctx, st.snapID)
	}
}
