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

// wrongKey is a snapshot encrypted with a key the store was not given
// (*snapshot.KeyError): Conflict, nothing changed; the server must be
// started with that key.
func wrongKey(op, id string, err error) *sandbox.Error {
	return (&sandbox.Error{Kind: sandbox.Conflict, Op: op, SandboxID: id, Err: err}).
		WithHint("start the server with the key the snapshot was encrypted with (as its key, or as an old key while rotating)")
}
