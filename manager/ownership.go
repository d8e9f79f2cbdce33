package manager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Ownership: a sandbox with an instance (creating, running, paused,
// hibernating, resuming) is owned by the node that holds the instance, its
// record's Owner with the lease's fencing token (metadata.Store). This
// manager is node Config.Node: it acts only on the sandboxes it owns and on
// those no node owns (hibernated, or fenced out of a lost node), which it
// claims (metadata.ClaimSandbox) before it resumes them. A call for a
// sandbox another node owns fails with a *NotOwnerError (in a sandbox.Error
// of kind Conflict), which the server answers by forwarding the call there.

// NotOwnerError says that the sandbox is another node's.
type NotOwnerError struct {
	SandboxID string
	// Node is the owner's name.
	Node string
}

func (e *NotOwnerError) Error() string {
	return fmt.Sprintf("sandbox %s is owned by node %s", e.SandboxID, e.Node)
}

// OwnerOf returns the node err says owns a sandbox ("" if err is no
// *NotOwnerError).
func OwnerOf(err error) string {
	var no *NotOwnerError
	if errors.As(err, &no) {
		return no.Node
	}
	return ""
}

// Node is the name of the node this manager is (Config.Node).
func (m *Manager) Node() string { return m.cfg.Node }

// foreign says whether s is owned by another node.
func (m *Manager) foreign(s *metadata.Sandbox) bool { return s.Owner != "" && s.Owner != m.cfg.Node }

func notOwner(id, node string) error {
	return &sandbox.Error{Kind: sandbox.Conflict, SandboxID: id, Err: &NotOwnerError{SandboxID: id, Node: node}}
}

// claim makes this node s's owner (a new lease, metadata.ClaimSandbox)
// unless it is already. Errors: a *NotOwnerError when another node claimed
// it first (s is not changed then); sandbox.ErrNotFound when it was deleted
// meanwhile; a sandbox.ErrConflict wrapping metadata.ErrStale when it was
// changed otherwise; the database's.
func (m *Manager) claim(ctx context.Context, s *metadata.Sandbox) error {
	if s.Owner == m.cfg.Node {
		return nil
	}
	c := *s
	c.Owner = m.cfg.Node
	err := m.cfg.DB.ClaimSandbox(context.WithoutCancel(ctx), &c)
	if errors.Is(err, metadata.ErrStale) {
		cur, gerr := m.cfg.DB.GetSandbox(ctx, s.ID)
		switch {
		case errors.Is(gerr, metadata.ErrNotFound) || (gerr == nil && cur.Deleting):
			return notFound("sandbox", s.ID) // deleted through another node meanwhile
		case gerr == nil && cur.Owner != "" && cur.Owner != m.cfg.Node:
			return notOwner(s.ID, cur.Owner)
		}
		// Changed otherwise (recovered, or a resume there failed and let
		// it go): the caller may read it again and decide again
		// (retryStale).
		return &sandbox.Error{Kind: sandbox.Conflict, SandboxID: s.ID,
			Err: fmt.Errorf("sandbox %s changed on another node while this one claimed it: retry (%w)", s.ID, metadata.ErrStale)}
	}
	if errors.Is(err, metadata.ErrNotFound) {
		return notFound("sandbox", s.ID)
	}
	if err != nil {
		return err
	}
	*s = c
	return nil
}

// Fence takes sandbox id away from node lost, which no longer heartbeats:
// a sandbox lost still owns that has an instance is recorded in state error
// (why, with what a resume gives back) and owned by no node, with a new
// lease token, so that writes of the lost node fail (metadata.ErrFenced) and
// any node can resume it from its last committed snapshot; a hibernate
// the lost node had begun whose snapshot committed is finished instead
// (hibernated, nothing lost). It reports
// whether it fenced the sandbox (false: it was not lost's, or another node
// fenced it first).
func (m *Manager) Fence(ctx context.Context, id, lost, why string) (bool, error) {
	if lost == m.cfg.Node {
		return false, nil
	}
	return m.fence(ctx, id, lost, why)
}

// fenceTries bounds how often fence reads a record again after a write
// that changed it between its read and its claim.
const fenceTries = 5

// fence is Fence, also of this node's own sandboxes (ReleaseOwned). A
// record another write changed between its read and the claim (the
// instance's exit recorded as an error meanwhile: CI saw ReleaseOwned leave
// such a sandbox owned) is read and judged again, fenceTries times at most.
func (m *Manager) fence(ctx context.Context, id, lost, why string) (bool, error) {
	for range fenceTries - 1 {
		ok, err := m.fenceOnce(ctx, id, lost, why)
		if !errors.Is(err, metadata.ErrStale) {
			return ok, err
		}
	}
	ok, err := m.fenceOnce(ctx, id, lost, why)
	if errors.Is(err, metadata.ErrStale) {
		return false, nil // changed on every try: another node's claims won
	}
	return ok, err
}

// fenceOnce is one try of fence; metadata.ErrStale when the record changed
// after it was read.
func (m *Manager) fenceOnce(ctx context.Context, id, lost, why string) (bool, error) {
	s, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil || s.Owner != lost {
		return false, err
	}
	if s.State == sandbox.StateHibernated {
		return false, nil
	}
	if s.State == sandbox.StateHibernating && s.PendingSnapshot != "" {
		if man, err := m.cfg.Store.Manifest(ctx, s.PendingSnapshot); err == nil {
			return m.fenceHibernated(ctx, s, lost, man)
		}
	}
	msg := why
	switch {
	case s.SnapshotID != "" && s.State != sandbox.StateHibernating:
		msg += fmt.Sprintf("; what it did since its last snapshot %s is lost: resume restores that snapshot", s.SnapshotID)
	case s.SnapshotID != "":
		msg += fmt.Sprintf("; its hibernate did not finish: resume restores its last committed snapshot %s", s.SnapshotID)
	default:
		msg += "; it had no snapshot: delete it"
	}
	if s.State == sandbox.StateHibernating {
		msg += fmt.Sprintf(" (node %s may still hold the checkpoint of that hibernate: if it commits it before anyone resumes the sandbox, the sandbox is hibernated on it)", lost)
	}
	s.Owner, s.State, s.Error, s.Instance, s.PendingSnapshot = "", sandbox.StateError, msg, "", ""
	s.StateChangedAt = time.Now().UTC()
	if err := m.cfg.DB.ClaimSandbox(ctx, s); err != nil {
		return false, err
	}
	m.log.Warn("sandbox fenced off a lost node", "sandbox", id, "node", lost, "error", msg)
	return true, nil
}

// fenceHibernated fences s off node lost, whose hibernate of it committed
// snapshot man before the node was lost: the hibernate is finished (state
// hibernated on man, no owner), nothing is lost.
func (m *Manager) fenceHibernated(ctx context.Context, s *metadata.Sandbox, lost string, man snapshot.Manifest) (bool, error) {
	s.Owner = ""
	if err := m.cfg.DB.ClaimSandbox(ctx, s); err != nil { // the new token fences the lost node out (ErrStale: fence tries again)
		return false, err
	}
	if err := m.commitFencedHibernate(ctx, s, man, ""); err != nil {
		return false, err
	}
	m.log.Warn("sandbox fenced off a lost node: its hibernate had committed", "sandbox", s.ID, "node", lost, "snapshot", man.ID)
	return true, nil
}

// commitFencedHibernate records s, which this node has just claimed with no
// owner (a new lease token), hibernated on committed snapshot man, whose
// local copy node snapNode may have ("" for none known).
func (m *Manager) commitFencedHibernate(ctx context.Context, s *metadata.Sandbox, man snapshot.Manifest, snapNode string) error {
	s.SnapshotID, s.SnapshotNode, s.PendingSnapshot, s.Instance = man.ID, snapNode, "", ""
	s.State, s.Error, s.StateChangedAt, s.LastHibernateAt = sandbox.StateHibernated, "", man.CreatedAt, &man.CreatedAt
	rec := m.snapshotRecord(ctx, man, s, man.HibernateMS, man.CreatedAt)
	return m.cfg.DB.CommitHibernate(ctx, rec, s)
}

// recordFencedHibernate records s, fenced (state error, no owner) while
// this node's hibernate of it was stranded, hibernated on that hibernate's
// committed snapshot man: a new lease first (fencing any older writer out),
// then the record, as fenceHibernated does.
func (m *Manager) recordFencedHibernate(ctx context.Context, s *metadata.Sandbox, man snapshot.Manifest, snapNode string) error {
	c := *s
	c.Owner = ""
	if err := m.cfg.DB.ClaimSandbox(ctx, &c); err != nil {
		return err
	}
	if err := m.commitFencedHibernate(ctx, &c, man, snapNode); err != nil {
		return err
	}
	*s = c
	return nil
}

// StopInstances stops every engine instance of a sandbox on this host
// without reading the database: the node fenced itself (it could not renew
// its lease, docs/multi-host.md) and no longer owns what it runs, which the
// other nodes will resume from their snapshots. It does not wait for the
// sandboxes' locks (a call holding one may be stuck on the database: it
// fails once its instance is gone). It returns the sandbox ids whose
// instance it stopped; a stop that fails is logged (StopForeign and
// Reconcile stop what is left once the database answers).
func (m *Manager) StopInstances(ctx context.Context) []string {
	var stopped []string
	m.eachInstance(ctx, "stop instances", func(engName, id, inst string) {
		m.dropLive(id)
		if err := m.engOf(inst).Stop(ctx, inst); err != nil {
			m.log.Warn("stop instances: stop", "instance", inst, "engine", engName, "err", err)
			return
		}
		stopped = append(stopped, id)
	})
	return stopped
}

// eachInstance calls f with every engine instance of a sandbox on this host
// (its engine's name, the sandbox's id, the instance's id); an engine whose
// list fails is logged under what and skipped.
func (m *Manager) eachInstance(ctx context.Context, what string, f func(engName, id, inst string)) {
	for _, e := range m.cfg.Engines.All() {
		infos, err := engineCalls{Engine: e, m: m}.List(ctx)
		if err != nil {
			m.log.Warn(what+": list", "engine", e.Name(), "err", err)
			continue
		}
		for _, i := range infos {
			if id, ok := sandboxOfInstance(i.ID); ok {
				f(e.Name(), id, i.ID)
			}
		}
	}
}

// ReleaseOwned gives up this node's sandboxes that are not hibernated, after
// StopInstances stopped them (the node fenced itself; one whose stop was
// seen as an unexpected exit is in state error already): each is recorded as
// Fence records a lost node's (state error with why and what a resume gives
// back, no owner, a new lease token; a hibernate whose snapshot committed is
// finished instead), so that any node resumes it from its last committed
// snapshot. Errors: the database's (the caller tries again).
func (m *Manager) ReleaseOwned(ctx context.Context, why string) error {
	m.FinishStranded(ctx) // a hibernate the outage interrupted ends hibernated
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return err
	}
	for _, s := range all {
		if s.Owner != m.cfg.Node || s.Deleting || s.State == sandbox.StateHibernated {
			continue
		}
		if _, err := m.fence(ctx, s.ID, m.cfg.Node, why); err != nil {
			return fmt.Errorf("release sandbox %s: %w", s.ID, err)
		}
	}
	return nil
}

// StopForeign stops the engine instances on this host of sandboxes this
// node no longer owns: another node owns the sandbox, or it was fenced off
// this node (state error, no owner) while this node was cut off from the
// database. Each is stopped under its sandbox's lock; what fails is logged
// and tried again on the next call. Reconcile does the same at start.
func (m *Manager) StopForeign(ctx context.Context) {
	if m.cfg.Node == "" {
		return
	}
	m.eachInstance(ctx, "stop foreign instances", func(engName, id, inst string) { m.stopIfForeign(ctx, engName, id, inst) })
}

// stopIfForeign stops instance inst of sandbox id if the sandbox is not
// this node's (see StopForeign).
func (m *Manager) stopIfForeign(ctx context.Context, engName, id, inst string) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return
	}
	defer unlock()
	s, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil || !(m.foreign(s) || (s.Owner == "" && s.State == sandbox.StateError)) {
		return
	}
	m.log.Warn("stopping an instance of a sandbox this node no longer owns", "sandbox", id, "instance", inst, "owner", s.Owner, "state", s.State)
	m.dropLive(id)
	if err := m.engOf(inst).Stop(ctx, inst); err != nil {
		m.log.Warn("stop foreign instance", "instance", inst, "engine", engName, "err", err)
	}
}

// sandboxOfInstance is the sandbox id of an instance id (instanceID).
func sandboxOfInstance(inst string) (string, bool) {
	const suffix = len("-00000000")
	if len(inst) <= suffix || inst[len(inst)-suffix] != '-' {
		return "", false
	}
	id := inst[:len(inst)-suffix]
	return id, idRE.MatchString(id)
}

// snapshotImage returns the path of the image file digest, which a
// snapshot was taken on, of the image named name. A node that never had it
// (the sandbox was made on another node; images are files of each node's
// data directory) builds it when name is a built-in image (from the host's build cache when it
// holds it, which gives the same digest); otherwise the error says to put
// the image on this node.
func (m *Manager) snapshotImage(ctx context.Context, name, digest string) (string, error) {
	_, rootfs, err := m.cfg.Images.Get(ctx, digest)
	if !errors.Is(err, image.ErrNotFound) {
		return rootfs, err
	}
	if !image.IsBuiltin(name) {
		return "", fmt.Errorf("%w: it is not on node %s (images are each node's files): import or build it there", err, m.cfg.Node)
	}
	m.log.Info("image of a snapshot missing on this node: building the built-in image", "image", name, "digest", digest)
	if _, berr := m.cfg.Images.EnsureBuiltin(ctx, name, io.Discard); berr != nil {
		return "", fmt.Errorf("%w: building %s on node %s: %v", err, name, m.cfg.Node, berr)
	}
	if _, rootfs, err = m.cfg.Images.Get(ctx, digest); err != nil {
		return "", fmt.Errorf("%w: node %s built %s with another digest: import the image there", err, m.cfg.Node, name)
	}
	return rootfs, nil
}
