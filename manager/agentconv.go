package manager

import (
	"context"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/sandbox"
)

// The guest agent's client speaks the host-guest protocol in apiv1's types.
// This file is the only place in the manager that sees them: it converts
// between them and the domain types (package sandbox) at each call.

// guestRun runs cmd in the guest and collects its output (agentclient.Run).
func guestRun(ctx context.Context, c *agentclient.Client, cmd []string) (stdout, stderr []byte, exitCode int, err error) {
	return c.Run(ctx, apiv1.ExecRequest{Cmd: cmd})
}

// guestStart starts cmd detached in the guest and returns its pid (agentclient.Start).
func guestStart(ctx context.Context, c *agentclient.Client, cmd []string) (int, error) {
	return c.Start(ctx, apiv1.ExecRequest{Cmd: cmd, Background: true})
}

// guestExec starts req in the guest and returns its event stream (agentclient.Exec).
func guestExec(ctx context.Context, c *agentclient.Client, req sandbox.ExecRequest) (*agentclient.ExecStream, error) {
	return c.Exec(ctx, apiv1.ExecRequest(req))
}

// guestNext reads the next event of an exec stream (agentclient.ExecStream.Next).
func guestNext(st *agentclient.ExecStream) (sandbox.ExecEvent, error) {
	ev, err := st.Next()
	return sandbox.ExecEvent(ev), err
}

// guestResume is the host's half of the resume contract (agentclient.Resume):
// the guest gets generation gen, whether it is a clone, the snapshot restored,
// whether this is its first start, the host's time and the deadlines.
func guestResume(ctx context.Context, c *agentclient.Client, gen int64, forked, start bool, snapshotID string,
	hookDeadline, ackDeadline time.Duration) (sandbox.ResumeReport, error) {
	rep, err := c.Resume(ctx, apiv1.ResumeRequest{
		Generation: gen, Forked: forked, SnapshotID: snapshotID, Start: start, HostTime: time.Now().UTC(),
		HookDeadlineS: hookDeadline.Seconds(), AckDeadlineS: ackDeadline.Seconds(),
	})
	out := sandbox.ResumeReport{Event: rep.Event, Generation: rep.Generation, Forked: rep.Forked,
		SnapshotID: rep.SnapshotID, OK: rep.OK, WindowMS: rep.WindowMS, AgentMS: rep.AgentMS, Error: rep.Error,
		Clock: sandbox.ResumeClock(rep.Clock), Subscribers: sandbox.ResumeSubscribers(rep.Subscribers),
	}
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
	return out, err
}
