package manager

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// EnvdRoundTrip sends req, a request written for E2B's envd (its own paths:
// "/files", "/process.Process/Start", …; see agentclient.EnvdTransport), to
// sandbox id's guest agent and returns the agent's answer, waking the sandbox
// if hibernated: the request is sent after the resume contract ran.
//
// The request goes over the live agent client's envd connections, which are
// kept alive between requests, as torpor's own calls' are. It holds the
// sandbox's lock until it has a connection (no hibernate, resume or delete
// comes between the choice of instance and the request reaching it) and counts
// as a request in flight, as DialPort's connections do, from the call until
// the answer's body is closed; an idle connection counts for nothing, so it
// holds neither a hibernate's drain nor the idle policy, and the hibernate
// closes it with the agent client's other idle connections before its
// checkpoint. A request in flight is cut when the sandbox hibernates
// (after the drain) or stops.
//
// check, when not nil, is called first on the sandbox's RequestState as read
// under the lock (the one read of its record; a front need not read it
// before), and its error is returned with nothing sent.
//
// Errors: check's; those of lockRunning; agentclient.ErrNoEnvd when the
// sandbox's agent predates envd; the transport's.
func (m *Manager) EnvdRoundTrip(id string, req *http.Request, check func(RequestState) error) (*http.Response, error) {
	ctx := req.Context()
	_, ac, unlock, err := m.lockEnvd(ctx, id, check)
	if err != nil {
		return nil, err
	}
	var once sync.Once
	release := func() { once.Do(unlock) }
	defer release()
	m.addOpen(id, 1, 0)
	trace := &httptrace.ClientTrace{GotConn: func(httptrace.GotConnInfo) { release() }}
	resp, err := ac.EnvdTransport().RoundTrip(req.WithContext(httptrace.WithClientTrace(ctx, trace)))
	if err != nil {
		m.addOpen(id, -1, 0)
		return nil, err
	}
	resp.Body = &countedBody{ReadCloser: resp.Body, done: func() { m.addOpen(id, -1, 0) }}
	return resp, nil
}

// lockEnvd is lockRunningChecked (check may be nil) for a request to sandbox
// id's envd: it also returns the live agent client, with the lock held.
// Errors: lockRunningChecked's; sandbox.ErrConflict without an agent
// connection; agentclient.ErrNoEnvd when the agent predates envd.
func (m *Manager) lockEnvd(ctx context.Context, id string, check func(RequestState) error) (*metadata.Sandbox, *agentclient.Client, func(), error) {
	s, unlock, err := m.lockRunningChecked(ctx, id, check)
	if err != nil {
		return nil, nil, nil, err
	}
	ac := m.liveClient(id)
	if ac == nil {
		unlock()
		return nil, nil, nil, conflict("sandbox %s: no guest agent connection", id)
	}
	if err := ac.Envd(); err != nil {
		unlock()
		return nil, nil, nil, fmt.Errorf("sandbox %s: %w", id, err)
	}
	return s, ac, unlock, nil
}

// countedBody is an answer's body that calls done once, when closed.
type countedBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *countedBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.done)
	return err
}

// RequestState is what a front checks of a sandbox before it forwards a
// request into it (RequestStateOf, or EnvdRoundTrip's check).
type RequestState struct {
	State           sandbox.State
	ResumeOnRequest bool
	// PrivateTraffic: requests to its ports need its traffic access token
	// (sandbox.Network).
	PrivateTraffic bool
	Error          string // why it is in state error; "" otherwise
}

// RequestStateOf returns sandbox id's RequestState from its record alone: one
// read of the database, where Get also builds the sandbox's policy, usage and
// snapshot views. Errors: sandbox.ErrNotFound.
func (m *Manager) RequestStateOf(ctx context.Context, id string) (RequestState, error) {
	s, err := m.get(ctx, id)
	if err != nil {
		return RequestState{}, err
	}
	return requestStateOf(s), nil
}

func requestStateOf(s *metadata.Sandbox) RequestState {
	return RequestState{State: s.State, ResumeOnRequest: s.ResumeOnRequest, PrivateTraffic: s.Network.PrivateTraffic, Error: s.Error}
}
