package manager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Warm pools (docs/lifecycle.md#warm-pools).
//
// A template — an image, or a snapshot marked as one — can keep Size clones
// ready: each restored from the template's snapshot, its guest agent
// answered, then paused. A ready clone has no sandbox record: the API does not
// list it, the idle and timeout policies and the standby budget's demotions
// never see it, and a crash of the server leaves only engine instances that
// no record owns, which Reconcile stops; the pool then refills.
//
//	fill:  restore from the template snapshot -> agent answers -> pause -> ready
//	take:  record (creating, the clone's instance) -> unpause -> resume
//	       contract as a fork (new generation, forked) -> running
//
// What takes one: a create of the image whose spec is the template's (no env,
// volumes or egress fields; the default memory, CPUs and pids limit; mode
// memory), a fork of a sandbox hibernated or paused on a template snapshot
// whose clones would have the pool's spec, and a start from a kept template
// snapshot (StartFromSnapshot) with that spec (any other fork, create or
// start does what it does without a pool). Each clone is taken once: the ready list
// is popped under a mutex. A taken clone is a clone in every sense of the
// resume contract: the guest is told it is forked with a new generation, so
// it reseeds and wipes fork-unsafe secrets, as a fork's clone does.
//
// An image's template snapshot is taken of a sandbox started from the image
// (default spec) once its guest agent ran the start contract; it is recorded
// with the pool (metadata.Pools.SetPool) and made anew when the image is
// replaced or the server's guest agent changes.
//
// Memory: a ready clone holds an admission reservation of its memory limit
// (admission.go), handed to the sandbox that takes it. With a standby budget
// (LifecycleConfig.StandbyMemoryMiB) ready clones share it with paused
// sandboxes: a refill waits while it is full, and when paused sandboxes need
// the room ready clones are stopped before any paused sandbox is demoted.

// MaxPoolSize is the largest pool size of one template.
const MaxPoolSize = 16

// poolRetry is how long a pool whose refill failed waits before the next try.
const poolRetry = 10 * time.Second

// refillDelay is how long the refill waits after a take: a restore competes
// for the CPU with the taken sandbox's first requests (2 cores here).
const refillDelay = 250 * time.Millisecond

type poolKey struct {
	kind metadata.PoolKind
	name string
}

// pooledClone is one ready clone: instance (of the engine recorded for it,
// paused), restored as rec (not persisted) with spec, its agent's client,
// and its memory's reservation.
type pooledClone struct {
	rec    *metadata.Sandbox
	spec   engine.Spec
	client *agentclient.Client
	res    *reservation
}

type poolState struct {
	ready  []*pooledClone
	err    string
	failAt time.Time
	memMiB int
}

// pools are the ready clones of every template, by template.
type pools struct {
	mu    sync.Mutex
	state map[poolKey]*poolState
	// kick wakes the refill loop (a take, a new size); lastTake is when a
	// clone was last taken (under mu).
	kick     chan struct{}
	lastTake time.Time
	// setMu serializes the changes of pool records (SetImagePool,
	// SetSnapshotPool, a new template snapshot).
	setMu sync.Mutex
}

func (p *pools) get(k poolKey) *poolState {
	if p.state == nil {
		p.state = map[poolKey]*poolState{}
	}
	st := p.state[k]
	if st == nil {
		st = &poolState{}
		p.state[k] = st
	}
	return st
}

func (m *Manager) kickPools() {
	select {
	case m.pools.kick <- struct{}{}:
	default:
	}
}

// SetImagePool sets the warm pool size of image name (0..MaxPoolSize; 0 ends
// the pool and stops its ready clones). Errors: sandbox.ErrInvalidArgument
// for a size out of range; sandbox.ErrNotFound for an unknown image.
func (m *Manager) SetImagePool(ctx context.Context, name string, size int) (sandbox.Pool, error) {
	if err := checkPoolSize(size); err != nil {
		return sandbox.Pool{}, err
	}
	if !image.IsBuiltin(name) {
		if _, _, err := m.cfg.Images.Get(ctx, name); errors.Is(err, image.ErrNotFound) {
			return sandbox.Pool{}, notFound("image", name)
		} else if err != nil {
			return sandbox.Pool{}, err
		}
	}
	return m.setPool(ctx, metadata.Pool{Kind: metadata.PoolImage, Name: name}, size)
}

// SetSnapshotPool marks snapshot id a template with a warm pool of size
// clones (0..MaxPoolSize; 0 unmarks it and stops its ready clones; the
// snapshot is then collected as any other once no sandbox resumes from it).
// Errors: sandbox.ErrInvalidArgument for a size out of range;
// sandbox.ErrNotFound; sandbox.ErrConflict for a snapshot of mode filesystem
// (no memory to restore).
func (m *Manager) SetSnapshotPool(ctx context.Context, id string, size int) (sandbox.Pool, error) {
	if err := checkPoolSize(size); err != nil {
		return sandbox.Pool{}, err
	}
	if _, err := m.getSnapshot(ctx, id); err != nil {
		return sandbox.Pool{}, err
	}
	if m.isFilesystemSnapshot(ctx, id) {
		return sandbox.Pool{}, conflict("snapshot %s holds a writable layer only (no memory to restore clones from)", id)
	}
	return m.setPool(ctx, metadata.Pool{Kind: metadata.PoolSnapshot, Name: id, SnapshotID: id}, size)
}

func checkPoolSize(size int) error {
	if size < 0 || size > MaxPoolSize {
		return invalid("size %d: must be between 0 and %d", size, MaxPoolSize)
	}
	return nil
}

// setPool records pool p's new size (keeping its template snapshot) and
// stops the ready clones beyond it.
func (m *Manager) setPool(ctx context.Context, p metadata.Pool, size int) (sandbox.Pool, error) {
	ctx = context.WithoutCancel(ctx)
	m.pools.setMu.Lock()
	cur, err := m.cfg.DB.GetPool(ctx, p.Kind, p.Name)
	switch {
	case err == nil:
		p = cur
	case !errors.Is(err, metadata.ErrNotFound):
		m.pools.setMu.Unlock()
		return sandbox.Pool{}, err
	}
	p.Size, p.UpdatedAt = size, time.Now().UTC()
	if size == 0 {
		err = m.cfg.DB.DeletePool(ctx, p.Kind, p.Name)
		if errors.Is(err, metadata.ErrNotFound) {
			err = nil
		}
	} else {
		err = m.cfg.DB.SetPool(ctx, p, nil)
	}
	m.pools.setMu.Unlock()
	if err != nil {
		return sandbox.Pool{}, err
	}
	k := poolKey{p.Kind, p.Name}
	m.pools.mu.Lock()
	st := m.pools.get(k)
	var extra []*pooledClone
	if len(st.ready) > size {
		extra = st.ready[size:]
		st.ready = slices.Clone(st.ready[:size])
	}
	st.err, st.failAt = "", time.Time{}
	m.pools.mu.Unlock()
	m.stopClones(ctx, extra)
	if size == 0 {
		m.collectSnapshots(ctx)
	}
	m.kickPools()
	m.log.Info("pool size set", "template", p.Kind, "name", p.Name, "size", size)
	return m.poolView(p), nil
}

// ListPools returns every warm pool, by template kind and name.
func (m *Manager) ListPools(ctx context.Context) ([]sandbox.Pool, error) {
	recs, err := m.cfg.DB.ListPools(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Pool, 0, len(recs))
	for _, p := range recs {
		out = append(out, m.poolView(p))
	}
	return out, nil
}

// GetPool returns the warm pool of template kind ("image" or "snapshot") and
// name; sandbox.ErrNotFound when the template has none (size 0).
func (m *Manager) GetPool(ctx context.Context, kind, name string) (sandbox.Pool, error) {
	p, err := m.cfg.DB.GetPool(ctx, metadata.PoolKind(kind), name)
	if errors.Is(err, metadata.ErrNotFound) {
		return sandbox.Pool{Template: kind, Name: name}, notFound("pool", kind+" "+name)
	}
	if err != nil {
		return sandbox.Pool{}, err
	}
	return m.poolView(p), nil
}

func (m *Manager) poolView(p metadata.Pool) sandbox.Pool {
	v := sandbox.Pool{Template: string(p.Kind), Name: p.Name, Size: p.Size, SnapshotID: p.SnapshotID, UpdatedAt: p.UpdatedAt}
	m.pools.mu.Lock()
	if st := m.pools.state[poolKey{p.Kind, p.Name}]; st != nil {
		v.Ready, v.Error, v.MemoryMiB = len(st.ready), st.err, st.memMiB
	}
	m.pools.mu.Unlock()
	return v
}

// PoolReady reports how many clones the pool of template kind and name has
// ready now (for tests and the benchmark).
func (m *Manager) PoolReady(kind, name string) int {
	m.pools.mu.Lock()
	defer m.pools.mu.Unlock()
	if st := m.pools.state[poolKey{metadata.PoolKind(kind), name}]; st != nil {
		return len(st.ready)
	}
	return 0
}

// RunPools refills the warm pools until ctx ends (every lifecycle check
// interval and at once after a take or a new size), one clone at a time, and
// then stops every ready clone. The server runs it after Reconcile.
func (m *Manager) RunPools(ctx context.Context) {
	t := time.NewTicker(m.lcfg().CheckInterval)
	defer t.Stop()
	for {
		m.fillPools(ctx)
		select {
		case <-ctx.Done():
			m.pools.mu.Lock()
			var all []*pooledClone
			for _, st := range m.pools.state {
				all = append(all, st.ready...)
				st.ready = nil
			}
			m.pools.mu.Unlock()
			m.stopClones(context.Background(), all)
			return
		case <-t.C:
		case <-m.pools.kick:
		}
	}
}

// fillPools adds ready clones, one at a time, until every pool is full, or
// waits for the standby budget or the host's memory, or failed within
// poolRetry.
func (m *Manager) fillPools(ctx context.Context) {
	for ctx.Err() == nil {
		m.pools.mu.Lock()
		wait := refillDelay - time.Since(m.pools.lastTake)
		m.pools.mu.Unlock()
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			continue
		}
		p, ok := m.nextFill(ctx)
		if !ok {
			return
		}
		k := poolKey{p.Kind, p.Name}
		if err := m.fillOne(ctx, p); err != nil {
			if ctx.Err() != nil {
				return
			}
			m.log.Warn("pool: refill failed", "template", p.Kind, "name", p.Name, "err", err)
			m.pools.mu.Lock()
			st := m.pools.get(k)
			st.err, st.failAt = err.Error(), time.Now()
			m.pools.mu.Unlock()
		}
	}
}

// nextFill returns a pool short of clones that may get one now.
func (m *Manager) nextFill(ctx context.Context) (metadata.Pool, bool) {
	recs, err := m.cfg.DB.ListPools(ctx)
	if err != nil || len(recs) == 0 {
		return metadata.Pool{}, false
	}
	budget := m.lcfg().StandbyMemoryMiB
	room := 0
	if budget > 0 {
		all, err := m.cfg.DB.ListSandboxes(ctx)
		if err != nil {
			return metadata.Pool{}, false
		}
		room = budget - m.pooledMiB()
		for _, s := range all {
			if !s.Deleting && s.State == sandbox.StatePaused {
				room -= s.MemoryMiB
			}
		}
	}
	m.pools.mu.Lock()
	defer m.pools.mu.Unlock()
	for _, p := range recs {
		st := m.pools.get(poolKey{p.Kind, p.Name})
		if len(st.ready) >= p.Size || time.Since(st.failAt) < poolRetry {
			continue
		}
		need := st.memMiB
		if need == 0 {
			need = DefaultMemoryMiB
		}
		if budget > 0 && need > room {
			continue
		}
		return p, true
	}
	return metadata.Pool{}, false
}

// pooledMiB is the memory limits of every ready clone.
func (m *Manager) pooledMiB() int {
	m.pools.mu.Lock()
	defer m.pools.mu.Unlock()
	n := 0
	for _, st := range m.pools.state {
		for _, c := range st.ready {
			n += c.rec.MemoryMiB
		}
	}
	return n
}

// trimPools stops ready clones until those left hold at most roomMiB (the
// standby budget less the paused sandboxes), the most recently made first.
func (m *Manager) trimPools(ctx context.Context, roomMiB int) {
	var drop []*pooledClone
	m.pools.mu.Lock()
	total := 0
	for _, st := range m.pools.state {
		for _, c := range st.ready {
			total += c.rec.MemoryMiB
		}
	}
	for _, st := range m.pools.state {
		for total > max(roomMiB, 0) && len(st.ready) > 0 {
			c := st.ready[len(st.ready)-1]
			st.ready = st.ready[:len(st.ready)-1]
			total -= c.rec.MemoryMiB
			drop = append(drop, c)
		}
	}
	m.pools.mu.Unlock()
	if len(drop) > 0 {
		m.log.Info("pool: ready clones stopped for the standby budget", "clones", len(drop))
	}
	m.stopClones(ctx, drop)
}

// fillOne makes one ready clone of pool p.
func (m *Manager) fillOne(ctx context.Context, p metadata.Pool) error {
	start := time.Now()
	k := poolKey{p.Kind, p.Name}
	if p.Kind == metadata.PoolImage {
		var err error
		if p, err = m.imageTemplate(ctx, p); err != nil {
			return err
		}
	}
	dir, man, done, err := m.openSnapshot(ctx, p.SnapshotID, "pool", string(p.Kind)+" "+p.Name)
	if err != nil {
		return err
	}
	defer done()
	if isFilesystemManifest(man) {
		return fmt.Errorf("snapshot %s holds a writable layer only", p.SnapshotID)
	}
	e, err := m.restoreEngine(p.SnapshotID, man)
	if err != nil {
		return err
	}
	pauser, ok := e.(engine.Pauser)
	if !ok {
		return fmt.Errorf("engine %s cannot pause", e.Name())
	}
	_, rootfs, err := m.cfg.Images.Get(ctx, man.Spec.ImageDigest)
	if err != nil {
		return fmt.Errorf("image %s: %w", man.Spec.ImageDigest, err)
	}
	c, err := m.poolClone(ctx, p, man)
	if err != nil {
		return err
	}
	r, err := m.reserve(ctx, "pool", "", c.MemoryMiB, c.ID)
	if err != nil {
		return err
	}
	eng := m.on(e, c)
	fail := func(err error) error {
		_ = eng.Stop(context.WithoutCancel(ctx), c.Instance)
		m.adm.drop(r)
		return err
	}
	if err := eng.Restore(ctx, m.spec(c, rootfs), dir); err != nil {
		return fail(fmt.Errorf("restore: %w", err))
	}
	done()
	cl := m.agentFor(c.Instance)
	if err := cl.WaitReady(ctx, m.cfg.AgentTimeout); err != nil {
		cl.CloseIdleConnections()
		return fail(fmt.Errorf("guest agent did not answer: %w", err))
	}
	if err := eng.bound(ctx, m.cfg.EngineTimeouts.Stop, "pause", c.Instance, func(ctx context.Context) error {
		return pauser.Pause(ctx, c.Instance)
	}); err != nil {
		cl.CloseIdleConnections()
		return fail(fmt.Errorf("pause: %w", err))
	}
	pc := &pooledClone{rec: c, spec: poolSpec(m.spec(c, "")), client: cl, res: r}
	// The pool may have shrunk or got a new template meanwhile.
	cur, err := m.cfg.DB.GetPool(ctx, p.Kind, p.Name)
	m.pools.mu.Lock()
	st := m.pools.get(k)
	if err != nil || cur.SnapshotID != p.SnapshotID || len(st.ready) >= cur.Size {
		m.pools.mu.Unlock()
		m.stopClones(ctx, []*pooledClone{pc})
		return nil
	}
	st.ready = append(st.ready, pc)
	st.err, st.memMiB = "", c.MemoryMiB
	n := len(st.ready)
	m.pools.mu.Unlock()
	m.cfg.Metrics.poolFilled.Inc()
	m.log.Info("pool: clone ready", "template", p.Kind, "name", p.Name, "instance", c.Instance, "ready", n,
		"size", cur.Size, "ms", time.Since(start).Milliseconds())
	return nil
}

// poolClone is the record a clone of pool p (snapshot man) is restored as:
// the snapshot's spec with the limits and egress policy a create of the
// image (image pools) or a fork of the snapshot's sandbox (snapshot pools)
// gives. It is not persisted until the clone is taken.
func (m *Manager) poolClone(ctx context.Context, p metadata.Pool, man snapshot.Manifest) (*metadata.Sandbox, error) {
	id := NewSandboxID()
	c := &metadata.Sandbox{ID: id, State: sandbox.StateCreating, Image: man.Spec.Image, ImageDigest: man.Spec.ImageDigest,
		GuestDigest: man.Spec.GuestDigest, MemoryMiB: man.Spec.MemoryMiB, CPUs: man.Spec.CPUs, Env: man.Spec.Env,
		SnapshotID: p.SnapshotID, Seq: 1, Instance: instanceID(id, 1)}
	var err error
	if c.PidsLimit, err = m.pidsLimit(0, c.MemoryMiB); err != nil {
		return nil, err
	}
	if c.Network, err = m.createNetwork(sandbox.Spec{}); err != nil {
		return nil, err
	}
	if p.Kind == metadata.PoolImage {
		c.Image = p.Name
		return c, nil
	}
	if rec, err := m.cfg.DB.GetSnapshot(ctx, p.SnapshotID); err == nil {
		if src, err := m.cfg.DB.GetSandbox(ctx, rec.SandboxID); err == nil {
			if len(src.Volumes) > 0 {
				return nil, fmt.Errorf("sandbox %s of snapshot %s mounts volumes, which its clones cannot share", src.ID, p.SnapshotID)
			}
			c.Image, c.PidsLimit, c.Network = src.Image, src.PidsLimit, src.Network
		}
	}
	return c, nil
}

// imageTemplate returns image pool p with a template snapshot of the image
// as it is now, taken by the server's guest agent: p as it is, or with a new
// snapshot (recorded with the pool; the ready clones of the old one are
// stopped and the old snapshot collected).
func (m *Manager) imageTemplate(ctx context.Context, p metadata.Pool) (metadata.Pool, error) {
	if image.IsBuiltin(p.Name) {
		if _, err := m.cfg.Images.EnsureBuiltin(ctx, p.Name, io.Discard); err != nil {
			return p, fmt.Errorf("image %s: %w", p.Name, err)
		}
	}
	img, path, err := m.cfg.Images.Get(ctx, p.Name)
	if err != nil {
		return p, fmt.Errorf("image %s: %w", p.Name, err)
	}
	if p.SnapshotID != "" && p.ImageDigest == img.Digest {
		if man, err := m.cfg.Store.Manifest(ctx, p.SnapshotID); err == nil && man.Spec.GuestDigest == m.guestDigest {
			return p, nil
		}
	}
	start := time.Now()
	now := start.UTC()
	s := &metadata.Sandbox{ID: NewSandboxID(), State: sandbox.StateCreating, Image: p.Name, ImageDigest: img.Digest,
		GuestDigest: m.guestDigest, MemoryMiB: DefaultMemoryMiB, CPUs: DefaultCPUs, CreatedAt: now, StateChangedAt: now, Seq: 1}
	s.Instance = instanceID(s.ID, 1)
	if s.PidsLimit, err = m.pidsLimit(0, s.MemoryMiB); err != nil {
		return p, err
	}
	if s.Network, err = m.createNetwork(sandbox.Spec{}); err != nil {
		return p, err
	}
	r, err := m.reserve(ctx, "pool", "", s.MemoryMiB, s.ID)
	if err != nil {
		return p, err
	}
	defer m.adm.drop(r)
	eng := m.on(m.cfg.Engines.Default(), s)
	defer func() { _ = eng.Stop(context.WithoutCancel(ctx), s.Instance) }()
	if err := eng.Start(ctx, m.spec(s, path)); err != nil {
		return p, fmt.Errorf("template of image %s: %w", p.Name, err)
	}
	cl := m.agentFor(s.Instance)
	defer cl.CloseIdleConnections()
	if err := cl.WaitReady(ctx, m.cfg.AgentTimeout); err != nil {
		return p, fmt.Errorf("template of image %s: guest agent did not answer: %w", p.Name, err)
	}
	gen, err := m.cfg.DB.NextGeneration(ctx)
	if err != nil {
		return p, err
	}
	if _, err := guestResume(ctx, cl, contractCall{gen: gen, start: true}.req(), m.cfg.ResumeHookDeadline, m.cfg.ResumeAckDeadline); err != nil {
		return p, fmt.Errorf("template of image %s: start contract: %w", p.Name, err)
	}
	cl.CloseIdleConnections()
	snapID := newID("snap-")
	dir, err := m.cfg.Store.Stage(ctx, snapID)
	if err != nil {
		return p, diskFull("template of image "+p.Name, s.ID, err)
	}
	if err := m.snapshotRoom("template of image "+p.Name, s, dir); err != nil {
		_ = m.cfg.Store.Abort(ctx, snapID)
		return p, err
	}
	if err := eng.Checkpoint(ctx, s.Instance, dir, false); err != nil {
		_ = m.cfg.Store.Abort(ctx, snapID)
		return p, fmt.Errorf("template of image %s: checkpoint: %w", p.Name, err)
	}
	at := time.Now().UTC()
	man := m.manifestFor(s, eng, snapID, at)
	man.HibernateMS = time.Since(start).Milliseconds()
	if man, err = m.commitSnapshot(ctx, snapID, man, false); err != nil {
		_ = m.cfg.Store.Abort(ctx, snapID)
		return p, fmt.Errorf("template of image %s: commit: %w", p.Name, err)
	}
	rec := m.snapshotRecord(ctx, man, s, man.HibernateMS, at)
	m.pools.setMu.Lock()
	cur, err := m.cfg.DB.GetPool(ctx, p.Kind, p.Name)
	if err == nil {
		cur.SnapshotID, cur.ImageDigest = snapID, img.Digest
		err = m.cfg.DB.SetPool(ctx, cur, rec)
	}
	m.pools.setMu.Unlock()
	if err != nil {
		_ = m.cfg.Store.Delete(ctx, snapID)
		return p, fmt.Errorf("template of image %s: %w", p.Name, err)
	}
	m.pools.mu.Lock()
	st := m.pools.get(poolKey{p.Kind, p.Name})
	old := st.ready
	st.ready = nil
	m.pools.mu.Unlock()
	m.stopClones(ctx, old)
	m.collectSnapshots(ctx)
	m.log.Info("pool: template snapshot of image taken", "image", p.Name, "digest", img.Digest, "snapshot", snapID,
		"ms", time.Since(start).Milliseconds())
	return cur, nil
}

// stopClones stops ready clones taken out of their pool and ends their
// reservations.
func (m *Manager) stopClones(ctx context.Context, cs []*pooledClone) {
	for _, c := range cs {
		c.client.CloseIdleConnections()
		if err := m.engOf(c.rec.Instance).Stop(ctx, c.rec.Instance); err != nil {
			m.log.Warn("pool: stopping a ready clone", "instance", c.rec.Instance, "err", err)
		}
		m.adm.drop(c.res)
	}
}

// poolSpec is spec as a ready clone is compared by: without the instance id
// and the image file (the clone and the sandbox share the image digest).
func poolSpec(spec engine.Spec) engine.Spec {
	spec.ID, spec.RootFS = "", ""
	return spec
}

// sameSpec reports whether engine specs a and b (poolSpec) start the same
// sandbox (nil and empty lists and maps are the same).
func sameSpec(a, b engine.Spec) bool {
	if a.ID != b.ID || a.RootFS != b.RootFS || a.GuestDir != b.GuestDir || a.MemoryMiB != b.MemoryMiB || a.CPUs != b.CPUs ||
		!maps.Equal(a.Env, b.Env) || !slices.Equal(a.Mounts, b.Mounts) || a.PidsLimit != b.PidsLimit ||
		a.AgentPidsExempt != b.AgentPidsExempt || a.WritableMiB != b.WritableMiB || a.TmpMiB != b.TmpMiB || a.ShmMiB != b.ShmMiB ||
		(a.Egress == nil) != (b.Egress == nil) {
		return false
	}
	return a.Egress == nil || (a.Egress.InternetAccess == b.Egress.InternetAccess &&
		slices.Equal(a.Egress.AllowOut, b.Egress.AllowOut) && slices.Equal(a.Egress.DenyOut, b.Egress.DenyOut))
}

// takeClone pops a ready clone of pool k that starts the sandbox want would
// (its record as a create or fork would make it), or returns nil. With
// want.ImageDigest set (a create), clones of another digest (the image was
// replaced) are stopped and the pool refills with the new one.
func (m *Manager) takeClone(k poolKey, want *metadata.Sandbox) *pooledClone {
	var stale []*pooledClone
	defer func() {
		if len(stale) > 0 {
			m.stopClones(context.Background(), stale)
			m.kickPools()
		}
	}()
	m.pools.mu.Lock()
	defer m.pools.mu.Unlock()
	st := m.pools.state[k]
	if st == nil {
		return nil
	}
	var take *pooledClone
	kept := st.ready[:0]
	for _, c := range st.ready {
		w := *want
		w.GuestDigest = c.rec.GuestDigest // the snapshot's (checked for images by imageTemplate)
		switch {
		case want.ImageDigest != "" && want.ImageDigest != c.rec.ImageDigest:
			stale = append(stale, c)
		case take == nil && sameSpec(poolSpec(m.spec(&w, "")), c.spec):
			take = c
		default:
			kept = append(kept, c)
		}
	}
	st.ready = kept
	if take != nil {
		m.pools.lastTake = time.Now()
		m.kickPools()
	}
	return take
}

// putBack returns clones taken but not used to their pool.
func (m *Manager) putBack(k poolKey, cs []*pooledClone) {
	if len(cs) == 0 {
		return
	}
	m.pools.mu.Lock()
	st := m.pools.get(k)
	st.ready = append(st.ready, cs...)
	m.pools.mu.Unlock()
}

// startPooled makes clone pc the sandbox c (recorded already, in state
// creating, with pc's instance; the caller holds c's lock or made c): it
// unpauses the instance and runs the resume contract as a fork, with c's
// generation, and records c running. pc's reservation is c's until then. On
// failure c is left in state error and the error returned.
func (m *Manager) startPooled(ctx context.Context, c *metadata.Sandbox, pc *pooledClone) error {
	defer m.adm.drop(pc.res)
	eng := m.eng(c)
	p, ok := eng.Engine.(engine.Pauser)
	if !ok {
		err := fmt.Errorf("engine %s cannot pause", eng.Name())
		_ = eng.Stop(ctx, c.Instance)
		m.fail(ctx, c, err)
		return err
	}
	start := time.Now()
	if err := eng.bound(ctx, m.cfg.EngineTimeouts.Stop, "unpause", c.Instance, func(ctx context.Context) error {
		return p.Unpause(ctx, c.Instance)
	}); err != nil {
		pc.client.CloseIdleConnections()
		_ = eng.Stop(ctx, c.Instance)
		m.fail(ctx, c, fmt.Errorf("pooled clone: unpause: %w", err))
		return err
	}
	launched := time.Now()
	m.mu.Lock()
	m.live[c.ID] = pc.client
	m.mu.Unlock()
	m.watch(c.ID, c.Instance)
	c.LastResume = m.runContract(ctx, c, c.Generation, true, false, c.SnapshotID, launched)
	tRecord := time.Now()
	t := tRecord.UTC()
	c.LastResumeAt = &t
	err := m.setState(ctx, c, sandbox.StateRunning)
	m.cfg.Metrics.poolTaken.Inc()
	m.log.Info("pool: clone taken", "sandbox", c.ID, "instance", c.Instance, "unpause_ms", msf(launched.Sub(start)),
		"contract_ms", msf(tRecord.Sub(launched)), "record_ms", msf(time.Since(tRecord)))
	return err
}

// asPooled gives record c (a create's or a fork's, not yet persisted) ready
// clone pc's instance and snapshot, and hands it pc's memory reservation.
func (m *Manager) asPooled(c *metadata.Sandbox, pc *pooledClone) {
	c.Instance, c.Seq, c.SnapshotID = pc.rec.Instance, 1, pc.rec.SnapshotID
	c.ImageDigest, c.GuestDigest = pc.rec.ImageDigest, pc.rec.GuestDigest
	c.Owner = m.cfg.Node // the clone's instance runs here (ownership.go)
	m.adm.cover(pc.res, c.ID)
}

// createPooled is Create's path for a spec a pool of image img serves: it
// takes a ready clone for record s (not yet persisted; the caller holds its
// lock) and starts it, or returns false when there is none.
func (m *Manager) createPooled(ctx context.Context, s *metadata.Sandbox) (sandbox.Sandbox, bool, error) {
	if s.HibernationMode != sandbox.ModeMemory || len(s.Volumes) > 0 {
		return sandbox.Sandbox{}, false, nil
	}
	pc := m.takeClone(poolKey{metadata.PoolImage, s.Image}, s)
	if pc == nil {
		return sandbox.Sandbox{}, false, nil
	}
	ctx = context.WithoutCancel(ctx)
	start := time.Now()
	m.asPooled(s, pc)
	gen, err := m.cfg.DB.NextGeneration(ctx)
	if err == nil {
		s.Generation = gen
		err = m.cfg.DB.CreateSandbox(ctx, s)
	}
	if err != nil {
		m.stopClones(ctx, []*pooledClone{pc})
		return sandbox.Sandbox{}, true, err
	}
	if err := m.startPooled(ctx, s, pc); err != nil {
		return m.view(ctx, s), true, err
	}
	m.writeResolvConf(ctx, s)
	m.cfg.Metrics.created.Inc()
	m.log.Info("created from the warm pool", "sandbox", s.ID, "image", s.Image, "instance", s.Instance, "ms", msf(time.Since(start)))
	return m.view(ctx, s), true, nil
}

// takeForFork takes up to count ready clones of source src's snapshot pool
// for clones of src (ids, in order).
func (m *Manager) takeForFork(src *metadata.Sandbox, ids []string) []*pooledClone {
	if (src.State != sandbox.StateHibernated && src.State != sandbox.StatePaused) || src.SnapshotID == "" || len(src.Volumes) > 0 {
		return nil
	}
	k := poolKey{metadata.PoolSnapshot, src.SnapshotID}
	var out []*pooledClone
	for _, id := range ids {
		want := &metadata.Sandbox{ID: id, MemoryMiB: src.MemoryMiB, CPUs: src.CPUs, Env: src.Env, PidsLimit: src.PidsLimit}
		want.Network = src.Network
		pc := m.takeClone(k, want)
		if pc == nil {
			break
		}
		out = append(out, pc)
	}
	return out
}

// startPooledFromSnapshot is StartFromSnapshot's path for kept snapshot rec
// when its warm pool has a ready clone for spec (policies pol): the clone
// becomes the new sandbox, as a fork clone of the snapshot. It returns false
// when there is none.
func (m *Manager) startPooledFromSnapshot(ctx context.Context, rec *metadata.Snapshot, spec sandbox.Spec, pol sandbox.Policy) (sandbox.Sandbox, bool, error) {
	if pol.HibernationMode != sandbox.ModeMemory || len(pol.Volumes) > 0 {
		return sandbox.Sandbox{}, false, nil
	}
	man, err := m.cfg.Store.Manifest(ctx, rec.ID)
	if err != nil || isFilesystemManifest(man) {
		return sandbox.Sandbox{}, false, nil
	}
	env := maps.Clone(man.Spec.Env)
	if len(spec.Env) > 0 && env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, spec.Env)
	now := time.Now().UTC()
	c := &metadata.Sandbox{ID: NewSandboxID(), State: sandbox.StateCreating, Image: man.Spec.Image,
		MemoryMiB: man.Spec.MemoryMiB, CPUs: man.Spec.CPUs, Env: env, ForkedFrom: rec.SandboxID,
		Metadata: spec.Metadata, CreatedAt: now, StateChangedAt: now, Policy: pol}
	k := poolKey{metadata.PoolSnapshot, rec.ID}
	m.pools.mu.Lock()
	if st := m.pools.state[k]; st != nil && len(st.ready) > 0 {
		// A restore keeps the snapshot's limits (engine.Spec): the record
		// says what the clone has.
		c.PidsLimit = st.ready[0].rec.PidsLimit
	}
	m.pools.mu.Unlock()
	pc := m.takeClone(k, c)
	if pc == nil {
		return sandbox.Sandbox{}, false, nil
	}
	m.asPooled(c, pc)
	gen, err := m.cfg.DB.NextGeneration(ctx)
	if err == nil {
		c.Generation = gen
		err = m.cfg.DB.CreateSandbox(ctx, c)
	}
	if err != nil {
		m.stopClones(ctx, []*pooledClone{pc})
		return sandbox.Sandbox{}, true, err
	}
	unlock, _ := m.lock(ctx, c.ID)
	defer unlock()
	if err := m.startPooled(ctx, c, pc); err != nil {
		return m.view(ctx, c), true, fmt.Errorf("start from snapshot %s: %w", rec.ID, err)
	}
	m.writeResolvConf(ctx, c)
	m.cfg.Metrics.created.Inc()
	return m.view(ctx, c), true, nil
}
