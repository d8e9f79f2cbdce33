package agent

import (
	"bufio"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/torpor/torpor/guest/proto"
)

// Paths of the resume contract inside a sandbox (Run uses them; Serve takes
// Options.RunDir and Options.HooksDir).
const (
	// RunDir holds the generation, the last resume event, the clock offset and the
	// events socket.
	RunDir = "/run/torpor"
	// HooksDir holds the user's resume hooks, run in lexical order.
	HooksDir = "/etc/torpor/resume.d"
	// GenerationFile, ResumeFile, ClockOffsetFile and EventsSocket are the names
	// of the files in RunDir.
	GenerationFile  = "generation"
	ResumeFile      = "resume.json"
	ClockOffsetFile = "clock_offset_ns"
	EventsSocket    = "events"
)

// Defaults and limits of the resume contract.
const (
	DefaultHookDeadline = 10 * time.Second
	DefaultAckDeadline  = 5 * time.Second
	// ClockThreshold is the skew above which the clock step writes an offset.
	ClockThreshold = 50 * time.Millisecond
	// maxHookOutput truncates a hook's combined output.
	maxHookOutput = 64 << 10
	// maxResumeBody bounds the /resume request body.
	maxResumeBody = 1 << 20
)

// Event is one line of the events socket. "hello" carries only Generation; "start"
// and "resume" carry every field; "subscribed" none. Kind tells a resume's
// cause: "restored" (from a snapshot: a resume or a fork) or "unpaused"
// (continued from the paused tier: same generation, the clocks jumped).
type Event struct {
	Event      string `json:"event"`
	Kind       string `json:"kind,omitempty"`
	Generation int64  `json:"generation"`
	Forked     bool   `json:"forked"`
	HostTime   string `json:"host_time"`
	SnapshotID string `json:"snapshot_id"`
	Seq        int64  `json:"seq"`
}

type helloEvent struct {
	Event      string `json:"event"`
	Generation int64  `json:"generation"`
}

// clientMsg is a line a client writes: a subscription or an ack.
type clientMsg struct {
	Subscribe bool   `json:"subscribe"`
	Name      string `json:"name"`
	Ack       *int64 `json:"ack"`
}

// resumer runs the resume contract and serves the events socket.
type resumer struct {
	runDir   string
	hooksDir string
	srv      *server

	run sync.Mutex // one resume at a time

	mu         sync.Mutex
	generation int64
	seq        int64
	clients    map[*eventClient]struct{}

	// rng is the agent's own user-space random source; it is reseeded from the
	// kernel on every resume (step "reseed").
	rngMu sync.Mutex
	rng   *mrand.ChaCha8
}

type eventClient struct {
	conn net.Conn
	wmu  sync.Mutex // serializes writes

	mu         sync.Mutex
	subscribed bool
	name       string
	acked      int64
	ackc       chan struct{} // signalled on every ack (buffered 1)
	gone       chan struct{} // closed when the connection ends
}

func newResumer(s *server, runDir, hooksDir string) *resumer {
	r := &resumer{runDir: runDir, hooksDir: hooksDir, srv: s, clients: map[*eventClient]struct{}{}}
	var seed [32]byte
	rand.Read(seed[:])
	r.rng = mrand.NewChaCha8(seed)
	if b, err := os.ReadFile(filepath.Join(runDir, GenerationFile)); err == nil {
		r.generation, _ = strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	}
	return r
}

// listen serves the events socket until ln is closed.
func (r *resumer) listen() (net.Listener, error) {
	if err := os.MkdirAll(r.runDir, 0o755); err != nil {
		return nil, err
	}
	path := filepath.Join(r.runDir, EventsSocket)
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	os.Chmod(path, 0o666)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				r.srv.log.Printf("events socket: accept: %v", err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			go r.serveClient(conn)
		}
	}()
	return ln, nil
}

func (r *resumer) serveClient(conn net.Conn) {
	c := &eventClient{conn: conn, ackc: make(chan struct{}, 1), gone: make(chan struct{})}
	r.mu.Lock()
	gen := r.generation
	r.clients[c] = struct{}{}
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.clients, c)
		r.mu.Unlock()
		close(c.gone)
		conn.Close()
	}()
	if c.send(helloEvent{Event: "hello", Generation: gen}, 5*time.Second) != nil {
		return
	}
	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 4096), 64<<10)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var m clientMsg
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			continue
		}
		switch {
		case m.Subscribe:
			c.mu.Lock()
			c.subscribed, c.name = true, m.Name
			c.mu.Unlock()
			if c.send(struct {
				Event string `json:"event"`
			}{"subscribed"}, 5*time.Second) != nil {
				return
			}
		case m.Ack != nil:
			c.mu.Lock()
			if *m.Ack > c.acked {
				c.acked = *m.Ack
			}
			c.mu.Unlock()
			select {
			case c.ackc <- struct{}{}:
			default:
			}
		}
	}
}

func (c *eventClient) send(v any, timeout time.Duration) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.conn.SetWriteDeadline(time.Now().Add(timeout))
	_, err = c.conn.Write(b)
	c.conn.SetWriteDeadline(time.Time{})
	return err
}

func (c *eventClient) state() (subscribed bool, name string, acked int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.subscribed, c.name, c.acked
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// tmpName returns a temporary file name next to path, drawn from the agent's own
// random source (which the reseed step reseeds, so clones do not replay it).
func (r *resumer) tmpName(path string) string {
	r.rngMu.Lock()
	n := r.rng.Uint64()
	r.rngMu.Unlock()
	return filepath.Join(filepath.Dir(path), fmt.Sprintf(".%s.%016x.tmp", filepath.Base(path), n))
}

// writeAtomic replaces path with data (temporary file in the same directory, then
// rename), so a reader sees the old or the new content, never a mix. No fsync:
// the files are in sandbox memory (and in the snapshot) either way.
func (r *resumer) writeAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := r.tmpName(path)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

func (s *server) handleResume(w http.ResponseWriter, req *http.Request) {
	received := time.Now()
	var rq proto.ResumeRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, maxResumeBody)).Decode(&rq); err != nil {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "bad resume request: "+err.Error())
		return
	}
	if rq.HookDeadlineS < 0 || rq.AckDeadlineS < 0 {
		writeError(w, http.StatusBadRequest, proto.CodeInvalidArgument, "deadlines must be >= 0")
		return
	}
	if !rq.Start && !rq.Unpaused {
		// The host's ends of envd's streams did not survive the checkpoint
		// (an unpaused sandbox was never checkpointed: they did).
		if n := s.envd.cutStreams(); n > 0 {
			s.log.Printf("resume: cut %d envd streams opened before the hibernate", n)
		}
		// Nor is the user cache's inotify watch trusted across one.
		userDB.forget()
	}
	if s.resume == nil {
		writeError(w, http.StatusNotFound, proto.CodeNotFound, "resume contract not enabled (no run dir)")
		return
	}
	writeJSON(w, http.StatusOK, s.resume.resume(rq, received))
}

// handlePrepareHibernate ends every open envd stream before the host drains
// the sandbox's requests for a hibernate (proto.PathPrepareHibernate): the
// streams E2B's SDKs keep open (a background command's output, a PTY, a
// watch) never end on their own. Their processes and watches go on.
func (s *server) handlePrepareHibernate(w http.ResponseWriter, req *http.Request) {
	n := s.envd.cutStreams()
	if n > 0 {
		s.log.Printf("hibernate: ended %d envd streams", n)
	}
	writeJSON(w, http.StatusOK, proto.PrepareHibernateReport{Streams: n})
}

// resume runs the contract's steps in their fixed order and returns the report.
// received is when the request arrived: the clock step compares the host's time
// with the sandbox's at that moment, so the skew does not count the steps before it.
func (r *resumer) resume(rq proto.ResumeRequest, received time.Time) proto.ResumeReport {
	r.run.Lock()
	defer r.run.Unlock()
	hookDeadline := time.Duration(rq.HookDeadlineS * float64(time.Second))
	if hookDeadline <= 0 {
		hookDeadline = DefaultHookDeadline
	}
	ackDeadline := time.Duration(rq.AckDeadlineS * float64(time.Second))
	if ackDeadline <= 0 {
		ackDeadline = DefaultAckDeadline
	}
	evName, kind, repName := "resume", "restored", "resume"
	switch {
	case rq.Start:
		evName, kind, repName = "start", "", "start"
	case rq.Unpaused:
		kind, repName = "unpaused", "unpaused"
	}
	rep := proto.ResumeReport{Event: repName, Generation: rq.Generation, Forked: rq.Forked,
		SnapshotID: rq.SnapshotID, Hooks: []proto.ResumeHook{}, OK: true,
		Subscribers: proto.ResumeSubscribers{TimedOut: []string{}}}
	step := func(name string, f func() (string, error)) {
		t0 := time.Now()
		detail, err := f()
		st := proto.ResumeStep{Name: name, MS: ms(time.Since(t0)), OK: err == nil, Detail: detail}
		if err != nil {
			if st.Detail != "" {
				st.Detail += ": "
			}
			st.Detail += err.Error()
			rep.OK = false
		}
		rep.Steps = append(rep.Steps, st)
	}

	r.mu.Lock()
	r.seq++
	ev := Event{Event: evName, Kind: kind, Generation: rq.Generation, Forked: rq.Forked,
		HostTime: rq.HostTime.UTC().Format(time.RFC3339Nano), SnapshotID: rq.SnapshotID, Seq: r.seq}
	r.mu.Unlock()

	// 1. generation: the files first, so nothing that reads them after any event
	// sees the old generation.
	step("generation", func() (string, error) {
		if err := os.MkdirAll(r.runDir, 0o755); err != nil {
			return "", err
		}
		if err := r.writeAtomic(filepath.Join(r.runDir, GenerationFile), []byte(strconv.FormatInt(rq.Generation, 10)+"\n"), 0o644); err != nil {
			return "", err
		}
		b, _ := json.Marshal(ev)
		if err := r.writeAtomic(filepath.Join(r.runDir, ResumeFile), append(b, '\n'), 0o644); err != nil {
			return "", err
		}
		r.mu.Lock()
		r.generation = rq.Generation
		r.mu.Unlock()
		return fmt.Sprintf("generation %d written to %s", rq.Generation, filepath.Join(r.runDir, GenerationFile)), nil
	})

	// 2. reseed: the agent's own user-space random source, from the kernel; and a
	// check that the kernel's getrandom and /dev/urandom answer.
	step("reseed", func() (string, error) {
		var seed [32]byte
		if _, err := rand.Read(seed[:]); err != nil {
			return "getrandom", err
		}
		r.rngMu.Lock()
		r.rng = mrand.NewChaCha8(seed)
		r.rngMu.Unlock()
		f, err := os.Open("/dev/urandom")
		if err != nil {
			return "agent math/rand/v2 source reseeded", err
		}
		defer f.Close()
		var buf [32]byte
		if _, err := io.ReadFull(f, buf[:]); err != nil {
			return "agent math/rand/v2 source reseeded; /dev/urandom", err
		}
		if buf == [32]byte{} {
			return "agent math/rand/v2 source reseeded", errors.New("/dev/urandom gave 32 zero bytes")
		}
		return "agent ChaCha8 source (its only user-space PRNG) reseeded from getrandom; /dev/urandom read 32 bytes", nil
	})

	// 3. clock: gVisor forbids clock_settime (EPERM), so a skew beyond the
	// threshold is published as an offset for the SDKs' time helpers.
	step("clock", func() (string, error) {
		now := received
		if rq.HostTime.IsZero() {
			rep.Clock.Corrected = "none"
			return "no host_time given", r.writeAtomic(filepath.Join(r.runDir, ClockOffsetFile), []byte("0\n"), 0o644)
		}
		skew := now.Sub(rq.HostTime) // sandbox minus host
		rep.Clock.SkewMS = ms(skew)
		var offset time.Duration
		if skew > ClockThreshold || skew < -ClockThreshold {
			offset = -skew
			rep.Clock.Corrected = "offset-file"
		} else {
			rep.Clock.Corrected = "none"
		}
		err := r.writeAtomic(filepath.Join(r.runDir, ClockOffsetFile), []byte(strconv.FormatInt(int64(offset), 10)+"\n"), 0o644)
		return fmt.Sprintf("sandbox clock at arrival - host clock at sending = %.3f ms (includes the transit); offset %d ns", ms(skew), int64(offset)), err
	})

	// 4. notify: send the event to every connected client; wait for subscribers.
	step("notify", func() (string, error) {
		return r.notify(ev, ackDeadline, rq.Start, &rep.Subscribers)
	})

	// 5. hooks (not at first start).
	step("hooks", func() (string, error) {
		if rq.Start {
			return "not run at start", nil
		}
		hooks, err := r.runHooks(rq, hookDeadline)
		rep.Hooks = hooks
		failed := 0
		for _, h := range hooks {
			if h.ExitCode != 0 || h.TimedOut {
				failed++
			}
		}
		detail := fmt.Sprintf("%d hooks run, %d failed", len(hooks), failed)
		if err == nil && failed > 0 {
			err = fmt.Errorf("%d of %d hooks failed or overran", failed, len(hooks))
		}
		return detail, err
	})
	r.srv.log.Printf("resume contract: generation %d forked %v ok %v steps %+v", rq.Generation, rq.Forked, rep.OK, rep.Steps)
	return rep
}

// notify sends ev to every client and waits until every subscriber acknowledged
// ev.Seq or the deadline passed. At start nobody is waited for.
func (r *resumer) notify(ev Event, deadline time.Duration, start bool, sub *proto.ResumeSubscribers) (string, error) {
	r.mu.Lock()
	clients := make([]*eventClient, 0, len(r.clients))
	for c := range r.clients {
		clients = append(clients, c)
	}
	r.mu.Unlock()
	end := time.Now().Add(deadline)
	sent, failed := 0, 0
	var waiting []*eventClient
	for _, c := range clients {
		// A client that does not read can block a write only until the deadline.
		if err := c.send(ev, max(time.Until(end), time.Millisecond)); err != nil {
			failed++
			c.conn.Close()
			if subscribed, name, _ := c.state(); subscribed && !start {
				sub.Total++
				sub.TimedOut = append(sub.TimedOut, name+" (write failed)")
			}
			continue
		}
		sent++
		if subscribed, _, _ := c.state(); subscribed && !start {
			sub.Total++
			waiting = append(waiting, c)
		}
	}
	timer := time.NewTimer(time.Until(end))
	defer timer.Stop()
	for _, c := range waiting {
		_, name, acked := c.state()
	wait:
		for acked < ev.Seq {
			select {
			case <-c.ackc:
				_, _, acked = c.state()
			case <-c.gone:
				name += " (disconnected)"
				break wait
			case <-timer.C:
				timer.Reset(0) // the next waiters see the deadline at once
				break wait
			}
		}
		// An ack may have come with the deadline.
		if _, _, a := c.state(); a >= ev.Seq {
			sub.Acked++
		} else {
			sub.TimedOut = append(sub.TimedOut, name)
		}
	}
	detail := fmt.Sprintf("event %s seq %d sent to %d clients; %d of %d subscribers acked", ev.Event, ev.Seq, sent, sub.Acked, sub.Total)
	if failed > 0 {
		detail += fmt.Sprintf("; %d writes failed", failed)
	}
	if len(sub.TimedOut) > 0 {
		return detail, fmt.Errorf("not acknowledged within %v: %s", deadline, strings.Join(sub.TimedOut, ", "))
	}
	return detail, nil
}

// runHooks runs every executable regular file of the hooks directory in lexical
// order, each bounded by deadline.
func (r *resumer) runHooks(rq proto.ResumeRequest, deadline time.Duration) ([]proto.ResumeHook, error) {
	out := []proto.ResumeHook{}
	ents, err := os.ReadDir(r.hooksDir)
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return out, err
	}
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	forked := "0"
	if rq.Forked {
		forked = "1"
	}
	env, _ := r.srv.childEnv(map[string]string{
		"TORPOR_GENERATION":  strconv.FormatInt(rq.Generation, 10),
		"TORPOR_FORKED":      forked,
		"TORPOR_SNAPSHOT_ID": rq.SnapshotID,
		"TORPOR_RESUME_KIND": resumeKind(rq),
	})
	for _, name := range names {
		path := filepath.Join(r.hooksDir, name)
		st, err := os.Stat(path)
		if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 || strings.HasPrefix(name, ".") {
			continue
		}
		out = append(out, r.runHook(name, path, env, deadline))
	}
	return out, nil
}

func (r *resumer) runHook(name, path string, env []string, deadline time.Duration) proto.ResumeHook {
	t0 := time.Now()
	h := proto.ResumeHook{Name: name}
	done := func() proto.ResumeHook { h.MS = ms(time.Since(t0)); return h }
	pr, pw, err := os.Pipe()
	if err != nil {
		h.ExitCode, h.Output = exitNotStarted, err.Error()
		return done()
	}
	defer pr.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		pw.Close()
		h.ExitCode, h.Output = exitNotStarted, err.Error()
		return done()
	}
	attr := &syscall.ProcAttr{
		Dir:   "/",
		Env:   env,
		Files: []uintptr{null.Fd(), pw.Fd(), pw.Fd()},
		Sys:   &syscall.SysProcAttr{Setpgid: true},
	}
	pid, exitc, err := r.srv.reaper.start(nil, path, []string{path}, attr)
	pw.Close()
	null.Close()
	if err != nil {
		h.ExitCode, h.Output = exitNotStarted, fmt.Sprintf("fork/exec %s: %v", path, err)
		return done()
	}
	var buf []byte
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		b := make([]byte, 32<<10)
		for {
			n, err := pr.Read(b)
			if n > 0 && len(buf) < maxHookOutput {
				buf = append(buf, b[:min(n, maxHookOutput-len(buf))]...)
			}
			if err != nil {
				return
			}
		}
	}()
	timer := time.NewTimer(deadline)
	defer timer.Stop()
	var ws syscall.WaitStatus
	select {
	case ws = <-exitc:
	case <-timer.C:
		h.TimedOut = true
		syscall.Kill(-pid, syscall.SIGKILL)
		ws = <-exitc
	}
	// Processes the hook left in the background (in another group) may hold the
	// pipe open: read what is there for drainWait, no longer.
	pr.SetReadDeadline(time.Now().Add(drainWait))
	<-readDone
	h.ExitCode = exitCode(ws)
	if h.TimedOut {
		h.ExitCode = exitTimeout
	}
	h.Output = strings.ToValidUTF8(string(buf), "\uFFFD")
	if h.TimedOut {
		h.Output += fmt.Sprintf("torpor: hook killed after the %v deadline\n", deadline)
	}
	return done()
}

// resumeKind is a resume's kind for hooks (TORPOR_RESUME_KIND): "unpaused"
// or "restored".
func resumeKind(rq proto.ResumeRequest) string {
	if rq.Unpaused {
		return "unpaused"
	}
	return "restored"
}
