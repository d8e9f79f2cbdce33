package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/guest/agent"
	"github.com/torpor/torpor/guest/agentclient"
	"github.com/torpor/torpor/guest/proto"
)

// startResumeAgent serves the agent with the resume contract enabled in fresh run
// and hooks directories (short paths: a unix socket path is at most 107 bytes).
func startResumeAgent(t *testing.T) (c *agentclient.Client, runDir, hooksDir string) {
	t.Helper()
	base, err := os.MkdirTemp("", "ta")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	runDir, hooksDir = filepath.Join(base, "run"), filepath.Join(base, "hooks")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- agent.Serve(ctx, ln, agent.Options{Env: map[string]string{}, RunDir: runDir, HooksDir: hooksDir})
	}()
	c = agentclient.New(agentclient.TCPDialer(ln.Addr().String()))
	t.Cleanup(func() {
		c.CloseIdleConnections()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	if err := c.WaitReady(context.Background(), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	return c, runDir, hooksDir
}

type eventConn struct {
	t    *testing.T
	conn net.Conn
	sc   *bufio.Scanner
}

func dialEvents(t *testing.T, runDir string) *eventConn {
	t.Helper()
	conn, err := net.Dial("unix", filepath.Join(runDir, agent.EventsSocket))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &eventConn{t: t, conn: conn, sc: bufio.NewScanner(conn)}
}

func (e *eventConn) next() map[string]any {
	e.t.Helper()
	e.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if !e.sc.Scan() {
		e.t.Fatalf("events: no line: %v", e.sc.Err())
	}
	var m map[string]any
	if err := json.Unmarshal(e.sc.Bytes(), &m); err != nil {
		e.t.Fatalf("events: bad line %q: %v", e.sc.Text(), err)
	}
	return m
}

func (e *eventConn) send(s string) {
	e.t.Helper()
	if _, err := e.conn.Write([]byte(s + "\n")); err != nil {
		e.t.Fatal(err)
	}
}

func resumeCall(t *testing.T, c *agentclient.Client, req proto.ResumeRequest) proto.ResumeReport {
	t.Helper()
	if req.HostTime.IsZero() {
		req.HostTime = time.Now()
	}
	rep, err := c.Resume(context.Background(), req)
	if err != nil {
		t.Fatalf("resume: %v", err)
	}
	return rep
}

func stepNames(rep proto.ResumeReport) string {
	var n []string
	for _, s := range rep.Steps {
		n = append(n, s.Name)
	}
	return strings.Join(n, ",")
}

func TestResumeContract(t *testing.T) {
	c, runDir, _ := startResumeAgent(t)

	// First start: generation file and a start event; no hooks.
	rep := resumeCall(t, c, proto.ResumeRequest{Generation: 7, Start: true})
	if !rep.OK || rep.Event != "start" || stepNames(rep) != "generation,reseed,clock,notify,hooks" {
		t.Fatalf("start report %+v", rep)
	}
	if b, _ := os.ReadFile(filepath.Join(runDir, agent.GenerationFile)); string(b) != "7\n" {
		t.Fatalf("generation file %q, want 7", b)
	}

	sub := dialEvents(t, runDir)
	if m := sub.next(); m["event"] != "hello" || m["generation"] != 7.0 {
		t.Fatalf("hello %v", m)
	}
	sub.send(`{"subscribe":true,"name":"tester"}`)
	if m := sub.next(); m["event"] != "subscribed" {
		t.Fatalf("subscribe answer %v", m)
	}
	reader := dialEvents(t, runDir) // reads only
	reader.next()

	// The subscriber checks the generation file when it gets the event, then acks.
	gotFile := make(chan string, 1)
	go func() {
		m := sub.next()
		b, _ := os.ReadFile(filepath.Join(runDir, agent.GenerationFile))
		gotFile <- string(b)
		if m["event"] == "resume" {
			sub.send(`{"ack":` + strconv.FormatFloat(m["seq"].(float64), 'f', 0, 64) + `}`)
		}
	}()
	host := time.Now().Add(-2 * time.Second) // a host clock 2 s behind
	rep = resumeCall(t, c, proto.ResumeRequest{Generation: 9, Forked: true, SnapshotID: "snap-x", HostTime: host, AckDeadlineS: 5})
	if f := <-gotFile; f != "9\n" {
		t.Errorf("subscriber saw generation file %q at the event, want 9", f)
	}
	if !rep.OK || rep.Event != "resume" || !rep.Forked || rep.Generation != 9 {
		t.Errorf("report %+v", rep)
	}
	if rep.Subscribers.Total != 1 || rep.Subscribers.Acked != 1 || len(rep.Subscribers.TimedOut) != 0 {
		t.Errorf("subscribers %+v, want 1 of 1 acked", rep.Subscribers)
	}
	m := reader.next()
	if m["event"] != "resume" || m["generation"] != 9.0 || m["forked"] != true || m["snapshot_id"] != "snap-x" ||
		m["host_time"] != host.UTC().Format(time.RFC3339Nano) || m["seq"] == nil {
		t.Errorf("reader got %v", m)
	}
	if rep.Clock.Corrected != "offset-file" || rep.Clock.SkewMS < 1900 || rep.Clock.SkewMS > 3000 {
		t.Errorf("clock %+v, want ~2000 ms skew corrected by offset-file", rep.Clock)
	}
	b, _ := os.ReadFile(filepath.Join(runDir, agent.ClockOffsetFile))
	if off, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); off > -19e8 || off < -3e9 {
		t.Errorf("clock offset file %q, want about -2e9 ns", b)
	}
	b, _ = os.ReadFile(filepath.Join(runDir, agent.ResumeFile))
	var last map[string]any
	if json.Unmarshal(b, &last) != nil || last["generation"] != 9.0 || last["event"] != "resume" {
		t.Errorf("resume.json %q", b)
	}

	// A subscriber that never acks is named in timed_out after the deadline; the
	// resume completes. A small skew writes offset 0.
	mute := dialEvents(t, runDir)
	mute.next()
	mute.send(`{"subscribe":true,"name":"mute"}`)
	mute.next()
	go func() { // sub keeps acking
		for {
			m := sub.next()
			if m["event"] == "resume" {
				sub.send(`{"ack":` + strconv.FormatFloat(m["seq"].(float64), 'f', 0, 64) + `}`)
				return
			}
		}
	}()
	t0 := time.Now()
	rep = resumeCall(t, c, proto.ResumeRequest{Generation: 10, AckDeadlineS: 0.3})
	if d := time.Since(t0); d < 250*time.Millisecond || d > 3*time.Second {
		t.Errorf("resume with a mute subscriber took %v, want about the 0.3 s deadline", d)
	}
	if rep.OK || rep.Subscribers.Total != 2 || rep.Subscribers.Acked != 1 || strings.Join(rep.Subscribers.TimedOut, ",") != "mute" {
		t.Errorf("report ok=%v subscribers %+v, want 2 total, 1 acked, mute timed out", rep.OK, rep.Subscribers)
	}
	if rep.Clock.Corrected != "none" {
		t.Errorf("clock %+v, want none", rep.Clock)
	}
	if b, _ := os.ReadFile(filepath.Join(runDir, agent.ClockOffsetFile)); string(b) != "0\n" {
		t.Errorf("clock offset file %q, want 0", b)
	}
}

func TestResumeHooks(t *testing.T) {
	c, runDir, hooksDir := startResumeAgent(t)
	os.MkdirAll(hooksDir, 0o755)
	hook := func(name, body string, mode os.FileMode) {
		if err := os.WriteFile(filepath.Join(hooksDir, name), []byte("#!/bin/sh\n"+body+"\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	hook("30-env", `echo "gen=$TORPOR_GENERATION forked=$TORPOR_FORKED snap=$TORPOR_SNAPSHOT_ID"; cat `+runDir+`/generation`, 0o755)
	hook("10-fail", "echo out; echo err >&2; exit 3", 0o755)
	hook("20-slow", "echo starting; sleep 30; echo never", 0o755)
	hook("40-noexec", "exit 1", 0o644)
	hook("50-big", "head -c 100000 /dev/zero | tr '\\0' x", 0o755)

	t0 := time.Now()
	rep := resumeCall(t, c, proto.ResumeRequest{Generation: 3, Forked: true, SnapshotID: "snap-h", HookDeadlineS: 0.5})
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("resume took %v", d)
	}
	if rep.OK {
		t.Errorf("report ok with failing hooks")
	}
	if len(rep.Hooks) != 4 {
		t.Fatalf("hooks %+v, want 4 (10-fail, 20-slow, 30-env, 50-big)", rep.Hooks)
	}
	h := rep.Hooks
	if h[0].Name != "10-fail" || h[0].ExitCode != 3 || h[0].TimedOut || h[0].Output != "out\nerr\n" {
		t.Errorf("10-fail: %+v", h[0])
	}
	if h[1].Name != "20-slow" || !h[1].TimedOut || h[1].ExitCode != 124 || !strings.HasPrefix(h[1].Output, "starting\n") || h[1].MS < 450 || h[1].MS > 2000 {
		t.Errorf("20-slow: %+v", h[1])
	}
	if h[2].Name != "30-env" || h[2].ExitCode != 0 || h[2].Output != "gen=3 forked=1 snap=snap-h\n3\n" {
		t.Errorf("30-env: %+v", h[2])
	}
	if h[3].Name != "50-big" || h[3].ExitCode != 0 || len(h[3].Output) != 64<<10 {
		t.Errorf("50-big: exit %d, %d bytes of output, want 65536", h[3].ExitCode, len(h[3].Output))
	}
	last := rep.Steps[len(rep.Steps)-1]
	if last.Name != "hooks" || last.OK {
		t.Errorf("hooks step %+v", last)
	}

	// At start no hook runs.
	rep = resumeCall(t, c, proto.ResumeRequest{Generation: 4, Start: true})
	if len(rep.Hooks) != 0 || !rep.OK {
		t.Errorf("start: %+v", rep)
	}
}
