// Package manager is the sandbox manager: the only code that changes a sandbox's
// state. It runs the lifecycle state machine
//
//	creating -> running -> hibernating -> hibernated -> resuming -> running
//	running -> paused -> running; paused -> hibernated (pause.go)
//	(any of them) -> error
//
// on top of an engine (engine.Engine), a snapshot store (snapshot.Store), the image
// store and the metadata database. Rules it keeps:
//
//   - One lock per sandbox serializes every call that changes or uses it; a call that
//     finds the sandbox hibernating or resuming waits for the lock and then proceeds.
//   - Every transition is written to the database before it is acknowledged, and
//     before the engine is asked to do anything irreversible.
//   - A sandbox is reported hibernated only after its snapshot is committed.
//   - Delete marks the record deleting (persisted), stops the engine instance and
//     waits for its processes to be gone, and only then removes the record.
//   - On start-up Reconcile makes the database and the host agree: no engine
//     instance without a running sandbox, no running sandbox without an instance.
package manager

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Config wires a Manager to its parts.
type Config struct {
	// Engines are the host's engines; new sandboxes start on the registry's
	// default, a snapshot is restored by the engine its manifest names
	// (restoreEngine).
	Engines *engine.Registry
	// EngineTimeouts bound every engine call (see EngineTimeouts).
	EngineTimeouts EngineTimeouts
	Store          snapshot.Store
	// DB is the metadata store. The manager holds each sandbox's lock while it
	// reads and writes its record, so an update of it never finds another
	// writer's version (metadata.ErrStale is an internal error here).
	DB     metadata.Store
	Images *image.Store
	// GuestDir is the host directory holding one sub-directory per guest agent
	// version (named by the binary's sha256), each mounted read-only at /.torpor.
	GuestDir string
	// AgentPath is the guest agent binary (static, linux/amd64) to install there.
	AgentPath string
	// AgentTimeout bounds the wait for the guest agent after a start or restore
	// (default 30 s).
	AgentTimeout time.Duration
	Logger       *slog.Logger
	Metrics      *Metrics
	// Lifecycle configures idle and timeout policies, volumes and hibernation
	// modes (lifecycle.go).
	Lifecycle LifecycleConfig
	// ResumeHookDeadline bounds each user hook (/etc/torpor/resume.d) of the resume
	// contract (default 10 s).
	ResumeHookDeadline time.Duration
	// ResumeAckDeadline bounds the wait for in-sandbox subscribers to acknowledge a
	// resume event (default 5 s).
	ResumeAckDeadline time.Duration
	// AsyncUpload is the default for hibernates that do not choose (see
	// HibernateOptions): commit on local disk, upload in the background. Needs
	// a snapshot.AsyncStore.
	AsyncUpload bool
	// StreamColdResumes restores a hibernated sandbox whose snapshot has no
	// copy on this host while the store fetches it, when the store can
	// (snapshot.Streamer; docs/snapshot-store.md, "Streamed cold resumes").
	StreamColdResumes bool
	// Limits bound each sandbox and admit creates, resumes and forks by the
	// host's memory (admission.go).
	Limits LimitsConfig
	// Node is the name of the node this manager is: the owner it records on
	// the sandboxes it starts or resumes (ownership.go).
	Node string
	// SingleNode: this manager is the only one using DB (SQLite): at start
	// it takes every record for its own, whatever node name it carries.
	SingleNode bool
}

// HibernateOptions are a hibernate call's choices.
type HibernateOptions struct {
	// AsyncUpload: answer once the snapshot is committed on local disk and let
	// the store upload it in the background (the snapshot reports durable false
	// until then). nil = Config.AsyncUpload.
	AsyncUpload *bool
}

// Manager owns all sandboxes of one server.
type Manager struct {
	cfg         Config
	log         *slog.Logger
	guestDigest string

	// collectAgain says the last snapshot collection left snapshots it could
	// not delete; collectAt (unix ns) is when it ran. The lifecycle loop tries
	// again collectRetry later.
	collectAgain atomic.Bool
	collectAt    atomic.Int64

	mu    sync.Mutex
	locks map[string]*sandboxLock
	live  map[string]*agentclient.Client // sandbox id -> agent client, while running
	// instEngine names the engine of each instance this process started,
	// restored or found (Reconcile), until it is stopped.
	instEngine map[string]string
	// uploads holds the cancel functions of file uploads in flight, by sandbox
	// id: dropLive ends them (an upload's body read blocks on its client, so
	// closing the agent connection alone would not).
	uploads map[string]map[*context.CancelFunc]struct{}
	lc      lifecycle   // activity tracking for the idle trigger (idle.go)
	conns   connTracker // open connections to each instance (watch.go)
	// teardowns counts the removals of checkpointed instances still running
	// after their hibernate was acknowledged (snapshotLocked); Wait waits for
	// them. exiting holds, by sandbox id, a channel closed when that sandbox's
	// removal ends (under mu); Delete waits for it.
	teardowns sync.WaitGroup
	exiting   map[string]chan struct{}
	// forks counts the forks with ForkOptions.First whose clones are still
	// starting after Fork answered; Wait waits for them.
	forks sync.WaitGroup
	// restoreGate holds a place per resume restoring now
	// (LimitsConfig.Restores; nil: no bound).
	restoreGate chan struct{}
	// strandedHib are the hibernates whose complete checkpoint waits for its
	// commit or record (stranded.go), by snapshot id; strandedLoop is set
	// while their background loop runs. Guarded by mu.
	strandedHib  map[string]*stranded
	strandedLoop bool
	// strandedMu serializes FinishStranded's passes.
	strandedMu sync.Mutex
	adm        admission // memory reserved by admitted calls (admission.go)
	pools      pools     // warm pools' ready clones (pool.go)
}

// Wait blocks until the background teardowns of hibernated sandboxes' exited
// instances (runsc delete, network namespaces, bundle; started after each
// hibernate is persisted) have ended. Server shutdown calls it so that no
// half-removed instance is left behind; a crash before they end leaves remains
// that the next start removes (Reconcile stops every instance no running
// sandbox owns). It also waits for the clones of forks that answered with
// their first clone (ForkOptions.First) to start.
func (m *Manager) Wait() {
	m.forks.Wait()
	m.teardowns.Wait()
}

type sandboxLock struct {
	ch   chan struct{}
	refs int
}

// Limits of a sandbox spec.
const (
	MinMemoryMiB     = 64
	MaxMemoryMiB     = 65536
	DefaultMemoryMiB = 512
	MinCPUs          = 0.1
	MaxCPUs          = 64
	DefaultCPUs      = 1
	MaxForkCount     = 16
	// MaxExecTimeoutS is the longest exec timeout (30 days, in seconds).
	MaxExecTimeoutS = 30 * 24 * 3600
	// MaxEnvValueBytes bounds one environment value (Linux limits one argument or
	// environment string to 128 KiB, MAX_ARG_STRLEN).
	MaxEnvValueBytes = 128 << 10
)

// New installs the guest agent and returns a Manager. Call Reconcile before
// serving requests.
func New(cfg Config) (*Manager, error) {
	if cfg.AgentTimeout == 0 {
		cfg.AgentTimeout = 30 * time.Second
	}
	if cfg.ResumeHookDeadline <= 0 {
		cfg.ResumeHookDeadline = 10 * time.Second
	}
	if cfg.ResumeAckDeadline <= 0 {
		cfg.ResumeAckDeadline = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	if cfg.Engines == nil {
		return nil, errors.New("manager: no engines")
	}
	cfg.EngineTimeouts = cfg.EngineTimeouts.withDefaults()
	var err error
	if cfg.Limits, err = cfg.Limits.withDefaults(); err != nil {
		return nil, err
	}
	m := &Manager{cfg: cfg, log: cfg.Logger, locks: map[string]*sandboxLock{}, live: map[string]*agentclient.Client{},
		instEngine: map[string]string{}}
	m.pools.kick = make(chan struct{}, 1)
	if cfg.Limits.Restores > 0 {
		m.restoreGate = make(chan struct{}, cfg.Limits.Restores)
	}
	d, err := installAgent(cfg.AgentPath, cfg.GuestDir)
	if err != nil {
		return nil, err
	}
	m.guestDigest = d
	m.watchUploads()
	return m, nil
}

// installAgent copies the agent binary to GuestDir/<sha256>/torpor-agent (once per
// version) and returns the digest. Old versions are kept: snapshots taken with them
// restore with the same binary mounted.
func installAgent(src, guestDir string) (string, error) {
	b, err := os.ReadFile(src)
	if err != nil {
		return "", fmt.Errorf("guest agent %s: %w (build it with `make build`)", src, err)
	}
	sum := sha256.Sum256(b)
	digest := hex.EncodeToString(sum[:])
	digest = guestDigest(digest) // the Python SDK (guestsdk.go) is part of the version
	dir := filepath.Join(guestDir, digest)
	dst := filepath.Join(dir, "torpor-agent")
	if _, err := os.Stat(dst); err == nil {
		return digest, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := writeGuestSDK(dir); err != nil {
		return "", err
	}
	tmp := dst + ".tmp"
	if err := os.WriteFile(tmp, b, 0o555); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return "", err
	}
	return digest, nil
}

// lock takes the sandbox's lock, waiting while another call holds it. It returns
// ctx's error if ctx ends first.
func (m *Manager) lock(ctx context.Context, id string) (func(), error) {
	m.mu.Lock()
	l := m.locks[id]
	if l == nil {
		l = &sandboxLock{ch: make(chan struct{}, 1)}
		m.locks[id] = l
	}
	l.refs++
	m.mu.Unlock()
	release := func() {
		m.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(m.locks, id)
		}
		m.mu.Unlock()
	}
	select {
	case l.ch <- struct{}{}:
		return func() { <-l.ch; release() }, nil
	case <-ctx.Done():
		release()
		return nil, ctx.Err()
	}
}

var idRE = regexp.MustCompile(`^sbx-[a-z0-9]{12}$`)

// instanceID names a sandbox's seq-th engine instance. Every instance id has the
// same length, so none is a prefix of another (runsc matches ids by prefix).
func instanceID(sandboxID string, seq int64) string { return fmt.Sprintf("%s-%08d", sandboxID, seq) }

func newID(prefix string) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 12)
	rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return prefix + string(b)
}

// get is record for a sandbox this node may act on: a *NotOwnerError when
// another node owns it.
func (m *Manager) get(ctx context.Context, id string) (*metadata.Sandbox, error) {
	s, err := m.record(ctx, id)
	if err == nil && m.foreign(s) {
		return nil, notOwner(id, s.Owner)
	}
	return s, err
}

// record reads sandbox id's record (sandbox.ErrNotFound for none, or one
// being deleted).
func (m *Manager) record(ctx context.Context, id string) (*metadata.Sandbox, error) {
	if !idRE.MatchString(id) {
		return nil, notFound("sandbox", id)
	}
	s, err := m.cfg.DB.GetSandbox(ctx, id)
	if errors.Is(err, metadata.ErrNotFound) || (err == nil && s.Deleting) {
		return nil, notFound("sandbox", id)
	}
	return s, err
}

// setState persists a state change (and whatever else changed in s).
func (m *Manager) setState(ctx context.Context, s *metadata.Sandbox, st sandbox.State) error {
	m.accrue(ctx, s, time.Now())
	s.State = st
	s.StateChangedAt = time.Now().UTC()
	if st == sandbox.StateHibernated {
		s.Owner = "" // a hibernated sandbox belongs to no node
	}
	if st != sandbox.StateError {
		s.Error = ""
	}
	// Persist even if the caller's context ended: the engine already acted.
	return m.cfg.DB.UpdateSandbox(context.WithoutCancel(ctx), s)
}

func (m *Manager) fail(ctx context.Context, s *metadata.Sandbox, cause error) {
	s.Error = cause.Error()
	s.Instance = ""
	_ = m.setState(ctx, s, sandbox.StateError)
}

// Get returns a sandbox as the API shows it.
func (m *Manager) Get(ctx context.Context, id string) (sandbox.Sandbox, error) {
	s, err := m.record(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	return m.view(ctx, s), nil
}

// List returns all sandboxes, oldest first.
func (m *Manager) List(ctx context.Context) ([]sandbox.Sandbox, error) {
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Sandbox, 0, len(all))
	for _, s := range all {
		if !s.Deleting {
			out = append(out, m.view(ctx, s))
		}
	}
	return out, nil
}

func (m *Manager) view(ctx context.Context, s *metadata.Sandbox) sandbox.Sandbox {
	v := sandbox.Sandbox{
		ID: s.ID, State: s.State, Image: s.Image, ImageDigest: s.ImageDigest,
		MemoryMiB: s.MemoryMiB, CPUs: s.CPUs, Env: s.Env, Generation: s.Generation,
		ForkedFrom: s.ForkedFrom, Node: s.Owner, Error: s.Error, CreatedAt: s.CreatedAt, PidsLimit: s.PidsLimit,
		StateChangedAt: s.StateChangedAt, LastHibernateAt: s.LastHibernateAt,
		LastResumeAt: s.LastResumeAt, ResumeMS: s.ResumeMS, LastResume: s.LastResume,
		Metadata: s.Metadata,
	}
	m.viewPolicy(ctx, s, &v)
	if s.SnapshotID != "" {
		if snap, err := m.cfg.DB.GetSnapshot(ctx, s.SnapshotID); err == nil {
			sv := m.snapView(ctx, snap, nil)
			v.Snapshot = &sv
		}
	}
	return v
}

func (m *Manager) spec(s *metadata.Sandbox, rootfs string) engine.Spec {
	return engine.Spec{
		ID:        s.Instance,
		RootFS:    rootfs,
		GuestDir:  filepath.Join(m.cfg.GuestDir, s.GuestDigest),
		MemoryMiB: s.MemoryMiB,
		CPUs:      s.CPUs,
		Env:       s.Env,
		Mounts:    m.volumeMounts(s),
		// A restore gets the limits its snapshot was taken with (engine.Spec).
		PidsLimit:       s.PidsLimit,
		AgentPidsExempt: true,
		WritableMiB:     WritableMiB(s.MemoryMiB),
		TmpMiB:          tmpMiB(s.MemoryMiB),
		ShmMiB:          shmMiB(s.MemoryMiB),
		Egress:          engineEgress(s.Network),
	}
}

func (m *Manager) agentFor(instance string) *agentclient.Client {
	return agentclient.New(func(ctx context.Context) (net.Conn, error) {
		c, err := m.engOf(instance).Dial(ctx, instance, engine.AgentPort)
		if err != nil {
			return nil, err
		}
		return m.trackConn(instance, c), nil
	})
}

// waitAgent waits for the guest agent of s's current instance and records it live.
func (m *Manager) waitAgent(ctx context.Context, s *metadata.Sandbox) error {
	c := m.agentFor(s.Instance)
	if err := c.WaitReady(ctx, m.cfg.AgentTimeout); err != nil {
		c.CloseIdleConnections()
		return fmt.Errorf("guest agent of %s did not answer: %w", s.ID, err)
	}
	m.log.Debug("guest agent ready", "sandbox", s.ID, "instance", s.Instance,
		"protocol_version", c.ProtocolVersion(), "agent", c.AgentBuild())
	m.mu.Lock()
	m.live[s.ID] = c
	m.mu.Unlock()
	m.watch(s.ID, s.Instance)
	return nil
}

// runContract hands the guest agent of s's (just started or restored) instance its
// new generation, the host's time and whether it is a clone, and returns the
// agent's report of the resume contract (see package guest/agent). The caller holds
// s's lock and has not yet marked s running, so no user request reaches the sandbox
// before the agent notified its processes. launched is when the engine's start or
// restore returned: the report's window_ms is the time from then until the agent's
// notify step completed. A failed call is reported (ok=false, error) but does not
// fail the resume.
func (m *Manager) runContract(ctx context.Context, s *metadata.Sandbox, gen int64, forked, start bool, snapshotID string, launched time.Time) *sandbox.ResumeReport {
	return m.contract(ctx, s, contractCall{gen: gen, forked: forked, start: start, snapshotID: snapshotID}, launched)
}

// contractCall is what runContract hands the guest agent: the generation,
// whether the instance is a clone, a first start, or an unpause (the same
// instance continued from the paused tier), and the snapshot restored.
type contractCall struct {
	gen                     int64
	forked, start, unpaused bool
	snapshotID              string
}

func (m *Manager) contract(ctx context.Context, s *metadata.Sandbox, cc contractCall, launched time.Time) *sandbox.ResumeReport {
	gen, forked, start, snapshotID := cc.gen, cc.forked, cc.start, cc.snapshotID
	ev := "resume"
	switch {
	case start:
		ev = "start"
	case cc.unpaused:
		ev = "unpaused"
	}
	c := m.liveClient(s.ID)
	if c == nil {
		return &sandbox.ResumeReport{Event: ev, Generation: gen, Forked: forked, SnapshotID: snapshotID,
			Error: "no guest agent connection"}
	}
	// Generous: the agent bounds each hook and the ack wait itself.
	timeout := m.cfg.ResumeAckDeadline + 20*m.cfg.ResumeHookDeadline + 30*time.Second
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t0 := time.Now()
	rep, err := guestResume(cctx, c, cc.req(), m.cfg.ResumeHookDeadline, m.cfg.ResumeAckDeadline)
	if err == nil && cc.unpaused {
		rep.Event = ev // an agent older than the unpaused event reports "resume"
	}
	agentDur := time.Since(t0)
	end := time.Since(launched)
	if err != nil {
		rep = sandbox.ResumeReport{Event: ev, Generation: gen, Forked: forked, SnapshotID: snapshotID,
			Error: "resume contract: " + err.Error()}
	} else {
		// The hooks run after the notify step; they are not part of the window.
		for _, st := range rep.Steps {
			if st.Name == "hooks" {
				end -= time.Duration(st.MS * float64(time.Millisecond))
			}
		}
	}
	rep.OK = rep.OK && err == nil
	rep.WindowMS = float64(end.Microseconds()) / 1000
	rep.AgentMS = float64(agentDur.Microseconds()) / 1000
	lvl := slog.LevelInfo
	if !rep.OK {
		lvl = slog.LevelWarn
	}
	m.log.Log(ctx, lvl, "resume contract", "sandbox", s.ID, "event", ev, "generation", gen, "forked", forked,
		"ok", rep.OK, "window_ms", rep.WindowMS, "agent_ms", rep.AgentMS, "skew_ms", rep.Clock.SkewMS,
		"subscribers", rep.Subscribers.Total, "acked", rep.Subscribers.Acked, "hooks", len(rep.Hooks), "err", rep.Error)
	return &rep
}

func (m *Manager) dropLive(id string) {
	m.mu.Lock()
	if c := m.live[id]; c != nil {
		c.CloseIdleConnections()
		delete(m.live, id)
	}
	for cancel := range m.uploads[id] {
		(*cancel)()
	}
	delete(m.uploads, id)
	m.mu.Unlock()
}

// trackUpload records an upload to sandbox id for dropLive to cancel; the
// returned function forgets it.
func (m *Manager) trackUpload(id string, cancel context.CancelFunc) func() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.uploads == nil {
		m.uploads = map[string]map[*context.CancelFunc]struct{}{}
	}
	if m.uploads[id] == nil {
		m.uploads[id] = map[*context.CancelFunc]struct{}{}
	}
	key := &cancel
	m.uploads[id][key] = struct{}{}
	return func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		delete(m.uploads[id], key)
	}
}

// Create validates req, persists a sandbox in state creating, starts it and waits
// for its guest agent. Errors: sandbox.ErrInvalidArgument for a bad spec or unknown image.
// If the engine fails the sandbox is left in state error and the error returned.
func (m *Manager) Create(ctx context.Context, req sandbox.Spec) (sandbox.Sandbox, error) {
	if req.Image == "" {
		req.Image = "base"
	}
	if req.MemoryMiB == 0 {
		req.MemoryMiB = DefaultMemoryMiB
	}
	if req.CPUs == 0 {
		req.CPUs = DefaultCPUs
	}
	if req.MemoryMiB < MinMemoryMiB || req.MemoryMiB > MaxMemoryMiB {
		return sandbox.Sandbox{}, invalid("memory_mib %d: must be between %d and %d", req.MemoryMiB, MinMemoryMiB, MaxMemoryMiB)
	}
	if req.CPUs < MinCPUs || req.CPUs > MaxCPUs {
		return sandbox.Sandbox{}, invalid("cpus %g: must be between %g and %d", req.CPUs, MinCPUs, MaxCPUs)
	}
	if err := checkEnv(req.Env); err != nil {
		return sandbox.Sandbox{}, err
	}
	if err := checkMetadata(req.Metadata); err != nil {
		return sandbox.Sandbox{}, err
	}
	pids, err := m.pidsLimit(req.PidsLimit, req.MemoryMiB)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	id, err := m.newSandboxID(ctx, req.ID)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	pol, err := m.createPolicy(ctx, req)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	var img sandbox.Image
	var path string
	if image.IsBuiltin(req.Image) {
		// A built-in image (base, e2b-base) is built on first use.
		if _, err = m.cfg.Images.EnsureBuiltin(ctx, req.Image, io.Discard); err != nil {
			return sandbox.Sandbox{}, fmt.Errorf("image %s: %w", req.Image, err)
		}
	}
	img, path, err = m.cfg.Images.Get(ctx, req.Image)
	if errors.Is(err, image.ErrNotFound) {
		return sandbox.Sandbox{}, invalid("image %q: not found", req.Image).WithHint("build or import it, or use one of the images the server lists")
	}
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	now := time.Now().UTC()
	s := &metadata.Sandbox{
		ID: id, State: sandbox.StateCreating, Image: req.Image, ImageDigest: img.Digest,
		GuestDigest: m.guestDigest, MemoryMiB: req.MemoryMiB, CPUs: req.CPUs, Env: req.Env,
		Metadata: req.Metadata, CreatedAt: now, StateChangedAt: now, PidsLimit: pids, Owner: m.cfg.Node,
	}
	s.Policy = pol
	unlock, err := m.lock(ctx, s.ID)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	defer unlock()
	// A warm pool's ready clone of the image, if one has this spec (pool.go).
	if sb, ok, err := m.createPooled(ctx, s); ok {
		return sb, err
	}
	release, err := m.admit(ctx, "create", "", s.MemoryMiB, s.ID)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	defer release()
	if s.Generation, err = m.cfg.DB.NextGeneration(ctx); err != nil {
		return sandbox.Sandbox{}, err
	}
	s.Seq = 1
	s.Instance = instanceID(s.ID, s.Seq)
	if err := m.cfg.DB.CreateSandbox(ctx, s); err != nil {
		return sandbox.Sandbox{}, err
	}
	FaultPoint("create-recorded")
	ctx = context.WithoutCancel(ctx) // the engine's work must finish or be undone
	eng := m.on(m.cfg.Engines.Default(), s)
	if err := eng.Start(ctx, m.spec(s, path)); err != nil {
		_ = eng.Stop(ctx, s.Instance)
		m.fail(ctx, s, err)
		return m.view(ctx, s), err
	}
	launched := time.Now()
	if err := m.waitAgent(ctx, s); err != nil {
		_ = eng.Stop(ctx, s.Instance)
		m.fail(ctx, s, err)
		return m.view(ctx, s), err
	}
	m.writeResolvConf(ctx, s)
	s.LastResume = m.runContract(ctx, s, s.Generation, false, true, "", launched)
	if err := m.setState(ctx, s, sandbox.StateRunning); err != nil {
		return sandbox.Sandbox{}, err
	}
	m.cfg.Metrics.created.Inc()
	return m.view(ctx, s), nil
}

var envKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Delete stops the sandbox (if it runs), removes its snapshots that nothing else
// uses and its record. Deleting an unknown id returns sandbox.ErrNotFound.
//
// A sandbox no node owns (hibernated, or in state error off a lost node)
// can be deleted through any node, so deletes through several nodes race
// on its record: the one whose mark (Deleting) is written deletes it; the
// others read it again and are answered as for that record (sandbox.ErrNotFound
// once it is marked or gone, a *NotOwnerError when a node resumed it
// meanwhile, which the server forwards there), up to staleRetries times,
// then a sandbox.ErrConflict saying to retry.
func (m *Manager) Delete(ctx context.Context, id string) error {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	return m.retryStale(ctx, id, func() error {
		s, err := m.get(ctx, id)
		if err != nil {
			return err
		}
		return m.deleteLocked(context.WithoutCancel(ctx), s)
	})
}

// staleRetries bounds how often a call on a sandbox that another node
// changed since it was read (metadata.ErrStale: a delete, a resume or a
// recovery of a sandbox no node owns, through two nodes at once) reads it
// again and decides again.
const staleRetries = 3

// retryStale runs f, which reads sandbox id's record and acts on it, again
// while it fails with metadata.ErrStale (nothing was written), up to
// staleRetries times in all; a record changed under every try is a
// sandbox.ErrConflict saying to retry (never the database's bare error).
// metadata.ErrNotFound (the record went meanwhile) is sandbox.ErrNotFound;
// metadata.ErrFenced of a write to a sandbox that another node claimed
// meanwhile (a write of a record no node owned: its token changed) is a
// *NotOwnerError naming that node.
func (m *Manager) retryStale(ctx context.Context, id string, f func() error) error {
	var err error
	for range staleRetries {
		err = f()
		if !errors.Is(err, metadata.ErrStale) {
			break
		}
	}
	if errors.Is(err, metadata.ErrFenced) {
		if cur, gerr := m.cfg.DB.GetSandbox(context.WithoutCancel(ctx), id); gerr == nil && m.foreign(cur) {
			return notOwner(id, cur.Owner)
		}
	}
	switch {
	case errors.Is(err, metadata.ErrStale):
		return sandboxConflict(id, "sandbox %s was changed on another node under each of %d tries: retry", id, staleRetries)
	case errors.Is(err, metadata.ErrNotFound):
		return notFound("sandbox", id)
	}
	return err
}

func (m *Manager) deleteLocked(ctx context.Context, s *metadata.Sandbox) error {
	s.Deleting = true
	if err := m.cfg.DB.UpdateSandbox(ctx, s); err != nil {
		return err
	}
	m.dropLive(s.ID)
	if s.Instance != "" {
		if err := m.eng(s).Stop(ctx, s.Instance); err != nil {
			return fmt.Errorf("delete %s: %w", s.ID, err)
		}
	}
	// A hibernate's instance may still be being removed (snapshotLocked): the
	// answer to a delete means nothing of the sandbox is left.
	m.mu.Lock()
	done := m.exiting[s.ID]
	m.mu.Unlock()
	if done != nil {
		select {
		case <-done:
		case <-ctx.Done():
			return fmt.Errorf("delete %s: %w", s.ID, ctx.Err())
		}
	}
	if err := m.cfg.DB.DeleteSandbox(ctx, s.ID); err != nil && !errors.Is(err, metadata.ErrNotFound) {
		return err
	}
	m.collectSnapshots(ctx)
	return nil
}

// collectSnapshots deletes snapshots that no sandbox resumes from any more.
func (m *Manager) collectSnapshots(ctx context.Context) {
	m.collectAt.Store(time.Now().UnixNano())
	ids, err := m.cfg.DB.UnreferencedSnapshots(ctx)
	if err != nil {
		m.log.Warn("snapshot collection", "err", err)
		m.collectAgain.Store(true)
		return
	}
	failed := false
	for _, id := range ids {
		if err := m.cfg.Store.Delete(ctx, id); err != nil {
			m.log.Warn("delete snapshot", "snapshot", id, "err", err)
			failed = true
			continue
		}
		_ = m.cfg.DB.DeleteSnapshot(ctx, id)
	}
	m.collectAgain.Store(failed)
}

// collectRetryTicks is how many lifecycle checks (1 s each by default) pass
// before the loop tries again to delete snapshots whose deletion failed (their
// store's backend unreachable).
const collectRetryTicks = 30

// Hibernate captures a running sandbox into a new snapshot and releases its
// compute. It returns once the snapshot is committed and the state hibernated is
// persisted. A hibernated sandbox is returned as it is. Errors: sandbox.ErrNotFound;
// sandbox.ErrConflict for a sandbox in state creating or error.
func (m *Manager) Hibernate(ctx context.Context, id string, opts HibernateOptions) (sandbox.Sandbox, error) {
	sb, _, err := m.HibernateCall(ctx, id, opts)
	return sb, err
}

// HibernateCall is Hibernate that also reports unchanged: true when the
// sandbox was already hibernated (decided under its lock, so of two
// concurrent calls exactly one hibernates).
func (m *Manager) HibernateCall(ctx context.Context, id string, opts HibernateOptions) (sb sandbox.Sandbox, unchanged bool, err error) {
	async := m.cfg.AsyncUpload
	if opts.AsyncUpload != nil {
		async = *opts.AsyncUpload
	}
	if _, ok := m.cfg.Store.(snapshot.AsyncStore); async && !ok {
		return sandbox.Sandbox{}, false, invalid("async_upload: this server's snapshot store commits synchronously only").
			WithHint("an asynchronous upload needs the server started with the chunked or the s3 snapshot store")
	}
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	defer unlock()
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	switch s.State {
	case sandbox.StateHibernated:
		return m.view(ctx, s), true, nil
	case sandbox.StatePaused:
		// Its snapshot is committed: hibernating is freeing its memory.
		if err := m.demoteLocked(context.WithoutCancel(ctx), s, "call"); err != nil {
			return m.view(ctx, s), false, err
		}
		return m.view(ctx, s), false, nil
	case sandbox.StateRunning:
	default:
		return sandbox.Sandbox{}, false, sandboxConflict(id, "sandbox %s is in state %s; only a running sandbox can be hibernated", id, s.State)
	}
	ctx = context.WithoutCancel(ctx)
	if err := m.hibernateLocked(ctx, s, async); err != nil {
		return m.view(ctx, s), false, err
	}
	return m.view(ctx, s), false, nil
}

// snapshotLocked checkpoints s's instance into a new committed snapshot. Without
// leaveRunning the sandbox ends hibernated; with it the sandbox keeps running (a
// fork source). The caller holds s's lock.
func (m *Manager) snapshotLocked(ctx context.Context, s *metadata.Sandbox, leaveRunning, async bool) (string, error) {
	return m.snapshotThen(ctx, s, leaveRunning, async, nil)
}

// snapshotThen is snapshotLocked that, when checkpointed is set, calls it
// with the staged checkpoint's directory once the checkpoint is complete,
// before the store commits it (a fork restores its clones from it meanwhile:
// forkearly.go). The directory is the store's: checkpointed must not change
// it, and it is gone or renamed once the commit ends.
func (m *Manager) snapshotThen(ctx context.Context, s *metadata.Sandbox, leaveRunning, async bool, checkpointed func(dir string)) (string, error) {
	start := time.Now()
	snapID := newID("snap-")
	m.accrue(ctx, s, start)
	prevState := s.State
	s.PendingSnapshot = snapID
	if !leaveRunning {
		s.State = sandbox.StateHibernating
	}
	s.StateChangedAt = time.Now().UTC()
	if err := m.cfg.DB.UpdateSandbox(ctx, s); err != nil {
		return "", err
	}
	undo := func(cause error) (string, error) {
		_ = m.cfg.Store.Abort(ctx, snapID)
		s.PendingSnapshot = ""
		if leaveRunning {
			_ = m.cfg.DB.UpdateSandbox(ctx, s)
			return "", cause
		}
		// The engine stops the instance only after a complete checkpoint; if it
		// still answers (asked anew: the hibernate dropped the agent's
		// connections), the sandbox still runs. An instance still saving (a
		// checkpoint past its deadline) does not answer and is stopped.
		c := m.liveClient(s.ID)
		if c == nil {
			c = m.agentFor(s.Instance)
		}
		hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		alive := c.Health(hctx) == nil
		cancel()
		if alive {
			m.mu.Lock()
			m.live[s.ID] = c // its watch still follows the instance
			m.mu.Unlock()
			_ = m.setState(ctx, s, prevState)
		} else {
			c.CloseIdleConnections()
			m.dropLive(s.ID)
			_ = m.eng(s).Stop(ctx, s.Instance)
			m.fail(ctx, s, cause)
		}
		return "", cause
	}
	op := "hibernate"
	if leaveRunning {
		op = "snapshot"
	}
	dir, err := m.cfg.Store.Stage(ctx, snapID)
	if err != nil {
		return undo(diskFull(op, s.ID, err))
	}
	if err := m.snapshotRoom(op, s, dir); err != nil {
		return undo(err)
	}
	keepNote := false
	if !leaveRunning {
		m.writeNote(s, snapID) // until the hibernate is recorded (stranded.go)
		defer func() {
			if !keepNote {
				m.dropNote(snapID)
			}
		}()
	}
	if !leaveRunning {
		m.endEnvdStreams(ctx, s.ID)
		if conns, execs := m.drain(s.ID, HibernateDrain); conns+execs > 0 {
			m.log.Warn("hibernate: cutting requests still in flight after the drain", "sandbox", s.ID,
				"proxied_connections", conns, "exec_streams", execs, "drain_s", HibernateDrain.Seconds())
		}
		m.dropLive(s.ID) // connections to the agent do not survive a checkpoint
	}
	tCheckpoint := time.Now()
	// An engine that can hand back the image before tearing the exited instance
	// down (engine.ExitCheckpointer) has it removed once the hibernate is
	// persisted, in the background: the teardown (runsc delete, the network
	// namespaces; p50 31 ms, p90 54 ms over 162 hibernates of bench.BenchmarkStore) then neither competes with the commit
	// for the CPU nor holds the answer. The instance runs no guest code after
	// the checkpoint; a crash before its removal ends leaves remains that
	// Reconcile removes.
	exited := ""
	eng := m.eng(s)
	if leaveRunning {
		err = eng.Checkpoint(ctx, s.Instance, dir, true)
	} else if ok, xerr := eng.checkpointExit(ctx, s.Instance, dir); ok {
		err = xerr
		if err == nil {
			exited = s.Instance
		}
	} else if err = eng.Checkpoint(ctx, s.Instance, dir, false); err == nil {
		m.forgetInstance(s.Instance) // the engine removed it
	}
	if err != nil {
		return undo(diskFull("", s.ID, fmt.Errorf("hibernate %s: %w", s.ID, err)))
	}
	FaultPoint("hibernate-checkpointed")
	if checkpointed != nil {
		checkpointed(dir)
	}
	now := time.Now().UTC()
	checkpointDur := now.Sub(tCheckpoint)
	man := m.manifestFor(s, eng, snapID, now)
	man.HibernateMS = time.Since(start).Milliseconds()
	man, err = m.commitSnapshot(ctx, snapID, man, async)
	commitDur := time.Since(now)
	if exited != "" {
		if err != nil {
			m.removeExited(ctx, s.ID, exited) // before the failure is recorded
		} else {
			done := make(chan struct{})
			m.mu.Lock()
			if m.exiting == nil {
				m.exiting = map[string]chan struct{}{}
			}
			prev := m.exiting[s.ID] // an earlier hibernate's, still running
			m.exiting[s.ID] = done
			m.mu.Unlock()
			m.teardowns.Add(1)
			go func(ctx context.Context, id string) {
				defer m.teardowns.Done()
				m.removeExited(ctx, id, exited)
				if prev != nil {
					<-prev // done means every earlier removal has ended too
				}
				m.mu.Lock()
				if m.exiting[id] == done {
					delete(m.exiting, id)
				}
				m.mu.Unlock()
				close(done)
			}(context.WithoutCancel(ctx), s.ID)
		}
	}
	if err != nil {
		if leaveRunning {
			return undo(diskFull("", s.ID, fmt.Errorf("hibernate %s: commit: %w", s.ID, err)))
		}
		if errors.Is(err, snapshot.ErrLockUnavailable) || errors.Is(err, snapshot.ErrUnavailable) {
			// The instance is gone; its memory is in the staged checkpoint,
			// which is kept and committed once the database (or the store)
			// answers again.
			keepNote = true
			return "", m.strand(s, snapID, man, async, start, now, fmt.Errorf("commit: %w", err))
		}
		// The instance is gone and its snapshot did not commit: the memory is lost.
		_ = m.cfg.Store.Abort(ctx, snapID)
		s.PendingSnapshot = ""
		m.fail(ctx, s, fmt.Errorf("hibernate %s: commit: %w", s.ID, err))
		return "", err
	}
	snapRec, err := m.recordSnapshot(ctx, s, man, start, now, leaveRunning)
	if err != nil && !leaveRunning && !errors.Is(err, metadata.ErrFenced) {
		// Committed, but the database did not take the record: it is
		// recorded in the background.
		keepNote = true
		st := m.strand(s, snapID, man, async, start, now, fmt.Errorf("record: %w", err))
		m.markStrandedCommitted(snapID)
		return "", st
	}
	if err != nil {
		return "", err
	}
	m.log.Info("snapshot committed", "sandbox", s.ID, "snapshot", snapID, "total_ms", time.Since(start).Milliseconds(),
		"checkpoint_ms", checkpointDur.Milliseconds(), "commit_ms", commitDur.Milliseconds(),
		"bytes", man.Bytes, "new_bytes", snapRec.NewBytes, "leave_running", leaveRunning)
	if !leaveRunning {
		FaultPoint("hibernate-recorded")
	}
	return snapID, nil
}

// recordSnapshot ends a hibernate (or, with leaveRunning, a fork source's
// snapshot) whose snapshot man the store has committed: it accrues the
// sandbox's usage, makes man the snapshot the sandbox resumes from, and writes
// the snapshot's record and the sandbox's in one transaction
// (metadata.CommitHibernate); without leaveRunning the sandbox is then
// hibernated. start is when the hibernate began (its duration is recorded in
// ms) and now its commit time. Afterwards it observes the hibernate metrics and
// collects snapshots no longer needed. Errors are the database's; nothing but
// the in-memory record s has changed then.
func (m *Manager) recordSnapshot(ctx context.Context, s *metadata.Sandbox, man snapshot.Manifest, start, now time.Time, leaveRunning bool) (*metadata.Snapshot, error) {
	elapsed := time.Since(start)
	m.accrue(ctx, s, time.Now())
	s.SnapshotID = man.ID
	s.SnapshotNode = m.cfg.Node
	s.PendingSnapshot = ""
	if !leaveRunning {
		s.State = sandbox.StateHibernated
		s.Owner = ""
		s.Instance = ""
		s.LastHibernateAt = &now
	}
	s.StateChangedAt = now
	rec := m.snapshotRecord(ctx, man, s, elapsed.Milliseconds(), now)
	if err := m.cfg.DB.CommitHibernate(ctx, rec, s); err != nil {
		return rec, err
	}
	m.cfg.Metrics.hibernate.Observe(elapsed.Seconds())
	m.cfg.Metrics.snapshotBytes.Add(float64(man.Bytes))
	m.collectSnapshots(ctx)
	return rec, nil
}

// removeExited removes instance inst of sandbox sandboxID after its
// checkpoint (engine.ExitCheckpointer). A failed removal does not undo the
// hibernate (the snapshot is complete and the instance runs no guest code); it
// is tried once more and, if it fails again, logged, and the next server start
// removes the remains (Reconcile).
func (m *Manager) removeExited(ctx context.Context, sandboxID, inst string) {
	start := time.Now()
	eng := m.engOf(inst)
	if err := eng.Stop(ctx, inst); err == nil {
		m.log.Debug("hibernate: checkpointed instance removed", "sandbox", sandboxID, "instance", inst,
			"ms", time.Since(start).Milliseconds())
		return
	}
	if err := eng.Stop(ctx, inst); err != nil {
		m.log.Error("hibernate: removing the checkpointed instance failed", "sandbox", sandboxID, "instance", inst, "err", err)
	}
}

// commitSnapshot commits a staged snapshot: synchronously, or with async (and
// an AsyncStore) on local disk with the upload left to the store.
//
// A synchronous commit that fails on such a store (its durable tier is
// unreachable) falls back to an asynchronous one: the engine has already
// stopped the instance, so failing would lose the sandbox's memory. The
// snapshot then reports durable false until the background upload succeeds.
func (m *Manager) commitSnapshot(ctx context.Context, snapID string, man snapshot.Manifest, async bool) (snapshot.Manifest, error) {
	as, ok := m.cfg.Store.(snapshot.AsyncStore)
	if ok && async {
		return as.CommitAsync(ctx, snapID, man)
	}
	out, err := m.cfg.Store.Commit(ctx, snapID, man)
	if err == nil || !ok || ctx.Err() != nil || errors.Is(err, snapshot.ErrLockUnavailable) {
		return out, err // an asynchronous commit needs the collection lock too
	}
	m.log.Warn("synchronous snapshot commit failed; keeping it on local disk for a background upload",
		"snapshot", snapID, "err", err)
	return as.CommitAsync(ctx, snapID, man)
}

// openSnapshot opens snapshot id for a restore (Store.Open: verified). The
// caller calls done once the restores from dir have returned (or it gave up
// before them): a store that encrypts then removes the plain files
// (snapshot.Releaser); done is never nil. A snapshot that fails
// verification, or that the database records but the store no longer has, is
// sandbox.ErrSnapshotCorrupt (422) naming it — unless its record says it
// waits in another node's upload outbox: then it is Unavailable (503,
// Retry-After) with an *UploadPendingError. Errors start with what
// ("resume sbx-…").
func (m *Manager) openSnapshot(ctx context.Context, id, op, sandboxID string) (dir string, man snapshot.Manifest, done func(), err error) {
	done = func() {}
	dir, man, err = m.cfg.Store.Open(ctx, id)
	if err != nil {
		return "", man, done, m.openError(ctx, err, id, op, sandboxID)
	}
	if r, ok := m.cfg.Store.(snapshot.Releaser); ok {
		done = sync.OnceFunc(func() { r.Release(id) })
	}
	return dir, man, done, nil
}

// openForResume is openSnapshot for a resume, which with
// Config.StreamColdResumes and a store that streams (snapshot.Streamer)
// restores a snapshot with no copy on this host while it is fetched.
// resumed, never nil, is to be called once the resumed sandbox answered
// (the store records the working set then).
func (m *Manager) openForResume(ctx context.Context, id, sandboxID string) (dir string, man snapshot.Manifest, done, resumed func(), err error) {
	st, ok := m.cfg.Store.(snapshot.Streamer)
	if !ok || !m.cfg.StreamColdResumes {
		dir, man, done, err = m.openSnapshot(ctx, id, "resume", sandboxID)
		return dir, man, done, func() {}, err
	}
	o, err := st.OpenStream(ctx, id)
	if err != nil {
		return "", o.Manifest, func() {}, func() {}, m.openError(ctx, err, id, "resume", sandboxID)
	}
	return o.Dir, o.Manifest, sync.OnceFunc(o.Release), o.Resumed, nil
}

// openError maps a store's failure to open snapshot id for op of sandboxID
// to the manager's errors (openSnapshot).
func (m *Manager) openError(ctx context.Context, err error, id, op, sandboxID string) error {
	var ce *snapshot.CorruptError
	switch {
	case errors.As(err, &ce):
		return corrupt(op, sandboxID, err)
	case errors.Is(err, snapshot.ErrNotFound), errors.Is(err, snapshot.ErrUnavailable):
		// A snapshot still in another node's outbox is not in the bucket,
		// reachable or not: that is the answer (with S3 down too).
		if perr := m.uploadPending(ctx, id, op, sandboxID); perr != nil {
			return perr // on its way to the bucket from another node's outbox
		}
		if errors.Is(err, snapshot.ErrUnavailable) {
			return fmt.Errorf("%s %s: %w", op, sandboxID, err)
		}
		return corrupt(op, sandboxID, fmt.Errorf("snapshot %s is recorded but missing from the store: %v", id, err))
	case errors.As(err, new(*snapshot.KeyError)):
		return wrongKey(op, sandboxID, err)
	}
	return fmt.Errorf("%s %s: %w", op, sandboxID, err)
}

// manifestFor is the manifest of a memory snapshot snapID of s written by
// engine eng, before the store fills in its files.
func (m *Manager) manifestFor(s *metadata.Sandbox, eng engine.Engine, snapID string, at time.Time) snapshot.Manifest {
	return snapshot.Manifest{
		ID: snapID, SandboxID: s.ID, Parent: s.SnapshotID,
		Engine: eng.Name(), EngineVersion: eng.Version(),
		Spec: snapshot.SandboxSpec{Image: s.Image, ImageDigest: s.ImageDigest, MemoryMiB: s.MemoryMiB,
			CPUs: s.CPUs, Env: s.Env, GuestDigest: s.GuestDigest},
		CreatedAt: at,
	}
}

func (m *Manager) liveClient(id string) *agentclient.Client {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.live[id]
}

// Resume restores a hibernated sandbox from its snapshot and waits for its guest
// agent; a paused one is unpaused (pause.go). A running sandbox is returned as it is. Errors: sandbox.ErrNotFound;
// sandbox.ErrConflict for a sandbox in state creating or error; sandbox.ErrSnapshotCorrupt (with
// the snapshot and file named) when verification fails, in which case the sandbox
// stays hibernated.
func (m *Manager) Resume(ctx context.Context, id string) (sandbox.Sandbox, error) {
	sb, _, err := m.ResumeCall(ctx, id)
	return sb, err
}

// ResumeCall is Resume that also reports unchanged: true when the sandbox was
// already running (decided under its lock, so of two concurrent calls exactly
// one resumes).
func (m *Manager) ResumeCall(ctx context.Context, id string) (sb sandbox.Sandbox, unchanged bool, err error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	defer unlock()
	// A sandbox in state error no node owns may be recovered through two
	// nodes at once: the one whose write lands recovers it, the other reads
	// it again (now hibernated, or resuming on that node: told whose it is).
	err = m.retryStale(ctx, id, func() (err error) {
		sb, unchanged, err = m.resumeCallLocked(ctx, id)
		return err
	})
	return sb, unchanged, err
}

// resumeCallLocked is ResumeCall under the sandbox's lock.
func (m *Manager) resumeCallLocked(ctx context.Context, id string) (sb sandbox.Sandbox, unchanged bool, err error) {
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, false, err
	}
	unchanged = s.State == sandbox.StateRunning
	ctx = context.WithoutCancel(ctx)
	if s.State == sandbox.StateError {
		// An explicit resume recovers a sandbox whose instance died (OOM kill,
		// host kill) from its last snapshot; what it did since is lost, which
		// the caller asked for. Calls that wake a sandbox by themselves (exec,
		// files, the proxy) never do this.
		if s.SnapshotID == "" {
			return m.view(ctx, s), false, sandboxConflict(s.ID, "sandbox %s is in state error (%s) and has no snapshot to resume from; delete it", s.ID, s.Error)
		}
		cause := s.Error
		m.log.Warn("resume: recovering a sandbox in state error from its last snapshot", "sandbox", s.ID, "snapshot", s.SnapshotID, "error_was", cause)
		s.Error = ""
		if err := m.setState(ctx, s, sandbox.StateHibernated); err != nil {
			return m.view(ctx, s), false, err
		}
		if err := m.resumeLocked(ctx, s); err != nil {
			m.fail(ctx, s, fmt.Errorf("%s; recovering from snapshot %s failed: %v", cause, s.SnapshotID, err))
			return m.view(ctx, s), false, err
		}
		return m.view(ctx, s), false, nil
	}
	if err := m.resumeLocked(ctx, s); err != nil {
		return m.view(ctx, s), false, err
	}
	return m.view(ctx, s), unchanged, nil
}

func (m *Manager) resumeLocked(ctx context.Context, s *metadata.Sandbox) error {
	switch s.State {
	case sandbox.StateRunning:
		return nil
	case sandbox.StatePaused:
		return m.unpauseLocked(ctx, s)
	case sandbox.StateHibernated:
	default:
		return sandboxConflict(s.ID, "sandbox %s is in state %s; only a hibernated sandbox can be resumed", s.ID, s.State)
	}
	release, err := m.admit(ctx, "resume", s.ID, s.MemoryMiB, s.ID)
	if err != nil {
		return err
	}
	defer release()
	// The lease first: of nodes resuming it at once one claims it, the
	// others are told whose it is; the back path releases it.
	if err := m.claim(ctx, s); err != nil {
		return err
	}
	err = m.resumeClaimed(ctx, s)
	if err != nil && s.State == sandbox.StateHibernated && s.Owner == m.cfg.Node {
		// Failed before it changed anything else (a snapshot that does not
		// verify): the lease goes.
		s.Owner = ""
		_ = m.cfg.DB.UpdateSandbox(context.WithoutCancel(ctx), s)
	}
	return err
}

// resumeClaimed resumes hibernated s, which this node has claimed.
func (m *Manager) resumeClaimed(ctx context.Context, s *metadata.Sandbox) error {
	if m.isFilesystemSnapshot(ctx, s.SnapshotID) {
		return m.resumeFilesystemLocked(ctx, s)
	}
	start := time.Now()
	back := func(cause error) error {
		s.Instance = ""
		s.Error = ""
		_ = m.setState(ctx, s, sandbox.StateHibernated)
		s.Error = cause.Error()
		return cause
	}
	// Verify first: a snapshot that fails verification changes nothing (the
	// sandbox stays hibernated, no generation is taken). Other calls on this
	// sandbox wait on its lock meanwhile.
	tVerify := time.Now()
	dir, man, done, resumed, err := m.openForResume(ctx, s.SnapshotID, s.ID)
	if err != nil {
		return err
	}
	defer done()
	verifyDur := time.Since(tVerify)
	e, err := m.restoreEngine(s.SnapshotID, man)
	if err != nil {
		return err
	}
	rootfs, err := m.snapshotImage(ctx, s.Image, man.Spec.ImageDigest)
	if err != nil {
		return fmt.Errorf("resume %s: image %s: %w", s.ID, man.Spec.ImageDigest, err)
	}
	// The restore and the guest's start are CPU-bound: they wait for their
	// turn (LimitsConfig.Restores), the sandbox still hibernated.
	leave, err := m.restoreTurn(ctx)
	if err != nil {
		return err
	}
	leave = sync.OnceFunc(leave)
	defer leave()
	// State resuming, the new instance and a new generation: one transaction,
	// persisted before the engine acts.
	s.Seq++
	s.Instance = instanceID(s.ID, s.Seq)
	s.GuestDigest = man.Spec.GuestDigest
	s.State = sandbox.StateResuming
	s.StateChangedAt = time.Now().UTC()
	s.Error = ""
	gen, err := m.cfg.DB.BeginRestore(ctx, s)
	if err != nil {
		return back(err)
	}
	tRestore := time.Now()
	eng := m.on(e, s)
	FaultPoint("resume-restoring")
	if err := eng.Restore(ctx, m.spec(s, rootfs), dir); err != nil {
		_ = eng.Stop(ctx, s.Instance)
		return back(fmt.Errorf("resume %s: %w", s.ID, err))
	}
	done() // the restored instance reads the files it opened
	restoreDur := time.Since(tRestore)
	tAgent := time.Now()
	if err := m.waitAgent(ctx, s); err != nil {
		_ = eng.Stop(ctx, s.Instance)
		return back(fmt.Errorf("resume %s: %w", s.ID, err))
	}
	agentDur := time.Since(tAgent)
	leave() // the contract waits on the guest's hooks, not on the host's CPU
	s.LastResume = m.runContract(ctx, s, gen, m.restoresClone(ctx, s), false, s.SnapshotID, tAgent)
	resumed() // what the restore read until now is the working set
	m.log.Info("resumed", "sandbox", s.ID, "total_ms", time.Since(start).Milliseconds(),
		"verify_ms", verifyDur.Milliseconds(), "restore_ms", restoreDur.Milliseconds(),
		"agent_ms", agentDur.Milliseconds(), "window_ms", s.LastResume.WindowMS)
	now := time.Now().UTC()
	s.Generation = gen
	s.LastResumeAt = &now
	s.ResumeMS = time.Since(start).Milliseconds()
	if err := m.setState(ctx, s, sandbox.StateRunning); err != nil {
		return err
	}
	m.cfg.Metrics.resume.Observe(time.Since(start).Seconds())
	return nil
}

// restoresClone reports whether resuming s restores another sandbox's
// snapshot, so the guest must be told it is a fork (secrets wiped, intents set
// aside; the resume contract): true when s's snapshot was taken of another
// sandbox — a fork clone whose creation a server crash interrupted, or one lost
// while running before it ever hibernated, both resumed from the source's
// snapshot (a new-user trial found such a clone told forked:false, keeping the
// source's fork-unsafe secrets). When the snapshot's record cannot be read it
// answers whether s is a clone at all, erring toward telling the guest.
func (m *Manager) restoresClone(ctx context.Context, s *metadata.Sandbox) bool {
	rec, err := m.cfg.DB.GetSnapshot(ctx, s.SnapshotID)
	if err != nil || rec == nil {
		return s.ForkedFrom != ""
	}
	return rec.SandboxID != s.ID
}

// Fork makes count clones from the sandbox's snapshot. A running source is first
// checkpointed in place (it keeps running); a hibernated one is cloned from its
// latest snapshot. Each clone is a new sandbox with forked_from set and its own
// generation. Fork returns once every clone has started (state running, or
// error with its cause); with ForkOptions.First it returns once the first
// clone runs (clone 0, or if it failed the next to run), with the others in
// state creating or error: their starts go on in the background (Wait waits
// for them), and a call about one of them waits until it has started.
// Errors: sandbox.ErrInvalidArgument for count outside 1..MaxForkCount;
// sandbox.ErrConflict for a source that is neither running nor hibernated;
// clones that failed to start (without First, any; with First, all of them)
// give an error that names them and every clone of the fork, returned with
// the clones' views, the failed ones in state error with their cause. With
// First, a clone that fails after the answer is left in state error and
// logged.
func (m *Manager) Fork(ctx context.Context, id string, count int, opts ...ForkOptions) ([]sandbox.Sandbox, error) {
	if count == 0 {
		count = 1
	}
	if count < 1 || count > MaxForkCount {
		return nil, invalid("count %d: must be between 1 and %d", count, MaxForkCount)
	}
	if len(opts) == 0 || !opts[0].First {
		return m.fork(ctx, id, count, nil, opts)
	}
	type answer struct {
		out []sandbox.Sandbox
		err error
	}
	ans := make(chan answer, 1)
	give := func(out []sandbox.Sandbox, err error) {
		select {
		case ans <- answer{out, err}:
		default: // answered already
		}
	}
	m.forks.Add(1)
	go func() {
		defer m.forks.Done()
		out, err := m.fork(ctx, id, count, func(out []sandbox.Sandbox) { give(out, nil) }, opts)
		give(out, err)
	}()
	a := <-ans
	return a.out, a.err
}

// fork is Fork; answer, when not nil, is called with the clones' records
// once clone 0 runs, before the others have started.
func (m *Manager) fork(ctx context.Context, id string, count int, answer func([]sandbox.Sandbox), opts []ForkOptions) ([]sandbox.Sandbox, error) {
	lockedSrc, err := m.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	unlock := sync.OnceFunc(lockedSrc)
	defer unlock()
	src, err := m.get(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := m.checkFork(ctx, src, opts); err != nil {
		return nil, err
	}
	ids, err := m.cloneIDs(ctx, count, opts)
	if err != nil {
		return nil, err
	}
	// Ready clones of the source's snapshot's warm pool, if it has one
	// (pool.go): they hold their memory already. Those not used on a
	// failure go back.
	pooled := m.takeForFork(src, ids)
	used, launched := 0, false
	var clones []*metadata.Sandbox
	defer func() {
		if !launched { // a failure before the clones start: the ones given a record are stopped
			m.stopClones(context.WithoutCancel(ctx), pooled[:used])
			for _, c := range clones[:min(used, len(clones))] {
				if c != nil {
					m.fail(context.WithoutCancel(ctx), c, errors.New("fork failed before this clone started"))
				}
			}
		}
		m.putBack(poolKey{metadata.PoolSnapshot, src.SnapshotID}, pooled[used:])
	}()
	if len(pooled) < count {
		release, err := m.admit(ctx, "fork", id, (count-len(pooled))*src.MemoryMiB, ids[len(pooled):]...)
		if err != nil {
			return nil, err
		}
		defer release()
	}
	ctx = context.WithoutCancel(ctx)
	start := time.Now()
	var snapshotDur time.Duration
	var dir, rootfs string
	var man snapshot.Manifest
	var e engine.Engine
	var early *earlyClones // the clones restored from the checkpoint during its commit (forkearly.go)
	defer func() {
		if early.started() {
			if !launched {
				early.abort(ctx)
			} else {
				early.close()
			}
		}
	}()
	switch src.State {
	case sandbox.StateRunning:
		var checkpointed func(string)
		if len(pooled) < count && len(src.Volumes) == 0 {
			if rootfs, err = m.snapshotImage(ctx, src.Image, src.ImageDigest); err != nil {
				return nil, fmt.Errorf("fork %s: image %s: %w", id, src.ImageDigest, err)
			}
			early = m.newEarlyClones(src, ids[len(pooled):], rootfs, answer != nil)
			checkpointed = func(dir string) {
				early.start(ctx, dir)
				if faultAt("fork-clone-restored") && early.started() {
					_ = early.restore(0)
					FaultPoint("fork-clone-restored")
				}
			}
		}
		if _, err := m.snapshotThen(ctx, src, true, m.cfg.AsyncUpload, checkpointed); err != nil {
			return nil, err
		}
		snapshotDur = time.Since(start)
	case sandbox.StateHibernated, sandbox.StatePaused: // a paused one: from the pause's snapshot
	default:
		return nil, sandboxConflict(id, "sandbox %s is in state %s; only a running, paused or hibernated sandbox can be forked", id, src.State)
	}
	if early.started() {
		e = early.eng.Engine
		man.Spec.ImageDigest, man.Spec.GuestDigest = src.ImageDigest, src.GuestDigest // the checkpoint's manifest's (manifestFor)
	} else if len(pooled) < count {
		var done func()
		if dir, man, done, err = m.openSnapshot(ctx, src.SnapshotID, "fork", id); err != nil {
			return nil, err
		}
		defer done() // after every clone's restore (wg.Wait below)
		if e, err = m.restoreEngine(src.SnapshotID, man); err != nil {
			return nil, err
		}
		if rootfs, err = m.snapshotImage(ctx, src.Image, man.Spec.ImageDigest); err != nil {
			return nil, fmt.Errorf("fork %s: image %s: %w", id, man.Spec.ImageDigest, err)
		}
	}
	clones = make([]*metadata.Sandbox, count)
	now := time.Now().UTC()
	for i := range clones {
		gen, err := m.cfg.DB.NextGeneration(ctx)
		if err != nil {
			return nil, err
		}
		c := &metadata.Sandbox{
			ID: ids[i], State: sandbox.StateCreating, Image: src.Image, ImageDigest: man.Spec.ImageDigest,
			GuestDigest: man.Spec.GuestDigest, MemoryMiB: src.MemoryMiB, CPUs: src.CPUs, Env: src.Env, PidsLimit: src.PidsLimit,
			Generation: gen, ForkedFrom: src.ID, SnapshotID: src.SnapshotID, SnapshotNode: src.SnapshotNode, Seq: 1,
			Metadata: src.Metadata, CreatedAt: now, StateChangedAt: now, Owner: m.cfg.Node,
		}
		if err := m.forkPolicy(ctx, src, c, opts); err != nil {
			return nil, err
		}
		c.Instance = instanceID(c.ID, 1)
		if i < len(pooled) {
			m.asPooled(c, pooled[i])
			used = i + 1
		}
		if err := m.cfg.DB.CreateSandbox(ctx, c); err != nil {
			return nil, err
		}
		clones[i] = c
	}
	FaultPoint("fork-clones-recorded")
	// Start the clones in a cloneGate's order, each under its lock, taken
	// here so that a call about a clone that arrives once Fork has answered
	// waits for its start.
	launched = true
	var wg sync.WaitGroup
	gate := newCloneGate(answer != nil)
	answerOnce := sync.OnceFunc(func() { answer(m.records(ctx, clones)) })
	errs := make([]error, count)
	for i, c := range clones {
		unlock, _ := m.lock(ctx, c.ID) // ctx has no end: a new id's lock
		wg.Add(1)
		go func() {
			defer wg.Done()
			gate.enter(i)
			defer gate.leave(i)
			defer unlock()
			switch {
			case i < len(pooled):
				errs[i] = m.startPooled(ctx, c, pooled[i])
			case early.started():
				errs[i] = m.startCloneLocked(ctx, e, c, func() error { return early.restore(i - len(pooled)) })
			default:
				errs[i] = m.startCloneLocked(ctx, e, c, m.restoreFrom(ctx, e, c, rootfs, dir))
			}
			if errs[i] != nil {
				m.log.Warn("fork: a clone failed to start", "sandbox", id, "clone", c.ID, "err", errs[i])
			} else if answer != nil {
				// The first clone to run answers (clone 0, unless it
				// failed); the clones' records are read once.
				answerOnce()
			}
		}()
	}
	if answer != nil {
		// The clones' starts need nothing more of the source (they hold
		// the snapshot open): calls about it need not wait for them.
		unlock()
	}
	wg.Wait()
	m.log.Info("forked", "sandbox", id, "clones", count, "pooled", len(pooled), "restored_during_commit", early.started(),
		"total_ms", time.Since(start).Milliseconds(), "snapshot_ms", snapshotDur.Milliseconds())
	out := make([]sandbox.Sandbox, count)
	for i, c := range clones {
		out[i] = m.view(ctx, c)
	}
	if err := errors.Join(errs...); err != nil {
		var failed []string
		for i, e := range errs {
			if e != nil {
				failed = append(failed, clones[i].ID)
			}
		}
		return out, fmt.Errorf("fork %s: %d of %d clones failed to start (%s; each in state error with its cause; the fork's clones: %s): %w",
			id, len(failed), count, strings.Join(failed, ", "), strings.Join(cloneIDsOf(clones), ", "), err)
	}
	m.cfg.Metrics.forked.Add(float64(count))
	return out, nil
}

// startClone starts clone c (recorded in state creating, its SnapshotID the
// snapshot it restores) on engine e: restore restores its instance (or waits
// for a restore already under way: forkearly.go); then it waits for its guest
// agent, runs the resume contract as a fork and records it running. On
// failure c is left in state error and the error returned.
func (m *Manager) startClone(ctx context.Context, e engine.Engine, c *metadata.Sandbox, restore func() error) error {
	unlock, _ := m.lock(ctx, c.ID)
	defer unlock()
	return m.startCloneLocked(ctx, e, c, restore)
}

// startCloneLocked is startClone under c's lock.
func (m *Manager) startCloneLocked(ctx context.Context, e engine.Engine, c *metadata.Sandbox, restore func() error) error {
	eng := m.on(e, c)
	if err := restore(); err != nil {
		_ = eng.Stop(ctx, c.Instance)
		m.fail(ctx, c, err)
		return err
	}
	launched := time.Now()
	if err := m.waitAgent(ctx, c); err != nil {
		_ = eng.Stop(ctx, c.Instance)
		m.fail(ctx, c, err)
		return err
	}
	c.LastResume = m.runContract(ctx, c, c.Generation, true, false, c.SnapshotID, launched)
	t := time.Now().UTC()
	c.LastResumeAt = &t
	return m.setState(ctx, c, sandbox.StateRunning)
}

// cloneIDsOf returns the ids of ss.
func cloneIDsOf(ss []*metadata.Sandbox) []string {
	ids := make([]string, len(ss))
	for i, s := range ss {
		ids[i] = s.ID
	}
	return ids
}

// records returns the views of sandboxes ss as their records in the database
// say now (ss's own structs may be changing under their starts); one that
// cannot be read is shown as ss holds it.
func (m *Manager) records(ctx context.Context, ss []*metadata.Sandbox) []sandbox.Sandbox {
	out := make([]sandbox.Sandbox, len(ss))
	for i, s := range ss {
		rec, err := m.cfg.DB.GetSandbox(ctx, s.ID)
		if err != nil {
			m.log.Warn("fork: reading a clone's record for the answer", "sandbox", s.ID, "err", err)
			out[i] = sandbox.Sandbox{ID: s.ID, State: sandbox.StateCreating}
			continue
		}
		out[i] = m.view(ctx, rec)
	}
	return out
}

// restoreFrom is startClone's restore of c's instance on engine e from image
// file rootfs and the snapshot opened in dir.
func (m *Manager) restoreFrom(ctx context.Context, e engine.Engine, c *metadata.Sandbox, rootfs, dir string) func() error {
	return func() error { return m.on(e, c).Restore(ctx, m.spec(c, rootfs), dir) }
}

// lockRunning takes sandbox id's lock and returns it running, resuming it
// first if it is hibernated (unless its policy says it does not resume on
// request: sandbox.ErrConflict); the caller starts its request and then calls
// unlock, so no hibernate, resume or delete comes between the choice of
// instance and the request reaching it. A call that arrives while the sandbox
// is hibernating or resuming waits for that to finish. Errors: sandbox.ErrNotFound;
// sandbox.ErrConflict for a sandbox in another state; the resume's errors.
func (m *Manager) lockRunning(ctx context.Context, id string) (*metadata.Sandbox, func(), error) {
	return m.lockRunningChecked(ctx, id, nil)
}

// lockRunningChecked is lockRunning that first calls check (when not nil) on
// the sandbox's RequestState, as read under the lock, and returns its error,
// the lock let go, instead of going on.
func (m *Manager) lockRunningChecked(ctx context.Context, id string, check func(RequestState) error) (*metadata.Sandbox, func(), error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	var s *metadata.Sandbox
	err = m.retryStale(ctx, id, func() (err error) {
		s, err = m.runningLocked(ctx, id, check)
		return err
	})
	if err != nil {
		unlock()
		return nil, nil, err
	}
	m.touch(id)
	return s, unlock, nil
}

// runningLocked is lockRunningChecked under the sandbox's lock: the record,
// resumed or unpaused if it must be.
func (m *Manager) runningLocked(ctx context.Context, id string, check func(RequestState) error) (*metadata.Sandbox, error) {
	s, err := m.get(ctx, id)
	if err == nil && check != nil {
		err = check(requestStateOf(s))
	}
	if err == nil {
		switch s.State {
		case sandbox.StateRunning:
		case sandbox.StateHibernated, sandbox.StatePaused:
			if !s.ResumeOnRequest {
				err = sandboxConflict(id, "sandbox %s is %s and does not resume on request", id, s.State).
					WithHint("resume it first")
				break
			}
			// A paused sandbox is unpaused before the request is forwarded:
			// one sent to it while paused would hang.
			err = m.resumeLocked(context.WithoutCancel(ctx), s)
		case sandbox.StateError:
			err = sandboxConflict(id, "sandbox %s is in state error: %s", id, s.Error).
				WithHint("an explicit resume recovers it from its last snapshot, if it has one")
		default:
			err = sandboxConflict(id, "sandbox %s is in state %s", id, s.State)
		}
	}
	return s, err
}

// acquire is lockRunning for a request to the guest agent: it returns the
// agent's client, with the lock held.
func (m *Manager) acquire(ctx context.Context, id string) (*agentclient.Client, func(), error) {
	_, unlock, err := m.lockRunning(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	c := m.liveClient(id)
	if c == nil {
		unlock()
		return nil, nil, sandboxConflict(id, "sandbox %s: no guest agent connection", id)
	}
	return c, unlock, nil
}

// checkEnv checks environment variables for a sandbox or a command: each key
// matches envKeyRE and each value is at most MaxEnvValueBytes bytes with no NUL
// byte (a process's environment is NUL-terminated strings: the value would be
// cut there). The error is InvalidArgument naming the first bad key.
func checkEnv(env map[string]string) error {
	for k, v := range env {
		if !envKeyRE.MatchString(k) {
			return invalid("env key %q: must match %s", k, envKeyRE)
		}
		if len(v) > MaxEnvValueBytes {
			return invalid("env %s: value of %d bytes is longer than %d", k, len(v), MaxEnvValueBytes)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return invalid("env %s: the value holds a NUL byte, which an environment cannot carry", k)
		}
	}
	return nil
}

// Exec starts a command in the sandbox (waking it if hibernated) and returns the
// guest agent's event stream. The caller must Close it.
func (m *Manager) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (*ExecStream, error) {
	if len(req.Cmd) == 0 || req.Cmd[0] == "" {
		return nil, invalid("cmd: must name a program")
	}
	if req.TimeoutS < 0 || req.TimeoutS > MaxExecTimeoutS {
		return nil, invalid("timeout_s %g: must be between 0 and %d", req.TimeoutS, MaxExecTimeoutS)
	}
	if err := checkEnv(req.Env); err != nil {
		return nil, err
	}
	if req.Background && req.Stdin != "" {
		return nil, invalid("stdin: a background process gets no stdin")
	}
	if req.Cwd != "" && !filepath.IsAbs(req.Cwd) {
		return nil, invalid("cwd %q: must be an absolute path", req.Cwd)
	}
	c, unlock, err := m.acquire(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock() // after the agent answered: the command has started
	return m.trackExec(id, c)(guestExec(ctx, c, req))
}

func checkPath(p string) error {
	if p == "" || !filepath.IsAbs(p) {
		return invalid("path %q: must be an absolute path", p)
	}
	if strings.ContainsRune(p, 0) {
		return invalid("path %q: contains a NUL byte", p)
	}
	if c := filepath.Clean(p); c == "/.torpor" || strings.HasPrefix(c, "/.torpor/") {
		return invalid("path %q: /.torpor is torpor's read-only guest directory", p)
	}
	for _, name := range strings.Split(p, "/") {
		if len(name) > MaxFileNameBytes {
			return invalid("path %q: the name %.40q… has %d bytes; a file or directory name has at most %d", p, name, len(name), MaxFileNameBytes)
		}
	}
	return nil
}

// MaxFileNameBytes is the longest name of one file or directory in a sandbox
// (Linux's NAME_MAX, which gVisor keeps): a path with a longer component is
// refused before it reaches the guest agent.
const MaxFileNameBytes = 255

// ReadFile opens a file in the sandbox (waking it if hibernated). It returns the
// content and its size in bytes; sandbox.ErrNotFound for a missing file.
func (m *Manager) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, int64, error) {
	if err := checkPath(path); err != nil {
		return nil, 0, err
	}
	c, unlock, err := m.acquire(ctx, id)
	if err != nil {
		return nil, 0, err
	}
	defer unlock()
	r, n, err := c.ReadFile(ctx, path)
	return r, n, agentErr(path, err)
}

// WriteFile writes a file in the sandbox atomically (waking it if hibernated).
// The upload starts under the sandbox's lock, which is let go once the agent
// reads the first bytes (the upload is then bound to this instance); from then
// on it counts as a request in flight, which a hibernate drains for up to
// HibernateDrain and then cuts. A cut upload writes nothing (the agent renames
// the file into place only when it has all of it) and returns sandbox.ErrConflict.
func (m *Manager) WriteFile(ctx context.Context, id, path string, r io.Reader, size int64) error {
	if err := checkPath(path); err != nil {
		return err
	}
	c, unlock, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	var once sync.Once
	release := func() { once.Do(unlock) }
	defer release()
	m.addOpen(id, 0, 1)
	defer m.addOpen(id, 0, -1)
	uctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer m.trackUpload(id, cancel)()
	// The agent request reads a pipe, not r: a read of r blocks on the client,
	// and a cancelled request must not wait for it.
	pr, pw := io.Pipe()
	go func() {
		_, err := io.Copy(pw, r)
		pw.CloseWithError(err)
	}()
	defer context.AfterFunc(uctx, func() { pr.CloseWithError(context.Canceled) })()
	defer pr.CloseWithError(io.ErrClosedPipe)
	err = c.WriteFile(uctx, path, &releaseOnRead{r: pr, release: release}, size)
	if err != nil && ctx.Err() == nil && m.liveClient(id) != c {
		// The sandbox's process may have died (the host's OOM killer: a
		// trial's 200 MB upload into /tmp of a 256 MiB sandbox); instanceExited
		// records why before it cuts the calls in flight, so say that rather
		// than invite a retry that would kill it again.
		if s, gerr := m.get(context.WithoutCancel(ctx), id); gerr == nil && s.State == sandbox.StateError {
			return sandboxConflict(id, "sandbox %s stopped during the upload of %s and is in state error: %s; nothing was written", id, path, s.Error)
		}
		return sandboxConflict(id, "sandbox %s was hibernated or stopped during the upload of %s; nothing was written: retry", id, path)
	}
	if err != nil {
		if s, gerr := m.get(context.WithoutCancel(ctx), id); gerr == nil {
			if full := sandboxFull(s, path, err); full != nil {
				return full
			}
		}
	}
	return agentErr(path, err)
}

// releaseOnRead calls release before its first Read.
type releaseOnRead struct {
	r       io.Reader
	release func()
}

func (b *releaseOnRead) Read(p []byte) (int, error) {
	b.release()
	return b.r.Read(p)
}

// DialAgent connects to the sandbox's guest agent for E2B's envd (requests
// written for envd, their paths rewritten with proto.EnvdPath; see
// agentclient.EnvdTransport; EnvdRoundTrip sends one request over kept-alive
// connections instead), waking the sandbox if hibernated: the connection
// is made after the resume contract ran. It counts as a request in flight, as
// DialPort's do, and is cut when the sandbox hibernates. Errors: those of
// lockRunning; agentclient.ErrNoEnvd when the sandbox's agent predates envd.
func (m *Manager) DialAgent(ctx context.Context, id string) (net.Conn, error) {
	s, _, unlock, err := m.lockEnvd(ctx, id, nil)
	if err != nil {
		return nil, err
	}
	defer unlock()
	c, err := m.eng(s).Dial(ctx, s.Instance, engine.AgentPort)
	if err != nil {
		return nil, err
	}
	return m.countConn(id, m.trackConn(s.Instance, c)), nil
}

// DialPort connects to a TCP port inside the sandbox, waking it if hibernated.
// Errors: sandbox.ErrInvalidArgument for a port outside 1..65535.
func (m *Manager) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, invalid("port %d: must be between 1 and 65535", port)
	}
	if port == engine.AgentPort {
		// The guest agent runs commands as root and drives the resume contract; it
		// is reachable only through the API's own calls.
		return nil, invalid("port %d: reserved for torpor's guest agent", port)
	}
	s, unlock, err := m.lockRunning(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock() // dialled and counted under the lock: a hibernate then waits for it
	c, err := m.eng(s).Dial(ctx, s.Instance, port)
	if err != nil {
		return nil, err
	}
	return m.countConn(id, m.trackConn(s.Instance, c)), nil
}
