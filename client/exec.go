package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/torpor/torpor/apiv1"
)

// ExecEvents is the answer of an exec call: the process's output events, then a last
// event with its exit code (or pid for a background start). Close it when done.
type ExecEvents struct {
	ctx  context.Context
	body io.ReadCloser
	sc   *bufio.Scanner
	done bool
}

// Exec starts a command in sandbox id and returns its event stream.
func (c *Client) Exec(ctx context.Context, id string, req apiv1.ExecRequest) (*ExecEvents, error) {
	resp, err := c.send(ctx, http.MethodPost, sandboxPath(id, "exec"), req, "")
	if err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 64<<20)
	return &ExecEvents{ctx: ctx, body: resp.Body, sc: sc}, nil
}

// ErrStreamBroken is an exec stream that ended before its last event: the
// connection to the server closed (server stopped or restarted, proxy timeout),
// so the command's exit status is unknown. The CLI exits 255 on it, as for a
// stream the server reports broken (a hibernate's drain cut it).
var ErrStreamBroken = errors.New("exec stream broken: the connection to the server ended before the command's exit status")

// Next returns the next event. After the last event (the one with ExitCode set) it
// returns io.EOF. A stream that ends before its last event gives an error
// matching both ErrStreamBroken and io.ErrUnexpectedEOF (or the context's
// error).
func (s *ExecEvents) Next() (apiv1.ExecEvent, error) {
	if s.done {
		return apiv1.ExecEvent{}, io.EOF
	}
	for s.sc.Scan() {
		line := bytes.TrimSpace(s.sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var ev apiv1.ExecEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			return apiv1.ExecEvent{}, fmt.Errorf("torpor: bad exec event %q: %w", line, err)
		}
		if ev.ExitCode != nil || ev.Pid != 0 || ev.Error != "" {
			s.done = true
		}
		return ev, nil
	}
	s.done = true
	if err := s.ctx.Err(); err != nil {
		return apiv1.ExecEvent{}, err
	}
	if err := s.sc.Err(); err != nil {
		return apiv1.ExecEvent{}, fmt.Errorf("%w: %w", ErrStreamBroken, err)
	}
	return apiv1.ExecEvent{}, fmt.Errorf("%w: %w", ErrStreamBroken, io.ErrUnexpectedEOF)
}

// Close releases the stream. Closing before the last event abandons the output; the
// process keeps running unless the server stops it.
func (s *ExecEvents) Close() error { return s.body.Close() }

// ExecError is returned when the process could not be started (the last event
// carried an error); ExitCode is then 127.
type ExecError struct {
	ExitCode int
	Message  string
}

func (e *ExecError) Error() string { return "torpor: exec: " + e.Message }

// ExecStream runs a command and copies its output to stdout and stderr (either may be
// nil to discard) as it arrives. It returns the process's exit code; for a background
// start it returns 0 once the process started. A process that could not start gives
// exit code 127 and an *ExecError.
func (c *Client) ExecStream(ctx context.Context, id string, req apiv1.ExecRequest, stdout, stderr io.Writer) (exitCode int, err error) {
	_, code, err := c.execTo(ctx, id, req, stdout, stderr)
	return code, err
}

// ExecBackground starts a detached process and returns its pid.
func (c *Client) ExecBackground(ctx context.Context, id string, req apiv1.ExecRequest) (pid int, err error) {
	req.Background = true
	pid, _, err = c.execTo(ctx, id, req, nil, nil)
	return pid, err
}

func (c *Client) execTo(ctx context.Context, id string, req apiv1.ExecRequest, stdout, stderr io.Writer) (pid, exitCode int, err error) {
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	s, err := c.Exec(ctx, id, req)
	if err != nil {
		return 0, -1, err
	}
	defer s.Close()
	for {
		ev, err := s.Next()
		if err != nil {
			return 0, -1, err
		}
		if len(ev.Data) > 0 {
			w := stdout
			if ev.Stream == "stderr" {
				w = stderr
			}
			if _, err := w.Write(ev.Data); err != nil {
				return 0, -1, err
			}
		}
		if ev.Error != "" {
			code := 127
			if ev.ExitCode != nil {
				code = *ev.ExitCode
			}
			return 0, code, &ExecError{ExitCode: code, Message: ev.Error}
		}
		if ev.ExitCode != nil {
			return ev.Pid, *ev.ExitCode, nil
		}
		if ev.Pid != 0 {
			return ev.Pid, 0, nil
		}
	}
}

// ExecCollect runs a command and returns all its output and its exit code.
func (c *Client) ExecCollect(ctx context.Context, id string, req apiv1.ExecRequest) (stdout, stderr []byte, exitCode int, err error) {
	var o, e bytes.Buffer
	exitCode, err = c.ExecStream(ctx, id, req, &o, &e)
	return o.Bytes(), e.Bytes(), exitCode, err
}
