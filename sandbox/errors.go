package sandbox

import (
	"errors"
	"fmt"
	"strings"
)

// Kind says what sort of failure an Error is. Each API surface maps it to its
// own status code (the REST API: NotFound 404, InvalidArgument 400, Conflict
// 409, SnapshotCorrupt 422, Unavailable 503, InsufficientStorage 507,
// Internal 500).
type Kind int

// The kinds of Error. The zero Kind is Internal.
const (
	// Internal is an unexpected failure of a part (engine, store, database)
	// or a bug; retrying may or may not help.
	Internal Kind = iota
	// NotFound: the sandbox, snapshot, volume, image or file named does not
	// exist.
	NotFound
	// InvalidArgument: the caller asked for something invalid (a limit out of
	// range, a bad name or path); the same call will fail again.
	InvalidArgument
	// Conflict: the call is valid but the object's current state does not
	// allow it (resume of a sandbox in state error without a snapshot, delete
	// of a snapshot in use, a volume name taken).
	Conflict
	// SnapshotCorrupt: a snapshot failed verification or is recorded but
	// missing from the store; the message names the snapshot and the file
	// (and chunk). Nothing was changed.
	SnapshotCorrupt
	// Unavailable: a part the call needs does not answer now (an unreachable
	// store); retrying later may succeed.
	Unavailable
	// InsufficientStorage: the data directory's disk has no room for what the
	// call writes (a hibernate's snapshot, a created sandbox's files); the
	// message names the directory. Nothing was changed: the sandbox is as it
	// was (a running one goes on running). The same call succeeds once space
	// is freed.
	InsufficientStorage
)

var kindNames = [...]string{
	Internal:            "internal error",
	NotFound:            "not found",
	InvalidArgument:     "invalid argument",
	Conflict:            "conflict",
	SnapshotCorrupt:     "snapshot corrupt",
	Unavailable:         "unavailable",
	InsufficientStorage: "insufficient storage",
}

// String names the kind in words ("not found", "invalid argument", …).
func (k Kind) String() string {
	if k >= 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("kind %d", int(k))
}

// Error is the error the sandbox manager returns for anything an API surface
// must tell apart. Its text reads
//
//	<Op> <SandboxID>: <Err>; <Hint>
//
// where the Op part is left out when Op is "" (SandboxID is then only a
// field: Err's text names the sandbox itself) and the Hint part when Hint is
// "". Messages name what failed and with which input but no API path or
// command-line flag: Hint gives advice in words ("resume the sandbox first"),
// and a surface may add its own, surface-specific advice.
type Error struct {
	Kind Kind
	// Op is the operation that failed ("resume", "fork", …), or "".
	Op string
	// SandboxID is the sandbox the operation was on, or "".
	SandboxID string
	// Hint is what the caller can do about it, in words, or "".
	Hint string
	// Err is what went wrong; nil reads as the Kind's name.
	Err error
}

// Error returns the text described at Error.
func (e *Error) Error() string {
	var b strings.Builder
	if e.Op != "" {
		b.WriteString(e.Op)
		if e.SandboxID != "" {
			b.WriteString(" " + e.SandboxID)
		}
		b.WriteString(": ")
	}
	if e.Err != nil {
		b.WriteString(e.Err.Error())
	} else {
		b.WriteString(e.Kind.String())
	}
	if e.Hint != "" {
		b.WriteString("; " + e.Hint)
	}
	return b.String()
}

// Unwrap returns Err.
func (e *Error) Unwrap() error { return e.Err }

// Is reports whether target is the sentinel of e's Kind (ErrNotFound, …), so
// errors.Is(err, sandbox.ErrNotFound) holds for every NotFound Error in err's
// chain.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Err == nil && t.Op == "" && t.SandboxID == "" && t.Hint == "" && t.Kind == e.Kind
}

// WithHint sets e's Hint and returns e.
func (e *Error) WithHint(hint string) *Error {
	e.Hint = hint
	return e
}

// Sentinels of each Kind, for errors.Is.
var (
	ErrNotFound        = &Error{Kind: NotFound}
	ErrInvalidArgument = &Error{Kind: InvalidArgument}
	ErrConflict        = &Error{Kind: Conflict}
	ErrSnapshotCorrupt = &Error{Kind: SnapshotCorrupt}
	ErrUnavailable     = &Error{Kind: Unavailable}
)

// Errorf returns an Error of kind whose Err is fmt.Errorf(format, a...).
func Errorf(kind Kind, format string, a ...any) *Error {
	return &Error{Kind: kind, Err: fmt.Errorf(format, a...)}
}

// KindOf returns the Kind of the first Error in err's chain, Internal if there
// is none (or err is nil).
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return Internal
}
