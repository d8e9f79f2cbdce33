package manager

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"time"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/sandbox"
)

// The guest agent speaks its own protocol (package guest/proto), versioned apart
// from the manager's types because agents live on in snapshots; this file is the
// one place that converts between the two. Types whose fields are the same on
// both sides are converted directly, so a field added to one side only stops the
// build here.

// guestExec starts req in the guest and returns its event stream (agentclient.Exec).
func guestExec(ctx context.Context, c *agentclient.Client, req sandbox.ExecRequest) (*agentclient.ExecStream, error) {
	return c.Exec(ctx, proto.ExecRequest(req))
}

// guestNext reads the next event of an exec stream (agentclient.ExecStream.Next).
func guestNext(st *agentclient.ExecStream) (sandbox.ExecEvent, error) {
	ev, err := st.Next()
	return sandbox.ExecEvent(ev), err
}

// guestResume is the host's half of the resume contract (agentclient.Resume):
// the guest gets generation gen, whether it is a clone, the snapshot restored,
// whether this is its first start, the host's time and the deadlines. The
// host-measured fields of the report (WindowMS, AgentMS, Error) are left for
// the caller.
func guestResume(ctx context.Context, c *agentclient.Client, rq proto.ResumeRequest,
	hookDeadline, ackDeadline time.Duration) (sandbox.ResumeReport, error) {
	rq.HostTime = time.Now().UTC()
	rq.HookDeadlineS, rq.AckDeadlineS = hookDeadline.Seconds(), ackDeadline.Seconds()
	rep, err := c.Resume(ctx, rq)
	if err != nil {
		return sandbox.ResumeReport{}, err
	}
	out := sandbox.ResumeReport{Event: rep.Event, Generation: rep.Generation, Forked: rep.Forked,
		SnapshotID: rep.SnapshotID, OK: rep.OK,
		Clock: sandbox.ResumeClock(rep.Clock), Subscribers: sandbox.ResumeSubscribers(rep.Subscribers)}
	if rep.Steps != nil { // nil and empty stay apart: the API shows null or []
		out.Steps = make([]sandbox.ResumeStep, len(rep.Steps))
		for i, st := range rep.Steps {
			out.Steps[i] = sandbox.ResumeStep(st)
		}
	}
	if rep.Hooks != nil {
		out.Hooks = make([]sandbox.ResumeHook, len(rep.Hooks))
		for i, h := range rep.Hooks {
			out.Hooks[i] = sandbox.ResumeHook(h)
		}
	}
	return out, nil
}

// AgentProtocolVersion returns the guest agent protocol version (package
// guest/proto) of running sandbox id's agent, learnt when it became ready: the
// version of the agent its snapshot was taken with, for a resumed one. Errors:
// sandbox.ErrConflict when the sandbox has no live agent connection (not
// running).
func (m *Manager) AgentProtocolVersion(id string) (int, error) {
	c := m.liveClient(id)
	if c == nil {
		return 0, sandboxConflict(id, "sandbox %s: no guest agent connection", id)
	}
	return c.ProtocolVersion(), nil
}

// pathErrnos are the errors of a file call on path that the path itself
// causes, with what they mean for it. Guest agents (every version, as they live
// on in snapshots) answer them as internal errors whose message is Go's
// *fs.PathError text, "<op> <file>: <errno text>"; agentErr answers them as
// invalid arguments.
var pathErrnos = []struct {
	errno syscall.Errno
	why   string
}{
	{syscall.EROFS, "it is in a read-only place (a symlink on the path may lead into one, such as /.torpor)"},
	{syscall.ENAMETOOLONG, "it or a name in it is too long"},
	{syscall.ELOOP, "it has too many levels of symbolic links"},
	// A PUT's missing parent that cannot be made: a name on the path is a
	// symlink that leads nowhere (or into a loop).
	{syscall.EEXIST, "a name on its path exists but is no directory (a dangling or looping symlink?)"},
}

// agentErr maps the guest agent's error answer to a file call on path to the
// manager's kinds: not_found and invalid_argument as they are, and an internal
// error that path caused (pathErrnos) as sandbox.InvalidArgument naming path.
// Other errors are returned as they are.
func agentErr(path string, err error) error {
	var ae *agentclient.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case proto.CodeNotFound:
			return &sandbox.Error{Kind: sandbox.NotFound, Err: errors.New(ae.Message)}
		case proto.CodeInvalidArgument:
			return &sandbox.Error{Kind: sandbox.InvalidArgument, Err: errors.New(ae.Message)}
		case proto.CodeInternal:
			for _, pe := range pathErrnos {
				if strings.HasSuffix(ae.Message, ": "+pe.errno.Error()) {
					return invalid("path %q: %s (%s)", path, pe.why, ae.Message)
				}
			}
		}
	}
	return err
}

// req is the agent's request for cc (guestResume sets the time and deadlines).
func (cc contractCall) req() proto.ResumeRequest {
	return proto.ResumeRequest{Generation: cc.gen, Forked: cc.forked, SnapshotID: cc.snapshotID,
		Start: cc.start, Unpaused: cc.unpaused}
}
