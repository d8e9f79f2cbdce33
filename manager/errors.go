package manager

import (
	"errors"
	"fmt"
)

// Error kinds the API maps to HTTP statuses. Every error the manager returns wraps
// one of them (errors.Is) or is an internal failure.
var (
	ErrNotFound        = errors.New("not found")        // 404 not_found
	ErrInvalidArgument = errors.New("invalid argument") // 400 invalid_argument
	ErrConflict        = errors.New("conflict")         // 409 conflict
	ErrSnapshotCorrupt = errors.New("snapshot corrupt") // 422 snapshot_corrupt
)

func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidArgument, fmt.Sprintf(format, a...))
}

func notFound(what, id string) error {
	return fmt.Errorf("%s %q: %w", what, id, ErrNotFound)
}

func conflict(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrConflict, fmt.Sprintf(format, a...))
}

// Message returns err's text without the kind prefix the manager adds ("invalid
// argument: ", "not found: ", …), for API error bodies.
func Message(err error) string {
	s := err.Error()
	for _, k := range []error{ErrNotFound, ErrInvalidArgument, ErrConflict, ErrSnapshotCorrupt} {
		p := k.Error() + ": "
		if len(s) > len(p) && s[:len(p)] == p {
			return s[len(p):]
		}
	}
	return s
}
