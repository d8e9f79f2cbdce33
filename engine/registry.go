package engine

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

// Registry holds the engines of one host by Name, and which of them starts new
// sandboxes (the default). It is built once, before the manager starts, and
// read-only afterwards.
type Registry struct {
	byName map[string]Engine
	def    string
}

// NewRegistry returns a registry of engines whose default is the engine named
// def. Errors: no engines, two engines with one Name, def not among them.
func NewRegistry(def string, engines ...Engine) (*Registry, error) {
	r := &Registry{byName: map[string]Engine{}, def: def}
	for _, e := range engines {
		if _, dup := r.byName[e.Name()]; dup {
			return nil, fmt.Errorf("engine registry: two engines named %q", e.Name())
		}
		r.byName[e.Name()] = e
	}
	if _, ok := r.byName[def]; !ok {
		return nil, fmt.Errorf("engine registry: default engine %q is not registered (have %s)", def, strings.Join(r.Names(), ", "))
	}
	return r, nil
}

// Get returns the engine named name.
func (r *Registry) Get(name string) (Engine, bool) {
	e, ok := r.byName[name]
	return e, ok
}

// Default returns the engine that starts new sandboxes.
func (r *Registry) Default() Engine { return r.byName[r.def] }

// Names returns the registered engines' names, sorted.
func (r *Registry) Names() []string {
	out := make([]string, 0, len(r.byName))
	for n := range r.byName {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// All returns the registered engines, sorted by name.
func (r *Registry) All() []Engine {
	out := make([]Engine, 0, len(r.byName))
	for _, n := range r.Names() {
		out = append(out, r.byName[n])
	}
	return out
}

// ErrIncompatible is wrapped by every *IncompatibleError.
var ErrIncompatible = errors.New("snapshot incompatible with this host's engine")

// IncompatibleError says that a checkpoint written by one engine (Name,
// Version as its manifest records them) cannot be restored by this host's.
type IncompatibleError struct {
	// SnapshotEngine and SnapshotVersion are the writer's Name and Version;
	// HostEngine and HostVersion the host's engine of that name (HostVersion
	// empty when the host has no engine of that name).
	SnapshotEngine, SnapshotVersion string
	HostEngine, HostVersion         string
	// Reason is the engine's own explanation (CompatibilityChecker), or "".
	Reason string
}

func (e *IncompatibleError) Error() string {
	if e.HostVersion == "" {
		return fmt.Sprintf("taken by engine %s (%s), which this host does not run (engines: %s)",
			e.SnapshotEngine, e.SnapshotVersion, e.HostEngine)
	}
	msg := fmt.Sprintf("taken by %s, this host runs %s", e.SnapshotVersion, e.HostVersion)
	if e.Reason != "" {
		msg += " (" + e.Reason + ")"
	}
	return msg
}

func (e *IncompatibleError) Unwrap() error { return ErrIncompatible }

// CompatibilityChecker is an Engine that decides itself which checkpoints of
// its own Name it can restore; without it CheckRestore requires the exact
// Version.
type CompatibilityChecker interface {
	// CanRestore returns nil if the engine can restore a checkpoint written by
	// an engine of its Name at version, else a short reason.
	CanRestore(version string) error
}

// CheckRestore returns nil if registry r has an engine that can restore a
// checkpoint written by engine name at version, and that engine; otherwise a
// *IncompatibleError (wrapping ErrIncompatible). It is called before any
// Restore, with what the snapshot's manifest records.
func (r *Registry) CheckRestore(name, version string) (Engine, error) {
	e, ok := r.Get(name)
	if !ok {
		return nil, &IncompatibleError{SnapshotEngine: name, SnapshotVersion: version, HostEngine: strings.Join(r.Names(), ", ")}
	}
	refuse := &IncompatibleError{SnapshotEngine: name, SnapshotVersion: version, HostEngine: e.Name(), HostVersion: e.Version()}
	if cc, ok := e.(CompatibilityChecker); ok {
		if why := cc.CanRestore(version); why != nil {
			refuse.Reason = why.Error()
			return nil, refuse
		}
		return e, nil
	}
	if version != e.Version() {
		return nil, refuse
	}
	return e, nil
}

// HostScoper is an Engine whose instances have host-wide names (cgroups,
// network namespaces) under a prefix of its own, for the server's log.
type HostScoper interface {
	HostScope() string
}
