package agentclient_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// cannedAgent answers every request with one status and body: what a guest
// agent (or whatever listens in its place inside a sandbox) may send back.
type cannedAgent struct {
	mu     sync.Mutex
	status int
	body   []byte
}

func (a *cannedAgent) set(status int, body []byte) {
	a.mu.Lock()
	a.status, a.body = status, body
	a.mu.Unlock()
}

func (a *cannedAgent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	a.mu.Lock()
	status, body := a.status, a.body
	a.mu.Unlock()
	w.WriteHeader(status)
	w.Write(body)
}

var fuzzStatuses = []int{http.StatusOK, http.StatusBadRequest, http.StatusNotFound, http.StatusInternalServerError}

// FuzzAgentAnswers feeds any answer body (with a status of 200, 400, 404 or
// 500) to the host's side of the guest protocol: the sandbox's agent is on
// the far side of an isolation boundary, so its answers are outside bytes.
// Every call returns (no panic, no hang); a non-2xx answer is an *Error with
// its status and a code; a health answer is accepted only with ok true; an
// exec stream ends at its last event (then io.EOF), and Run's output is the
// stream's output.
func FuzzAgentAnswers(f *testing.F) {
	agent := &cannedAgent{}
	srv := httptest.NewServer(agent)
	f.Cleanup(srv.Close)
	c := agentclient.New(agentclient.TCPDialer(srv.Listener.Addr().String()))
	f.Cleanup(c.CloseIdleConnections)

	f.Add(uint8(0), uint8(0), []byte(`{"ok":true,"pid":1,"started_at":"2026-12-01T10:00:00.123456789Z","protocol_version":3,"agent":"torpor-agent (devel)"}`+"\n"))
	f.Add(uint8(1), uint8(0), []byte(`{"stream":"stdout","data":"aGk="}`+"\n"+`{"stream":"stderr","data":"eA=="}`+"\n"+`{"exit_code":3}`+"\n"))
	f.Add(uint8(1), uint8(0), []byte(`{"error":"exec: \"nope\": executable file not found in $PATH","exit_code":127}`+"\n"))
	f.Add(uint8(2), uint8(0), []byte(`{"pid":42}`+"\n"))
	f.Add(uint8(3), uint8(0), []byte(`{"event":"resume","generation":4,"forked":true,"snapshot_id":"snap-1","steps":[{"name":"generation","ms":0.1,"ok":true}],"clock":{"host_time":"2026-12-01T10:00:00Z","guest_before":"2026-12-01T09:00:00Z","skew_ms":3600000,"stepped":true},"subscribers":{"notified":1,"acked":1},"hooks":[{"path":"/etc/torpor/resume.d/a","ok":true,"ms":3,"exit_code":0}],"ok":true}`))
	f.Add(uint8(0), uint8(2), []byte(`{"error":{"code":"not_found","message":"no such file"}}`))
	f.Add(uint8(1), uint8(3), []byte("plain text failure"))
	f.Fuzz(func(t *testing.T, call, status uint8, body []byte) {
		st := fuzzStatuses[int(status)%len(fuzzStatuses)]
		agent.set(st, body)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		switch call % 4 {
		case 0:
			var h agentclient.HealthInfo
			h, err = c.Info(ctx)
			if err == nil && !h.OK {
				t.Fatalf("health %+v accepted without ok", h)
			}
		case 1:
			err = checkExec(t, ctx, c)
		case 2:
			var pid int
			pid, err = c.Start(ctx, proto.ExecRequest{Cmd: []string{"sleep", "1"}})
			if err == nil && pid == 0 {
				t.Fatal("background start accepted without a pid")
			}
		case 3:
			_, err = c.Resume(ctx, proto.ResumeRequest{Generation: 2})
		}
		if ctx.Err() != nil {
			t.Fatalf("call %d did not return: %v", call%4, err)
		}
		var ae *agentclient.Error
		if st != http.StatusOK {
			if !errors.As(err, &ae) || ae.Status != st || ae.Code == "" || ae.Message == "" {
				t.Fatalf("status %d answered as %v, want an *Error with the status, a code and a message", st, err)
			}
		} else if errors.As(err, &ae) {
			t.Fatalf("a 200 answered as an agent error %v", err)
		}
	})
}

// checkExec reads the canned exec answer twice, event by event and with Run,
// and checks that they agree.
func checkExec(t *testing.T, ctx context.Context, c *agentclient.Client) error {
	req := proto.ExecRequest{Cmd: []string{"true"}}
	s, err := c.Exec(ctx, req)
	if err != nil {
		return err
	}
	var stdout, stderr []byte
	var last *proto.ExecEvent
	for {
		ev, err := s.Next()
		if err != nil {
			s.Close()
			if last != nil && err != io.EOF {
				t.Fatalf("after the last event %+v: %v, want io.EOF", *last, err)
			}
			if last == nil && err == io.EOF {
				t.Fatal("io.EOF before the last event")
			}
			break
		}
		if last != nil {
			t.Fatalf("event %+v after the last one", ev)
		}
		switch ev.Stream {
		case "stdout":
			stdout = append(stdout, ev.Data...)
		case "stderr":
			stderr = append(stderr, ev.Data...)
		}
		if ev.Last() {
			last = &ev
		}
	}
	out, errOut, code, err := c.Run(ctx, req)
	if last == nil {
		if err == nil {
			t.Fatalf("Run succeeded (exit %d) on a stream without a last event", code)
		}
		return err
	}
	if !bytes.Equal(out, stdout) || !bytes.Equal(errOut, stderr) {
		t.Fatalf("Run's output %q %q, the stream's %q %q", out, errOut, stdout, stderr)
	}
	var se *agentclient.StartError
	switch {
	case last.Error != "":
		if !errors.As(err, &se) || se.Message != last.Error {
			t.Fatalf("last event %+v: Run error %v", *last, err)
		}
	case last.ExitCode != nil:
		if err != nil || code != *last.ExitCode {
			t.Fatalf("last event %+v: Run exit %d, %v", *last, code, err)
		}
	default: // a background start's pid
		if err != nil || code != 0 {
			t.Fatalf("last event %+v: Run exit %d, %v", *last, code, err)
		}
	}
	return nil
}

// An agent error answer with a code and no message was an error that said
// nothing ("torpor agent: not_found:  (HTTP 404)"); it names the HTTP status
// instead (found by FuzzAgentAnswers).
func TestErrorWithoutMessageNamesStatus(t *testing.T) {
	agent := &cannedAgent{}
	agent.set(http.StatusNotFound, []byte(`{"error":{"code":"not_found"}}`))
	srv := httptest.NewServer(agent)
	defer srv.Close()
	c := agentclient.New(agentclient.TCPDialer(srv.Listener.Addr().String()))
	defer c.CloseIdleConnections()
	_, err := c.Info(context.Background())
	var ae *agentclient.Error
	if !errors.As(err, &ae) || ae.Code != "not_found" || ae.Message != "404 Not Found" {
		t.Fatalf("Info: %v, want not_found with the status as its message", err)
	}
}
