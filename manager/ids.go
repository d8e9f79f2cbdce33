package manager

import (
	"context"
	"errors"

	"github.com/torpor/torpor/metadata"
)

// NewSandboxID returns a new random sandbox id (sbx- and 12 of [a-z0-9]), for
// callers that choose a sandbox's id before it exists (sandbox.Spec.ID,
// ForkOptions.IDs).
func NewSandboxID() string { return newID("sbx-") }

// newSandboxID returns want, or a new id when want is "". Errors:
// sandbox.ErrInvalidArgument for a malformed id, sandbox.ErrConflict for one
// a sandbox has.
func (m *Manager) newSandboxID(ctx context.Context, want string) (string, error) {
	if want == "" {
		return NewSandboxID(), nil
	}
	if !idRE.MatchString(want) {
		return "", invalid("sandbox id %q: must be sbx- and 12 of [a-z0-9]", want)
	}
	_, err := m.cfg.DB.GetSandbox(ctx, want)
	switch {
	case err == nil:
		return "", sandboxConflict(want, "sandbox id %s is taken", want)
	case !errors.Is(err, metadata.ErrNotFound):
		return "", err
	}
	return want, nil
}

// cloneIDs returns the ids of count clones: opts' IDs (checked as
// newSandboxID does; there must be count of them, all different) or new ones.
func (m *Manager) cloneIDs(ctx context.Context, count int, opts []ForkOptions) ([]string, error) {
	var want []string
	if len(opts) > 0 {
		want = opts[0].IDs
	}
	if want != nil && len(want) != count {
		return nil, invalid("%d clone ids for %d clones", len(want), count)
	}
	ids := make([]string, count)
	seen := map[string]bool{}
	for i := range ids {
		w := ""
		if want != nil {
			w = want[i]
			if seen[w] {
				return nil, invalid("clone id %s given twice", w)
			}
			seen[w] = true
		}
		id, err := m.newSandboxID(ctx, w)
		if err != nil {
			return nil, err
		}
		ids[i] = id
	}
	return ids, nil
}
