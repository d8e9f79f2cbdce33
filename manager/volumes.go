package manager

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Volumes.
//
// A named volume is a host directory, <data dir>/volumes/<name>, bind-mounted
// read-write at a path the sandbox's create request gives. Its data lives on the
// host, never in a snapshot: a memory snapshot holds at most the sandbox's own
// cached view of it, and gVisor mounts it shared (the gofer revalidates against
// the host), so after a resume the sandbox sees the host's current contents. A
// volume outlives every sandbox that uses it and is deleted only by DELETE
// /v1/volumes/{name}, which is refused while any sandbox (running or hibernated)
// mounts it. The mount is in every Start and Restore spec, so it is attached
// again on resume at the same path.
//
// Forks: a clone must not silently share a read-write volume with its source. A
// fork of a sandbox that has volumes is refused (conflict) unless the request
// says volumes "copy": then each clone gets, for every volume, a new volume
// <name>-<12 characters of the clone's id> holding a copy (cp -a) of the volume as
// it is right after the fork's checkpoint, mounted at the same path. The copies
// are ordinary volumes: they outlive the clone.
//
// Nodes: a volume's record names the node that created it (Config.Node; on a
// single-node SQLite server its node name, which may be ""). Its directory is
// on that node alone, so the cluster front (server/cluster.go) places every
// create, resume and fork of a sandbox that mounts it there, and refuses
// (503) when that node is lost, draining or full rather than placing
// elsewhere; a sandbox that mounts volumes of two nodes it refuses (409). A
// clone's copies are made on the source's node, so they are
// recorded there too.

var volumeNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,49}$`)

// ForkOptions are the options of a fork besides the count.
type ForkOptions struct {
	// Volumes is "" (refuse to fork a sandbox with volumes) or "copy".
	Volumes string
	// IDs, when set, are the clones' ids, one per clone (NewSandboxID makes
	// them): a caller that must know them before the clones exist (an
	// idempotent fork) chooses them. A malformed or taken id is refused.
	IDs []string
	// First makes Fork answer once the first clone runs, the others still
	// starting (state creating) behind it; the first clone starts alone.
	First bool
}

func (m *Manager) volumeDir(name string) string {
	return filepath.Join(m.cfg.Lifecycle.VolumesDir, name)
}

func (m *Manager) volumesEnabled() error {
	if m.cfg.Lifecycle.VolumesDir == "" {
		return invalid("volumes are not configured on this server")
	}
	return nil
}

// CreateVolume creates an empty named volume. Errors: sandbox.ErrInvalidArgument for a bad
// name, sandbox.ErrConflict if it exists.
func (m *Manager) CreateVolume(ctx context.Context, name string) (sandbox.Volume, error) {
	if err := m.volumesEnabled(); err != nil {
		return sandbox.Volume{}, err
	}
	if !volumeNameRE.MatchString(name) {
		return sandbox.Volume{}, invalid("volume name %q: must match %s", name, volumeNameRE)
	}
	return m.createVolume(ctx, name, "")
}

func (m *Manager) createVolume(ctx context.Context, name, from string) (sandbox.Volume, error) {
	v := metadata.Volume{Name: name, CreatedAt: time.Now().UTC(), CopiedFrom: from, Node: m.cfg.Node}
	if err := m.cfg.DB.CreateVolume(ctx, v); err != nil {
		if errors.Is(err, metadata.ErrExists) {
			return sandbox.Volume{}, conflict("volume %s already exists", name)
		}
		return sandbox.Volume{}, err
	}
	dir := m.volumeDir(name)
	var err error
	if from == "" {
		_ = os.RemoveAll(dir) // a leftover of a crashed delete
		err = os.MkdirAll(dir, 0o755)
	} else {
		_ = os.RemoveAll(dir)
		if out, cerr := exec.CommandContext(ctx, "cp", "-a", "--", m.volumeDir(from), dir).CombinedOutput(); cerr != nil {
			err = fmt.Errorf("copy volume %s to %s: %v: %s", from, name, cerr, strings.TrimSpace(string(out)))
		}
	}
	if err != nil {
		_ = m.cfg.DB.DeleteVolume(context.WithoutCancel(ctx), name)
		_ = os.RemoveAll(dir)
		return sandbox.Volume{}, err
	}
	return sandbox.Volume{Name: name, CreatedAt: v.CreatedAt, CopiedFrom: from, Node: v.Node}, nil
}

// usedBy maps volume names to the sandboxes that mount them.
func (m *Manager) usedBy(ctx context.Context) (map[string][]string, error) {
	all, err := m.cfg.DB.ListSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, s := range all {
		for _, v := range s.Volumes {
			out[v.Name] = append(out[v.Name], s.ID)
		}
	}
	return out, nil
}

// ListVolumes lists the volumes with the sandboxes that use them.
func (m *Manager) ListVolumes(ctx context.Context) ([]sandbox.Volume, error) {
	vs, err := m.cfg.DB.ListVolumes(ctx)
	if err != nil {
		return nil, err
	}
	used, err := m.usedBy(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Volume, 0, len(vs))
	for _, v := range vs {
		out = append(out, sandbox.Volume{Name: v.Name, CreatedAt: v.CreatedAt, CopiedFrom: v.CopiedFrom, Node: v.Node, UsedBy: used[v.Name]})
	}
	return out, nil
}

// GetVolume returns one volume. Errors: sandbox.ErrNotFound.
func (m *Manager) GetVolume(ctx context.Context, name string) (sandbox.Volume, error) {
	v, err := m.cfg.DB.GetVolume(ctx, name)
	if errors.Is(err, metadata.ErrNotFound) {
		return sandbox.Volume{}, notFound("volume", name)
	}
	if err != nil {
		return sandbox.Volume{}, err
	}
	used, err := m.usedBy(ctx)
	if err != nil {
		return sandbox.Volume{}, err
	}
	return sandbox.Volume{Name: v.Name, CreatedAt: v.CreatedAt, CopiedFrom: v.CopiedFrom, Node: v.Node, UsedBy: used[v.Name]}, nil
}

// DeleteVolume deletes a volume and its data. Errors: sandbox.ErrNotFound; sandbox.ErrConflict
// while a sandbox mounts it.
func (m *Manager) DeleteVolume(ctx context.Context, name string) error {
	if _, err := m.cfg.DB.GetVolume(ctx, name); errors.Is(err, metadata.ErrNotFound) {
		return notFound("volume", name)
	} else if err != nil {
		return err
	}
	used, err := m.usedBy(ctx)
	if err != nil {
		return err
	}
	if ids := used[name]; len(ids) > 0 {
		return conflict("volume %s is mounted by %s; delete those sandboxes first", name, strings.Join(ids, ", "))
	}
	if err := m.cfg.DB.DeleteVolume(ctx, name); errors.Is(err, metadata.ErrNotFound) {
		return notFound("volume", name)
	} else if err != nil {
		return err
	}
	return os.RemoveAll(m.volumeDir(name))
}

// checkVolumeMounts validates a create request's volumes.
func (m *Manager) checkVolumeMounts(ctx context.Context, vs []sandbox.VolumeMount) ([]sandbox.VolumeMount, error) {
	if len(vs) == 0 {
		return nil, nil
	}
	if err := m.volumesEnabled(); err != nil {
		return nil, err
	}
	names, paths := map[string]bool{}, map[string]bool{}
	for _, v := range vs {
		if err := checkMountPath(v.Path); err != nil {
			return nil, err
		}
		if names[v.Name] || paths[v.Path] {
			return nil, invalid("volumes: %s at %s given twice", v.Name, v.Path)
		}
		for p := range paths {
			if strings.HasPrefix(v.Path, p+"/") || strings.HasPrefix(p, v.Path+"/") {
				return nil, invalid("volumes: paths %s and %s nest", p, v.Path)
			}
		}
		names[v.Name], paths[v.Path] = true, true
		if _, err := m.cfg.DB.GetVolume(ctx, v.Name); errors.Is(err, metadata.ErrNotFound) {
			return nil, invalid("volume %q: not found", v.Name).WithHint("create the volume first")
		} else if err != nil {
			return nil, err
		}
	}
	return vs, nil
}

// volumeMounts are s's volumes as engine mounts.
func (m *Manager) volumeMounts(s *metadata.Sandbox) []engine.Mount {
	var out []engine.Mount
	for _, v := range s.Volumes {
		out = append(out, engine.Mount{Source: m.volumeDir(v.Name), Destination: v.Path})
	}
	return out
}

// checkFork refuses forks that would share a read-write volume or that cannot
// restore (a hibernated filesystem-mode snapshot has no memory to clone).
func (m *Manager) checkFork(ctx context.Context, src *metadata.Sandbox, opts []ForkOptions) error {
	var o ForkOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	switch o.Volumes {
	case "", "copy":
	default:
		return invalid("volumes %q: must be \"copy\" or absent", o.Volumes)
	}
	if len(src.Volumes) > 0 && o.Volumes != "copy" {
		return sandboxConflict(src.ID, "sandbox %s mounts volumes (%s); clones never share a read-write volume", src.ID, volumeNames(src.Volumes)).
			WithHint("fork with volumes \"copy\" to give each clone a copy of each")
	}
	if src.State == sandbox.StateHibernated && m.isFilesystemSnapshot(ctx, src.SnapshotID) {
		return sandboxConflict(src.ID, "sandbox %s is hibernated in mode filesystem (no memory snapshot to clone)", src.ID).WithHint("resume it first")
	}
	return nil
}

// forkPolicy gives clone c its source's policies and, with volumes "copy", its
// own copy of every volume. The clone's usage starts at zero.
func (m *Manager) forkPolicy(ctx context.Context, src, c *metadata.Sandbox, opts []ForkOptions) error {
	p := src.Policy
	p.Volumes = nil
	for _, v := range src.Volumes {
		name := v.Name + "-" + strings.TrimPrefix(c.ID, "sbx-")
		if _, err := m.createVolume(ctx, name, v.Name); err != nil {
			return fmt.Errorf("fork %s: %w", src.ID, err)
		}
		p.Volumes = append(p.Volumes, sandbox.VolumeMount{Name: name, Path: v.Path})
	}
	c.Policy = p
	c.Meter = metadata.Meter{}
	return nil
}
