package sandbox

import (
	"errors"
	"fmt"
	"testing"
)

func TestErrorText(t *testing.T) {
	cause := errors.New("snapshot snap-1 file pages.img: checksum mismatch")
	for _, c := range []struct {
		err  *Error
		want string
	}{
		{&Error{Kind: SnapshotCorrupt, Op: "resume", SandboxID: "sbx-1", Err: cause},
			"resume sbx-1: snapshot snap-1 file pages.img: checksum mismatch"},
		{&Error{Kind: Conflict, Op: "fork", Err: errors.New("busy")}, "fork: busy"},
		{&Error{Kind: Conflict, SandboxID: "sbx-1", Err: errors.New("sandbox sbx-1 is in state error"),
			Hint: "resume it explicitly"}, "sandbox sbx-1 is in state error; resume it explicitly"},
		{&Error{Kind: NotFound}, "not found"},
		{Errorf(InvalidArgument, "memory_mib %d: too small", 3), "memory_mib 3: too small"},
	} {
		if got := c.err.Error(); got != c.want {
			t.Errorf("Error() = %q, want %q", got, c.want)
		}
	}
}

func TestErrorKinds(t *testing.T) {
	inner := Errorf(Conflict, "volume data already exists")
	wrapped := fmt.Errorf("fork sbx-1: %w", inner)
	if !errors.Is(wrapped, ErrConflict) || errors.Is(wrapped, ErrNotFound) {
		t.Errorf("errors.Is through a wrap: conflict %v, not found %v", errors.Is(wrapped, ErrConflict), errors.Is(wrapped, ErrNotFound))
	}
	var e *Error
	if !errors.As(wrapped, &e) || e != inner {
		t.Errorf("errors.As found %v", e)
	}
	if k := KindOf(wrapped); k != Conflict {
		t.Errorf("KindOf = %v", k)
	}
	if k := KindOf(errors.New("boom")); k != Internal {
		t.Errorf("KindOf(plain) = %v", k)
	}
	if KindOf(nil) != Internal {
		t.Error("KindOf(nil) is not Internal")
	}
	// The cause stays reachable.
	cause := errors.New("disk full")
	if err := (&Error{Kind: Unavailable, Err: cause}); !errors.Is(err, cause) || !errors.Is(err, ErrUnavailable) {
		t.Errorf("cause or kind lost: %v", err)
	}
	// A sentinel is not matched by an Error with the same kind and more fields
	// when the roles are swapped: only a bare Error is a sentinel.
	if errors.Is(ErrConflict, inner) {
		t.Error("a sentinel matched a specific error as target")
	}
	if got := Kind(42).String(); got != "kind 42" {
		t.Errorf("unknown kind reads %q", got)
	}
}
