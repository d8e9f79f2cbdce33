package manager

import (
	"errors"
	"strings"
	"testing"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/sandbox"
)

// TestAgentErr: the guest agent's answers to file calls map to the manager's
// kinds; internal errors the path caused (an agent answers them as Go's
// *fs.PathError text) become invalid arguments naming the path.
func TestAgentErr(t *testing.T) {
	other := errors.New("connection reset")
	for _, c := range []struct {
		err  error
		kind sandbox.Kind
		want string // in the message
	}{
		{&agentclient.Error{Status: 404, Code: "not_found", Message: "open /x: no such file or directory"}, sandbox.NotFound, "no such file"},
		{&agentclient.Error{Status: 400, Code: "invalid_argument", Message: "/tmp is a directory"}, sandbox.InvalidArgument, "is a directory"},
		{&agentclient.Error{Status: 500, Code: "internal", Message: "open /tmp/l/.torpor-put-1: read-only file system"}, sandbox.InvalidArgument, `path "/p": it is in a read-only place`},
		{&agentclient.Error{Status: 500, Code: "internal", Message: "open /a/b: file name too long"}, sandbox.InvalidArgument, "too long"},
		{&agentclient.Error{Status: 500, Code: "internal", Message: "open /tmp/loop: too many levels of symbolic links"}, sandbox.InvalidArgument, "symbolic links"},
		{&agentclient.Error{Status: 500, Code: "internal", Message: "mkdir /tmp/dangling: file exists"}, sandbox.InvalidArgument, "no directory"},
		{&agentclient.Error{Status: 500, Code: "internal", Message: "write /tmp/x: no space left on device"}, sandbox.Internal, "no space"},
		{other, sandbox.Internal, "connection reset"},
	} {
		got := agentErr("/p", c.err)
		if sandbox.KindOf(got) != c.kind || !strings.Contains(got.Error(), c.want) {
			t.Errorf("agentErr(%v) = %v (kind %v), want kind %v containing %q", c.err, got, sandbox.KindOf(got), c.kind, c.want)
		}
	}
}
