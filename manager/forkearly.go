package manager

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/torpor/torpor/metadata"
)

// A fork of a running sandbox checkpoints it (it keeps running), commits the
// checkpoint as a snapshot and restores the clones from it. The restores do
// not wait for the commit: once the checkpoint is complete its files are
// linked into a directory of their own (hard links: no copy, the same page
// cache) and the clones' instances are restored from there while the store
// commits the staged files. Their records are written once the commit is
// (clones of a snapshot that exists), so a crash in between leaves instances
// without a running record, which Reconcile stops; the fork answers once both
// have ended, as before. A source that mounts volumes (copied for each clone
// after the checkpoint), or staged files that cannot be linked (another file
// system, a directory among them), take the serial path: commit, open, restore.

// earlyClones are the restores of a fork's clones started from a checkpoint
// before its commit.
type earlyClones struct {
	m      *Manager
	eng    engineCalls
	rootfs string
	// specs are the clones' instances (their records are written later);
	// errs their restores' outcomes once done[i] is closed.
	specs []*metadata.Sandbox
	errs  []error
	done  []chan struct{}
	// dir holds the links to the checkpoint's files ("" until started).
	dir string
	all sync.WaitGroup
	// first is the fork's ForkOptions.First: clone 0 restores alone.
	first bool
}

// newEarlyClones prepares the restores of clones ids of running sandbox src
// from image file rootfs on src's engine.
// With first, clone 0's restore runs alone before the others (cloneGate).
func (m *Manager) newEarlyClones(src *metadata.Sandbox, ids []string, rootfs string, first bool) *earlyClones {
	ec := &earlyClones{m: m, eng: m.eng(src), rootfs: rootfs, errs: make([]error, len(ids)), done: make([]chan struct{}, len(ids)), first: first}
	for i, id := range ids {
		ec.specs = append(ec.specs, &metadata.Sandbox{ID: id, Instance: instanceID(id, 1), MemoryMiB: src.MemoryMiB,
			CPUs: src.CPUs, Env: src.Env, PidsLimit: src.PidsLimit, GuestDigest: src.GuestDigest, Policy: src.Policy})
		ec.done[i] = make(chan struct{})
	}
	return ec
}

// start links the files of the complete checkpoint in staged into a
// directory beside it and restores the clones from there in the background,
// in the order of a cloneGate. If the files cannot be linked
// nothing starts (started then reports false) and the fork takes the serial
// path.
func (ec *earlyClones) start(ctx context.Context, staged string) {
	dir, err := linkCheckpoint(staged)
	if err != nil {
		ec.m.log.Debug("fork: checkpoint files not linked; clones restore after the commit", "dir", staged, "err", err)
		return
	}
	ec.dir = dir
	gate := newCloneGate(ec.first)
	for i, c := range ec.specs {
		ec.all.Add(1)
		go func() {
			defer ec.all.Done()
			defer close(ec.done[i])
			gate.enter(i)
			defer gate.leave(i)
			ec.errs[i] = ec.m.on(ec.eng.Engine, c).Restore(ctx, ec.m.spec(c, ec.rootfs), dir)
		}()
	}
}

// cloneGate orders the starts of a fork's clones: at most two at a time (the
// machines have 2 cores, and two restores at once take less time than one
// after the other); with first, clone 0 runs alone and the others begin once
// it has ended, so the clone a ForkOptions.First fork answers with has the
// host to itself.
type cloneGate struct {
	sem       chan struct{}
	first     bool
	firstDone chan struct{}
}

func newCloneGate(first bool) *cloneGate {
	return &cloneGate{sem: make(chan struct{}, 2), first: first, firstDone: make(chan struct{})}
}

// enter waits for clone i's turn.
func (g *cloneGate) enter(i int) {
	if g.first && i > 0 {
		<-g.firstDone
	}
	g.sem <- struct{}{}
}

// leave ends clone i's turn; leave(0) lets the others begin.
func (g *cloneGate) leave(i int) {
	<-g.sem
	if i == 0 {
		close(g.firstDone)
	}
}

// started reports whether the restores were started.
func (ec *earlyClones) started() bool { return ec != nil && ec.dir != "" }

// restore waits for clone i's restore and returns its error.
func (ec *earlyClones) restore(i int) error {
	<-ec.done[i]
	return ec.errs[i]
}

// close waits for every restore and removes the links (an encrypting store's
// staged plain text included).
func (ec *earlyClones) close() {
	if !ec.started() {
		return
	}
	ec.all.Wait()
	if err := os.RemoveAll(ec.dir); err != nil {
		ec.m.log.Warn("fork: removing the linked checkpoint", "dir", ec.dir, "err", err)
	}
}

// abort stops the clones' instances (the fork failed before their records
// were written) and removes the links.
func (ec *earlyClones) abort(ctx context.Context) {
	if !ec.started() {
		return
	}
	ec.all.Wait()
	for _, c := range ec.specs {
		_ = ec.m.on(ec.eng.Engine, c).Stop(ctx, c.Instance)
	}
	ec.close()
}

// linkCheckpoint hard-links the regular files of checkpoint directory staged
// into a new directory beside it (staged + ".fork"; the store's recovery
// empties staging at start) and returns it. Errors: a subdirectory or other
// non-regular entry in staged, and the file system's (EXDEV, EPERM).
func linkCheckpoint(staged string) (string, error) {
	ents, err := os.ReadDir(staged)
	if err != nil {
		return "", err
	}
	dir := staged + ".fork"
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			os.RemoveAll(dir)
			return "", fmt.Errorf("fork: %s in the checkpoint is not a regular file", e.Name())
		}
		if err := os.Link(filepath.Join(staged, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			os.RemoveAll(dir)
			return "", err
		}
	}
	return dir, nil
}
