package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/torpor/torpor/engine"
)

// Pause implements engine.Pauser with `runsc pause`: gVisor's kernel stops
// every task (Kernel.Pause) and runsc records the container paused in its
// state file. runsc's own freezer cgroup is not used by gVisor; the engine's
// freeze (CheckpointExit) is separate and never applied to a paused instance.
func (e *Engine) Pause(ctx context.Context, id string) error {
	st, err := e.statusOf(id)
	if err != nil {
		return fmt.Errorf("gvisor: pause %s: %w", id, err)
	}
	switch st {
	case statusPaused:
		return nil
	case statusRunning:
	default:
		return fmt.Errorf("gvisor: pause %s: container is %s: %w", id, st, engine.ErrNotRunning)
	}
	if _, err := e.run(ctx, "pause", id); err != nil {
		return fmt.Errorf("gvisor: pause %s: %w", id, err)
	}
	return nil
}

// Unpause implements engine.Pauser with `runsc resume`, which lets the
// kernel's tasks continue (Kernel.Unpause, then gVisor's post-resume work).
// runsc refuses to resume a container its state file does not record paused,
// so a second Unpause cannot unbalance the kernel's stop count (gVisor panics
// on a resume without a pause).
func (e *Engine) Unpause(ctx context.Context, id string) error {
	st, err := e.statusOf(id)
	if err != nil {
		return fmt.Errorf("gvisor: unpause %s: %w", id, err)
	}
	if st != statusPaused {
		return nil
	}
	if _, err := e.run(ctx, "resume", id); err != nil {
		return fmt.Errorf("gvisor: unpause %s: %w", id, err)
	}
	return nil
}

// Container statuses as runsc's state file records them (runsc/container
// Status at the pinned version, serialized as its name).
const (
	statusRunning = "running"
	statusPaused  = "paused"
)

// statusOf reads instance id's status from runsc's state file under the
// engine's root, without starting runsc. Errors wrap engine.ErrNotRunning when
// runsc has no state for id.
func (e *Engine) statusOf(id string) (string, error) {
	if !idRE.MatchString(id) {
		return "", fmt.Errorf("invalid instance id %q", id)
	}
	b, err := os.ReadFile(filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:"+id+".state"))
	if os.IsNotExist(err) {
		return "", fmt.Errorf("no runsc state: %w", engine.ErrNotRunning)
	}
	if err != nil {
		return "", err
	}
	var st struct {
		Status json.RawMessage `json:"status"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return "", fmt.Errorf("runsc state file: %w", err)
	}
	var name string
	if err := json.Unmarshal(st.Status, &name); err != nil {
		return "", fmt.Errorf("runsc state file: status %s: %w", st.Status, err)
	}
	return name, nil
}
