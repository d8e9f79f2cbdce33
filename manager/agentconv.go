package manager

import (
	"context"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// The guest agent speaks its own protocol (package guest/proto), versioned apart
// from the manager's types because agents live on in snapshots; this file is the
// one place that converts between the two.

// agentExec is req in the agent's protocol.
func agentExec(req apiv1.ExecRequest) proto.ExecRequest {
	return proto.ExecRequest{Cmd: req.Cmd, Env: req.Env, Cwd: req.Cwd, Stdin: req.Stdin,
		TimeoutS: req.TimeoutS, Background: req.Background}
}

// execEvent is the agent's exec event ev in the manager's types.
func execEvent(ev proto.ExecEvent) apiv1.ExecEvent {
	return apiv1.ExecEvent{Stream: ev.Stream, Data: ev.Data, ExitCode: ev.ExitCode, Pid: ev.Pid, Error: ev.Error}
}

// Next returns the stream's next event (see agentclient.ExecStream.Next).
func (s *ExecStream) Next() (apiv1.ExecEvent, error) {
	ev, err := s.ExecStream.Next()
	return execEvent(ev), err
}

// resumeAgent runs the resume contract through c (agentclient.Client.Resume),
// converting req and the report. The host-measured fields of the report
// (WindowMS, AgentMS, Error) are left for the caller.
func resumeAgent(ctx context.Context, c *agentclient.Client, req apiv1.ResumeRequest) (apiv1.ResumeReport, error) {
	rep, err := c.Resume(ctx, proto.ResumeRequest{Generation: req.Generation, Forked: req.Forked,
		SnapshotID: req.SnapshotID, HostTime: req.HostTime, HookDeadlineS: req.HookDeadlineS,
		AckDeadlineS: req.AckDeadlineS, Start: req.Start})
	if err != nil {
		return apiv1.ResumeReport{}, err
	}
	out := apiv1.ResumeReport{Event: rep.Event, Generation: rep.Generation, Forked: rep.Forked,
		SnapshotID: rep.SnapshotID, OK: rep.OK,
		Clock: apiv1.ResumeClock{SkewMS: rep.Clock.SkewMS, Corrected: rep.Clock.Corrected},
		Subscribers: apiv1.ResumeSubscribers{Total: rep.Subscribers.Total, Acked: rep.Subscribers.Acked,
			TimedOut: rep.Subscribers.TimedOut}}
	if rep.Steps != nil {
		out.Steps = make([]apiv1.ResumeStep, len(rep.Steps))
		for i, st := range rep.Steps {
			out.Steps[i] = apiv1.ResumeStep{Name: st.Name, MS: st.MS, OK: st.OK, Detail: st.Detail}
		}
	}
	if rep.Hooks != nil {
		out.Hooks = make([]apiv1.ResumeHook, len(rep.Hooks))
		for i, h := range rep.Hooks {
			out.Hooks[i] = apiv1.ResumeHook{Name: h.Name, ExitCode: h.ExitCode, MS: h.MS, TimedOut: h.TimedOut, Output: h.Output}
		}
	}
	return out, nil
}

// AgentProtocolVersion returns the guest agent protocol version (package
// guest/proto) of running sandbox id's agent, learnt when it became ready: the
// version of the agent its snapshot was taken with, for a resumed one. Errors:
// ErrConflict when the sandbox has no live agent connection (not running).
func (m *Manager) AgentProtocolVersion(id string) (int, error) {
	c := m.liveClient(id)
	if c == nil {
		return 0, conflict("sandbox %s: no guest agent connection", id)
	}
	return c.ProtocolVersion(), nil
}
