package gvisor

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/sandboxnet"
)

// Prepared containers take `runsc create` off a restore's path.
//
// A plain restore starts the container first: runsc boot and the gofer, the
// namespaces, the cgroup, and before that the instance's pair of network
// namespaces. runsc restores into a container that is already in its Created
// state without doing any of that again (runsc/cmd/restore.go, loadContainer:
// the container's saved spec is used, the bundle is not read again). With
// Config.PreparedContainers > 0 the engine keeps up to that many containers
// created ahead of time, each for the shape of a recent restore: the OCI spec
// the restore would use (image, memory, limits, mounts, environment) without
// the parts named by the instance id. A Restore whose shape has one ready
// restores into it; every Restore then prepares one of its own shape for the
// next (refillDelay later, off the resumed sandbox's first requests).
//
// A prepared container has its own runsc id, preparedPrefix and a random
// token, which it keeps after a restore claims it: the instance id the caller
// chose is an alias of it, recorded in StateDir/aliases/<instance id> before
// the restore begins (so a server that crashes at any point afterwards still
// finds, lists and stops the instance by the caller's id). Unclaimed prepared
// containers are listed under their own ids, so a new server's reconcile
// stops those a crashed one left; DiscardPrepared removes them on shutdown.
//
// What a prepared container holds: its sentry and gofer processes (RSS in its
// cgroup, PreparedMemory) and its network namespaces; no guest memory until a
// restore fills it.

// preparedPrefix starts every prepared container's runsc id: "prep-" and 12
// hex digits of a per-engine random token, "-" and 6 digits (fixed width, so
// no id is a prefix of another, as runsc resolves ids by prefix).
const preparedPrefix = "prep-"

// aliasDir (under StateDir) holds one file per instance restored into a
// prepared container: named by the instance id, holding the runsc id.
const aliasDir = "aliases"

// refillDelay is how long after a restore the engine starts preparing the
// next container of its shape: runsc create costs ~100 ms of CPU, which on a
// two-core host would otherwise compete with the resumed sandbox's resume
// contract and first request.
const refillDelay = 300 * time.Millisecond

// shapeHold is how long a remembered shape keeps its place against a shape
// the pool has no room for, after its last restore or checkpoint. It bounds
// the containers made and discarded unused to PreparedContainers per
// shapeHold, whatever the number of shapes in turn.
const shapeHold = time.Minute

// preparedPool is the engine's prepared containers and its aliases.
type preparedPool struct {
	mu sync.Mutex
	// ready holds the unclaimed prepared containers by shape key.
	ready map[string][]string
	// shapes are the specs (ID cleared) of the recently restored shapes,
	// used holds their keys least recently restored first, last the time
	// of each one's latest restore or checkpoint.
	shapes map[string]engine.Spec
	used   []string
	last   map[string]time.Time
	// launched holds the spec each running instance was started or
	// restored with, by instance id: a checkpoint prepares its shape.
	launched map[string]engine.Spec
	// held counts the shapes turned away because every remembered shape
	// was within shapeHold.
	held int64
	// preparing counts preparations under way (they count toward the size).
	preparing int
	// alias maps instance ids to runsc ids (the files of aliasDir).
	alias map[string]string
	token string
	seq   int
	// ctx ends preparations (DiscardPrepared); wg waits for them.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed bool
	// restores counts the restores made into prepared containers.
	restores int64
}

var _ engine.RestorePreparer = (*Engine)(nil)

// initPrepared loads the aliases recorded in StateDir and readies the pool.
func (e *Engine) initPrepared() error {
	p := &e.prep
	p.ready, p.shapes, p.alias = map[string][]string{}, map[string]engine.Spec{}, map[string]string{}
	p.last, p.launched = map[string]time.Time{}, map[string]engine.Spec{}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	var tok [6]byte
	if _, err := rand.Read(tok[:]); err != nil {
		return err
	}
	p.token = hex.EncodeToString(tok[:])
	dir := filepath.Join(e.cfg.StateDir, aliasDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, d := range ents {
		b, err := os.ReadFile(filepath.Join(dir, d.Name()))
		rid := strings.TrimSpace(string(b))
		if err != nil || !idRE.MatchString(d.Name()) || !idRE.MatchString(rid) {
			continue
		}
		p.alias[d.Name()] = rid
	}
	return nil
}

// rid returns the runsc id of instance id: its prepared container's, or id.
func (e *Engine) rid(id string) string {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	if r, ok := e.prep.alias[id]; ok {
		return r
	}
	return id
}

// instanceOf returns the instance id of runsc id rid (the alias's name), or rid.
func (e *Engine) instanceOf(rid string) string {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	for id, r := range e.prep.alias {
		if r == rid {
			return id
		}
	}
	return rid
}

// setAlias records that instance id is runsc container rid, on disk first.
func (e *Engine) setAlias(id, rid string) error {
	f := filepath.Join(e.cfg.StateDir, aliasDir, id)
	tmp := f + ".tmp"
	if err := os.WriteFile(tmp, []byte(rid+"\n"), 0o600); err != nil {
		return fmt.Errorf("gvisor: alias %s: %w", id, err)
	}
	if err := os.Rename(tmp, f); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("gvisor: alias %s: %w", id, err)
	}
	e.prep.mu.Lock()
	e.prep.alias[id] = rid
	e.prep.mu.Unlock()
	return nil
}

// dropAlias forgets instance id's alias (after its container is stopped).
func (e *Engine) dropAlias(id string) {
	e.prep.mu.Lock()
	delete(e.prep.alias, id)
	e.prep.mu.Unlock()
	os.Remove(filepath.Join(e.cfg.StateDir, aliasDir, id))
}

// shapeKey names the container a restore of spec (ID, rootfs and limits as
// the restore uses them) needs: a hash of its OCI spec without the parts
// named by the instance id (network namespace path, cgroup path).
func (e *Engine) shapeKey(spec engine.Spec) string {
	spec.ID = ""
	b, _ := json.Marshal(e.ociSpec(spec, sandboxnet.Pair{}))
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:12])
}

// claim takes a ready prepared container for spec's shape and returns its
// runsc id, or "" when none is ready. A container whose sandbox process is
// gone (killed from outside) is stopped and skipped.
func (e *Engine) claim(spec engine.Spec) string {
	if e.cfg.PreparedContainers <= 0 {
		return ""
	}
	key := e.shapeKey(spec)
	for {
		e.prep.mu.Lock()
		ids := e.prep.ready[key]
		if len(ids) == 0 {
			e.prep.mu.Unlock()
			return ""
		}
		rid := ids[0]
		e.prep.ready[key] = ids[1:]
		e.prep.mu.Unlock()
		if e.createdAlive(rid) {
			e.prep.mu.Lock()
			e.prep.restores++
			e.prep.mu.Unlock()
			return rid
		}
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = e.stop(sctx, rid)
		cancel()
	}
}

// createdAlive reports whether container rid is in runsc's Created state with
// its sandbox process alive (read from its state file, no runsc call).
func (e *Engine) createdAlive(rid string) bool {
	b, err := os.ReadFile(e.statePath(rid))
	if err != nil {
		return false
	}
	var st struct {
		Status  string `json:"status"`
		Sandbox struct {
			Pid int `json:"pid"`
		} `json:"sandbox"`
	}
	if json.Unmarshal(b, &st) != nil {
		return false
	}
	return st.Status == "created" && alive(st.Sandbox.Pid)
}

// restorePrepared restores imageDir into prepared container rid as instance
// spec.ID: the alias first, then egress on rid's namespaces, runsc restore,
// the CPU limit.
func (e *Engine) restorePrepared(ctx context.Context, spec engine.Spec, rid, imageDir string) error {
	if err := e.setAlias(spec.ID, rid); err != nil {
		_ = e.stop(ctx, rid)
		return err
	}
	if err := e.attachEgress(ctx, spec, e.pair(rid)); err != nil {
		return err
	}
	if _, err := e.run(ctx, e.restoreArgs(imageDir, e.bundle(rid), rid)...); err != nil {
		return fmt.Errorf("gvisor: restore %s into prepared %s: %w", spec.ID, rid, err)
	}
	cpu := spec
	cpu.ID = rid
	if err := e.applyCPU(cpu); err != nil {
		return fmt.Errorf("gvisor: %s: cpu limit: %w", spec.ID, err)
	}
	return nil
}

// refill remembers spec's shape as the most recently restored and, after
// refillDelay, prepares a container of it if none is ready. A shape new to a
// full pool takes the place of the least recently used one only if that
// one's last use is shapeHold old (admitLocked); its container is discarded.
func (e *Engine) refill(spec engine.Spec) {
	if e.cfg.PreparedContainers <= 0 {
		return
	}
	spec.ID, spec.Egress = "", nil
	key := e.shapeKey(spec)
	p := &e.prep
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	evicted, ok := p.admitLocked(key, spec, time.Now(), e.cfg.PreparedContainers)
	if evicted != "" {
		for _, rid := range p.ready[evicted] {
			p.discardLocked(e, rid)
		}
		delete(p.ready, evicted)
	}
	if !ok || len(p.ready[key]) > 0 || p.preparing > 0 || p.countLocked() >= e.cfg.PreparedContainers {
		return
	}
	p.preparing++
	p.seq++
	rid := fmt.Sprintf("%s%s-%06d", preparedPrefix, p.token, p.seq%1000000)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		err := e.prepare(p.ctx, spec, rid)
		p.mu.Lock()
		p.preparing--
		keep := err == nil && !p.closed && p.shapes[key].RootFS != ""
		if keep {
			p.ready[key] = append(p.ready[key], rid)
		}
		p.mu.Unlock()
		if !keep {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			_ = e.stop(sctx, rid)
			cancel()
		}
	}()
}

// admitLocked records a use of shape key (spec) at now in a pool that
// remembers at most n shapes, and reports whether the shape is remembered
// afterwards. A known shape moves to the most recent place. A new shape
// joins while there is room; in a full pool it displaces the least recently
// used shape (returned as evicted, whose containers the caller discards) only
// if that one was last used shapeHold or more before now, and is turned away
// (ok false, counted in held) otherwise.
func (p *preparedPool) admitLocked(key string, spec engine.Spec, now time.Time, n int) (evicted string, ok bool) {
	if _, known := p.shapes[key]; !known && len(p.used) >= n {
		old := p.used[0]
		if now.Sub(p.last[old]) < shapeHold {
			p.held++
			return "", false
		}
		p.used = p.used[1:]
		delete(p.shapes, old)
		delete(p.last, old)
		evicted = old
	}
	p.shapes[key], p.last[key] = spec, now
	p.used = append(removeKey(p.used, key), key)
	return evicted, true
}

// launchedAs records the spec instance spec.ID now runs with (its rootfs and
// limits as launch resolved them), for expect: in memory, and in a file of
// the engine's state directory (launchedFile) that the engine of a later
// server reads when it checkpoints the instance it reattached. A file that
// cannot be written only costs that later checkpoint its prepared container.
func (e *Engine) launchedAs(spec engine.Spec) {
	if e.cfg.PreparedContainers <= 0 {
		return
	}
	e.prep.mu.Lock()
	e.prep.launched[spec.ID] = spec
	e.prep.mu.Unlock()
	if b, err := json.Marshal(spec); err == nil {
		p := e.launchedFile(spec.ID)
		if os.MkdirAll(filepath.Dir(p), 0o700) == nil && os.WriteFile(p+".tmp", b, 0o600) == nil {
			_ = os.Rename(p+".tmp", p)
		}
	}
}

// launchedFile is where launchedAs keeps instance id's spec (its
// environment, as in its bundle: mode 0600).
func (e *Engine) launchedFile(id string) string {
	return filepath.Join(e.cfg.StateDir, "launched", id+".json")
}

// expect prepares a container for the shape of instance id, which is being
// checkpointed: the snapshot's restore will want it. An instance this engine
// did not launch (reattached after a restart) has its shape read from the
// file its launching engine wrote (launchedAs); one without is left alone.
func (e *Engine) expect(id string) {
	if e.cfg.PreparedContainers <= 0 {
		return
	}
	e.prep.mu.Lock()
	spec, ok := e.prep.launched[id]
	e.prep.mu.Unlock()
	if !ok {
		b, err := os.ReadFile(e.launchedFile(id))
		if err != nil || json.Unmarshal(b, &spec) != nil || spec.ID != id {
			return
		}
		e.prep.mu.Lock()
		e.prep.launched[id] = spec
		e.prep.mu.Unlock()
	}
	e.refill(spec)
}

// forgetLaunched drops instance id's launch record (Stop).
func (e *Engine) forgetLaunched(id string) {
	e.prep.mu.Lock()
	delete(e.prep.launched, id)
	e.prep.mu.Unlock()
	_ = os.Remove(e.launchedFile(id))
}

// HeldShapes returns how many times a shape was turned away from the
// prepared containers because every remembered shape had been used within
// shapeHold (for tests and the logs).
func (e *Engine) HeldShapes() int64 {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	return e.prep.held
}

// countLocked is the number of ready prepared containers.
func (p *preparedPool) countLocked() int {
	n := 0
	for _, ids := range p.ready {
		n += len(ids)
	}
	return n
}

// discardLocked stops prepared container rid in the background.
func (p *preparedPool) discardLocked(e *Engine, rid string) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = e.stop(sctx, rid)
		cancel()
	}()
}

func removeKey(keys []string, key string) []string {
	out := keys[:0]
	for _, k := range keys {
		if k != key {
			out = append(out, k)
		}
	}
	return out
}

// prepare creates container rid of shape spec (ID unset): its network
// namespaces, its bundle and `runsc create`, after refillDelay.
func (e *Engine) prepare(ctx context.Context, spec engine.Spec, rid string) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(refillDelay):
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	spec.ID = rid
	if err := e.writeBundle(ctx, spec); err != nil {
		return err
	}
	if _, err := e.run(ctx, "create", "--bundle", e.bundle(rid), rid); err != nil {
		return fmt.Errorf("gvisor: prepare %s: %w", rid, err)
	}
	return nil
}

// PreparedRestores returns how many restores went into prepared containers
// (for benchmarks and tests).
func (e *Engine) PreparedRestores() int64 {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	return e.prep.restores
}

// Prepared implements engine.RestorePreparer.
func (e *Engine) Prepared() (n int, memoryBytes int64) {
	e.prep.mu.Lock()
	var ids []string
	for _, r := range e.prep.ready {
		ids = append(ids, r...)
	}
	n = len(ids) + e.prep.preparing
	e.prep.mu.Unlock()
	for _, rid := range ids {
		if used, _, err := e.Memory(rid); err == nil {
			memoryBytes += used
		}
	}
	return n, memoryBytes
}

// DiscardPrepared implements engine.RestorePreparer: it ends preparations
// under way and stops every unclaimed prepared container (processes, network
// namespaces, cgroup, bundle), and removes the spare network pairs
// (spares.go). No container or spare is prepared afterwards.
func (e *Engine) DiscardPrepared(ctx context.Context) error {
	serr := e.discardSpares(ctx)
	p := &e.prep
	p.mu.Lock()
	p.closed = true
	var ids []string
	for _, r := range p.ready {
		ids = append(ids, r...)
	}
	p.ready = map[string][]string{}
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
	errs := []error{serr}
	for _, rid := range ids {
		if err := e.stop(ctx, rid); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// unready removes runsc id rid from the ready prepared containers (it is
// being stopped).
func (e *Engine) unready(rid string) {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	for k, ids := range e.prep.ready {
		e.prep.ready[k] = removeKey(ids, rid)
	}
}

// aliases returns the instance ids restored into prepared containers.
func (e *Engine) aliases() []string {
	e.prep.mu.Lock()
	defer e.prep.mu.Unlock()
	ids := make([]string, 0, len(e.prep.alias))
	for id := range e.prep.alias {
		ids = append(ids, id)
	}
	return ids
}
