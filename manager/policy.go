package manager

import (
	"context"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// LifecycleConfig configures the lifecycle policies of docs/lifecycle.md: the
// idle trigger, run timeouts, hibernation modes and volumes.
type LifecycleConfig struct {
	// IdleCPUThreshold is the CPU use, as a fraction of one core, below which a
	// sandbox counts as idle (default 0.05 = 5 %).
	IdleCPUThreshold float64
	// CheckInterval is how often the lifecycle loop samples CPU and checks idle
	// and run timeouts (default 1 s); 30 intervals after a snapshot deletion
	// failed (the store's backend unreachable) it tries the deletion again.
	CheckInterval time.Duration
	// VolumesDir holds one host directory per named volume ("" = volumes are
	// refused).
	VolumesDir string
	// FilesystemTimeout bounds capturing or restoring the writable layer of a
	// filesystem-mode sandbox (default 5 min).
	FilesystemTimeout time.Duration
	// StandbyMemoryMiB is the host's budget for paused sandboxes, in MiB of
	// their memory limits (memory_mib): beyond it the lifecycle loop
	// hibernates the ones paused longest first. 0 = no budget.
	StandbyMemoryMiB int
}

// Policy defaults and limits.
const (
	DefaultIdleTimeoutS     = 15
	DefaultIdleCPUThreshold = 0.05
	MaxTimeoutS             = 365 * 24 * 3600
)

func (m *Manager) lcfg() LifecycleConfig {
	c := m.cfg.Lifecycle
	if c.IdleCPUThreshold <= 0 {
		c.IdleCPUThreshold = DefaultIdleCPUThreshold
	}
	if c.CheckInterval <= 0 {
		c.CheckInterval = time.Second
	}
	if c.FilesystemTimeout <= 0 {
		c.FilesystemTimeout = 5 * time.Minute
	}
	return c
}

// modeKeeps says, for GET /v1/sandboxes/{id}, what each hibernation mode keeps.
var modeKeeps = map[string]string{
	sandbox.ModeMemory: "everything: memory, running processes and the writable layer; processes continue on resume",
	sandbox.ModeFilesystem: "the writable layer only (files created or changed on the root filesystem since the sandbox was " +
		"created; not /tmp, not deletions of image files); processes are not kept: on resume the sandbox boots fresh " +
		"from its image plus that layer and starts on_resume",
	sandbox.ModeNone: "nothing: an idle sandbox is deleted",
}

func validMode(m string) bool { _, ok := modeKeeps[m]; return ok }

func checkTimeouts(idle, pause, timeout int, onTimeout string) error {
	if idle < 0 || idle > MaxTimeoutS {
		return invalid("idle_timeout_s %d: must be between 0 (never) and %d", idle, MaxTimeoutS)
	}
	if pause < 0 || pause > MaxTimeoutS {
		return invalid("pause_after_s %d: must be between 0 (never) and %d", pause, MaxTimeoutS)
	}
	if timeout < 0 || timeout > MaxTimeoutS {
		return invalid("timeout_s %d: must be between 0 (none) and %d", timeout, MaxTimeoutS)
	}
	if onTimeout != sandbox.OnTimeoutHibernate && onTimeout != sandbox.OnTimeoutDelete {
		return invalid("on_timeout %q: must be \"hibernate\" or \"delete\"", onTimeout)
	}
	return nil
}

// Limits of a sandbox's metadata (sandbox.Spec.Metadata).
const (
	MaxMetadataPairs     = 64
	MaxMetadataPairBytes = 4 << 10
)

// checkMetadata checks a sandbox's metadata: at most MaxMetadataPairs pairs,
// each key non-empty, key and value together at most MaxMetadataPairBytes
// bytes. The error is InvalidArgument naming the first bad key.
func checkMetadata(md map[string]string) error {
	if len(md) > MaxMetadataPairs {
		return invalid("metadata: %d pairs, at most %d", len(md), MaxMetadataPairs)
	}
	for k, v := range md {
		if k == "" {
			return invalid("metadata: an empty key")
		}
		if len(k)+len(v) > MaxMetadataPairBytes {
			return invalid("metadata %q: %d bytes with its value, at most %d", k, len(k)+len(v), MaxMetadataPairBytes)
		}
	}
	return nil
}

func checkOnResume(cmd []string) error {
	if len(cmd) > 0 && cmd[0] == "" {
		return invalid("on_resume: must name a program")
	}
	return nil
}

// createPolicy validates the policy fields of a create request and returns the
// record's Policy.
func (m *Manager) createPolicy(ctx context.Context, req sandbox.Spec) (sandbox.Policy, error) {
	p := sandbox.Policy{IdleTimeoutS: DefaultIdleTimeoutS, TimeoutS: req.TimeoutS, OnTimeout: req.OnTimeout,
		HibernationMode: req.HibernationMode, OnResume: req.OnResume, ExpiresAt: utcp(req.ExpiresAt),
		ResumeOnRequest: req.ResumeOnRequest == nil || *req.ResumeOnRequest}
	if err := checkExpiry(req.ExpiresAt); err != nil {
		return p, err
	}
	if req.ExpiresAt != nil && !req.ExpiresAt.After(time.Now()) {
		// On create a past time can only be a mistake: the sandbox would be
		// deleted at its first hibernate. (PATCH may set one: that is how a
		// caller asks retention to delete a sandbox once it is hibernated.)
		return p, invalid("expires_at %s: in the past; give a future time, or omit it for never", req.ExpiresAt.UTC().Format(time.RFC3339))
	}
	if req.IdleTimeoutS != nil {
		p.IdleTimeoutS = *req.IdleTimeoutS
	}
	if p.OnTimeout == "" {
		p.OnTimeout = sandbox.OnTimeoutHibernate
	}
	if p.HibernationMode == "" {
		p.HibernationMode = sandbox.ModeMemory
	}
	if req.PauseAfterS != nil {
		p.PauseAfterS = *req.PauseAfterS
	} else if p.HibernationMode == sandbox.ModeMemory && p.IdleTimeoutS > DefaultPauseAfterS {
		p.PauseAfterS = DefaultPauseAfterS
	}
	if err := checkTimeouts(p.IdleTimeoutS, p.PauseAfterS, p.TimeoutS, p.OnTimeout); err != nil {
		return p, err
	}
	if !validMode(p.HibernationMode) {
		return p, invalid("hibernation_mode %q: must be memory, filesystem or none", p.HibernationMode)
	}
	if err := checkOnResume(p.OnResume); err != nil {
		return p, err
	}
	vols, err := m.checkVolumeMounts(ctx, req.Volumes)
	if err != nil {
		return p, err
	}
	p.Volumes = vols
	if p.Network, err = m.createNetwork(req); err != nil {
		return p, err
	}
	return p, nil
}

// Update changes a sandbox's policies (PATCH /v1/sandboxes/{id}); only the fields
// present change. Setting timeout_s starts a new timeout period: the sandbox may
// run timeout_s more seconds from now. Errors: sandbox.ErrNotFound, sandbox.ErrInvalidArgument.
func (m *Manager) Update(ctx context.Context, id string, req sandbox.PolicyUpdate) (sandbox.Sandbox, error) {
	unlock, err := m.lock(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	defer unlock()
	// A sandbox no node owns may be changed through another node meanwhile
	// (resumed, deleted): read it again and decide again (retryStale).
	var sb sandbox.Sandbox
	err = m.retryStale(ctx, id, func() (err error) {
		sb, err = m.updateLocked(ctx, id, req)
		return err
	})
	return sb, err
}

// updateLocked is Update under the sandbox's lock.
func (m *Manager) updateLocked(ctx context.Context, id string, req sandbox.PolicyUpdate) (sandbox.Sandbox, error) {
	s, err := m.get(ctx, id)
	if err != nil {
		return sandbox.Sandbox{}, err
	}
	p := s.Policy
	if req.IdleTimeoutS != nil {
		p.IdleTimeoutS = *req.IdleTimeoutS
	}
	if req.PauseAfterS != nil {
		p.PauseAfterS = *req.PauseAfterS
	}
	if req.TimeoutS != nil {
		p.TimeoutS = *req.TimeoutS
	}
	if req.OnTimeout != nil {
		p.OnTimeout = *req.OnTimeout
	}
	if req.HibernationMode != nil {
		if !validMode(*req.HibernationMode) {
			return sandbox.Sandbox{}, invalid("hibernation_mode %q: must be memory, filesystem or none", *req.HibernationMode)
		}
		p.HibernationMode = *req.HibernationMode
	}
	if req.OnResume != nil {
		p.OnResume = *req.OnResume
	}
	if req.ExpiresAt.Set {
		if err := checkExpiry(req.ExpiresAt.At); err != nil {
			return sandbox.Sandbox{}, err
		}
		p.ExpiresAt = utcp(req.ExpiresAt.At)
	}
	if err := checkTimeouts(p.IdleTimeoutS, p.PauseAfterS, p.TimeoutS, p.OnTimeout); err != nil {
		return sandbox.Sandbox{}, err
	}
	if err := checkOnResume(p.OnResume); err != nil {
		return sandbox.Sandbox{}, err
	}
	ctx = context.WithoutCancel(ctx)
	m.accrue(ctx, s, time.Now())
	if req.TimeoutS != nil {
		s.TimeoutBaseMS = s.RunningMS
	}
	s.Policy = p
	if err := m.cfg.DB.UpdateSandbox(ctx, s); err != nil {
		return sandbox.Sandbox{}, err
	}
	m.touch(id)
	return m.view(ctx, s), nil
}

// viewPolicy fills the policy and usage fields of a sandbox's API view.
func (m *Manager) viewPolicy(ctx context.Context, s *metadata.Sandbox, v *sandbox.Sandbox) {
	mode := s.HibernationMode
	if mode == "" {
		mode = sandbox.ModeMemory
	}
	v.IdleTimeoutS, v.PauseAfterS, v.TimeoutS, v.OnTimeout = s.IdleTimeoutS, s.PauseAfterS, s.TimeoutS, s.OnTimeout
	v.Hibernation = sandbox.Hibernation{Mode: mode, Keeps: modeKeeps[mode]}
	if len(s.Volumes) > 0 {
		v.Hibernation.Keeps += "; volumes (" + volumeNames(s.Volumes) + ") are host directories, never in a snapshot, and are mounted again on resume"
	}
	v.OnResume = s.OnResume
	v.Volumes = s.Volumes
	v.ExpiresAt = s.ExpiresAt
	v.ResumeOnRequest = s.ResumeOnRequest
	v.Network = s.Network
	run, byteS := m.usageAt(ctx, s, time.Now())
	v.Usage = sandbox.Usage{RunningS: float64(run) / 1000, SnapshotByteS: byteS}
	if s.TimeoutS > 0 {
		v.TimeoutLeftS = max(0, float64(int64(s.TimeoutS)*1000-(run-s.TimeoutBaseMS))/1000)
	}
}

// utcp copies a time in UTC (nil stays nil).
// checkExpiry refuses the zero time (0001-01-01T00:00:00Z) as expires_at: it
// was taken for "never" (a trial's PATCH cleared an expiry with it), though
// any other past time means "now".
func checkExpiry(t *time.Time) error {
	if t != nil && t.IsZero() {
		return invalid("expires_at %s is the zero time: give a real time, or null for never", t.Format(time.RFC3339))
	}
	return nil
}

func utcp(t *time.Time) *time.Time {
	if t == nil || t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}

func volumeNames(vs []sandbox.VolumeMount) string {
	var n []string
	for _, v := range vs {
		n = append(n, v.Name+" at "+v.Path)
	}
	return strings.Join(n, ", ")
}

// reservedPaths cannot be volume mount points.
var reservedPaths = []string{"/", "/proc", "/sys", "/dev", "/.torpor", "/tmp"}

func checkMountPath(p string) error {
	if p == "" || !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return invalid("volume path %q: must be a clean absolute path", p)
	}
	for _, r := range reservedPaths {
		if p == r || (r != "/" && strings.HasPrefix(p, r+"/")) {
			return invalid("volume path %q: %s is reserved", p, r)
		}
	}
	return nil
}
