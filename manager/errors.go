package manager

import "github.com/torpor/torpor/sandbox"

// Errors. Every error the manager returns for a caller's mistake or an
// object's state is a *sandbox.Error of kind NotFound, InvalidArgument,
// Conflict or SnapshotCorrupt (errors.Is(err, sandbox.ErrNotFound), …); any
// other error is an internal failure of a part (engine, store, database).

func invalid(format string, a ...any) *sandbox.Error {
	return sandbox.Errorf(sandbox.InvalidArgument, format, a...)
}

func notFound(what, id string) *sandbox.Error {
	return sandbox.Errorf(sandbox.NotFound, "%s %q: not found", what, id)
}

func conflict(format string, a ...any) *sandbox.Error {
	return sandbox.Errorf(sandbox.Conflict, format, a...)
}

// sandboxConflict is conflict about sandbox id (the message names it).
func sandboxConflict(id, format string, a ...any) *sandbox.Error {
	e := conflict(format, a...)
	e.SandboxID = id
	return e
}

// corrupt is a snapshot that failed verification or is missing from the
// store, found by op on sandbox id ("" for none).
func corrupt(op, id string, err error) *sandbox.Error {
	return &sandbox.Error{Kind: sandbox.SnapshotCorrupt, Op: op, SandboxID: id, Err: err}
}
