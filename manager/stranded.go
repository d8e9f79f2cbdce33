package manager

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
			m.dropNote(st.snapID)
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

// A hibernate on a shared database also leaves a note beside its staged
// checkpoint (hibernateNote, in the store's staging directory) while it is
// not recorded, so that a node killed or restarted meanwhile can still
// record it after the other nodes fenced the sandbox: at start-up
// (finishFencedCheckpoints) a note whose sandbox is in error with no owner,
// at the hibernate's generation and on its parent snapshot, has its
// checkpoint committed and recorded as finishStranded does. Recover removes
// the notes with the staged files.

// hibernateNote is what a hibernate's note holds.
type hibernateNote struct {
	Sandbox    string `json:"sandbox"`
	Node       string `json:"node"`
	Generation int64  `json:"generation"`
	Parent     string `json:"parent"`
	Instance   string `json:"instance"`
}

// noteSuffix ends a note's file name (<snapshot id> + noteSuffix).
const noteSuffix = ".hibernate.json"

// notePath is the file of snapshot snapID's note, "" when the store has no
// staging directory to put it in or the database is not shared.
func (m *Manager) notePath(snapID string) string {
	sd, ok := m.cfg.Store.(interface{ StagedDir(string) string })
	if !ok || m.cfg.SingleNode || m.cfg.Node == "" {
		return ""
	}
	return sd.StagedDir(snapID) + noteSuffix
}

// writeNote writes the note of hibernate snapID of s (best effort: without
// it only a restart's recovery after a fence is lost).
func (m *Manager) writeNote(s *metadata.Sandbox, snapID string) {
	p := m.notePath(snapID)
	if p == "" {
		return
	}
	b, _ := json.Marshal(hibernateNote{Sandbox: s.ID, Node: m.cfg.Node, Generation: s.Generation, Parent: s.SnapshotID, Instance: s.Instance})
	if err := os.WriteFile(p, b, 0o600); err != nil {
		m.log.Warn("hibernate: writing its note beside the staged checkpoint", "snapshot", snapID, "err", err)
	}
}

// dropNote removes snapshot snapID's note.
func (m *Manager) dropNote(snapID string) {
	if p := m.notePath(snapID); p != "" {
		_ = os.Remove(p)
	}
}

// finishFencedCheckpoints commits and records, at start-up, the staged
// checkpoints of this node's hibernates that a crash interrupted and whose
// sandboxes the other nodes fenced meanwhile (see hibernateNote). It runs
// before the store's Recover, which removes staged files.
func (m *Manager) finishFencedCheckpoints(ctx context.Context) {
	p := m.notePath("snap-x")
	if p == "" {
		return
	}
	files, _ := filepath.Glob(filepath.Join(filepath.Dir(p), "*"+noteSuffix))
	for _, f := range files {
		snapID := strings.TrimSuffix(filepath.Base(f), noteSuffix)
		b, err := os.ReadFile(f)
		var n hibernateNote
		if err != nil || json.Unmarshal(b, &n) != nil || n.Node != m.cfg.Node {
			continue
		}
		s, err := m.cfg.DB.GetSandbox(ctx, n.Sandbox)
		if err != nil || s.Deleting || s.Owner != "" || s.State != sandbox.StateError ||
			s.Generation != n.Generation || s.SnapshotID != n.Parent {
			continue // not fenced, or resumed or deleted since: Reconcile or Recover deals with it
		}
		if n.Instance != "" && !m.waitCheckpointExit(ctx, n.Instance) {
			m.log.Warn("reconcile: a fenced sandbox's interrupted checkpoint did not end; not committed", "sandbox", s.ID, "snapshot", snapID)
			continue
		}
		c := *s
		c.Instance = n.Instance
		man, err := m.cfg.Store.Manifest(ctx, snapID)
		if err != nil {
			man, err = m.commitSnapshot(ctx, snapID, m.manifestFor(&c, m.eng(&c), snapID, time.Now().UTC()), false)
		}
		if err != nil {
			m.log.Warn("reconcile: a fenced sandbox's interrupted checkpoint could not be committed", "sandbox", s.ID, "snapshot", snapID, "err", err)
			continue
		}
		if err := m.recordFencedHibernate(ctx, s, man, m.cfg.Node); err != nil {
			m.log.Warn("reconcile: recording a fenced sandbox's interrupted checkpoint", "sandbox", s.ID, "snapshot", snapID, "err", err)
			continue
		}
		_ = os.Remove(f)
		m.log.Warn("reconcile: committed the checkpoint of a hibernate a crash interrupted; the sandbox, fenced meanwhile, is hibernated on it",
			"sandbox", s.ID, "snapshot", snapID)
	}
}
