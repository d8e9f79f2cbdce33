// Package agentclient is the host side of the guest agent protocol (package
// guest/proto, served by package guest/agent): a Go client that reaches one
// sandbox's agent through a caller-supplied dial function and keeps its
// connections alive.
//
// The agent of a resumed sandbox is the one its snapshot was taken with, so it
// may speak an older protocol version than this package's proto.Version. The
// client learns the version once, in WaitReady (from the health answer; no
// extra round trip per call), exposes it as ProtocolVersion, refuses a version
// outside proto.MinVersion..proto.Version (ErrUnsupportedVersion), and serves
// each call on the path the agent's version has. Every call of this package is
// served by every supported version (protocol version 2 added only the version
// report itself), except E2B's envd, which protocol version 3 added: Envd
// tells whether the agent serves it (ErrNoEnvd, at once, for an older agent),
// and EnvdTransport carries envd's requests to it.
package agentclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/torpor/torpor/guest/proto"
)

// baseURL is the URL prefix of every request; the host name is never resolved, the
// dial function decides where connections go.
const baseURL = "http://torpor-agent"

// Client talks to one agent. It is safe for concurrent use.
type Client struct {
	tr *http.Transport
	hc *http.Client
	// envd carries E2B's envd requests (EnvdTransport), on its own pool of
	// connections made by the same dial function.
	envd *EnvdTransport
	// version is the agent's protocol version, learnt by WaitReady (0 before).
	version atomic.Int32
	agent   atomic.Pointer[string]
}

// New returns a client whose connections are made by dial (for a sandbox: a TCP
// connection to the sandbox IP, port 49983, made from the sandbox's network namespace).
// Connections are kept alive, at most 4 idle ones for torpor's own calls and
// 4 more for envd's (EnvdTransport).
func New(dial func(ctx context.Context) (net.Conn, error)) *Client {
	tr := newTransport(dial, 90*time.Second)
	return &Client{tr: tr, hc: &http.Client{Transport: tr}, envd: NewEnvdTransport(dial)}
}

// newTransport is an HTTP/1.1 transport whose connections dial makes, keeping
// at most 4 idle ones for idle each, with no compression of its own.
func newTransport(dial func(ctx context.Context) (net.Conn, error), idle time.Duration) *http.Transport {
	return &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		},
		MaxIdleConns:        4,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     idle,
		DisableCompression:  true,
	}
}

// TCPDialer returns a dial function for New that makes TCP connections to addr
// ("host:port") from the caller's own network namespace.
func TCPDialer(addr string) func(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", addr)
	}
}

// CloseIdleConnections closes the client's idle connections, envd's included
// (e.g. before the sandbox is hibernated). Later calls dial again.
func (c *Client) CloseIdleConnections() {
	c.tr.CloseIdleConnections()
	c.envd.CloseIdleConnections()
}

// EnvdTransport returns the transport of the client's envd requests
// (EnvdTransport: envd's own paths, rewritten with proto.EnvdPath), whose
// connections are made by the client's dial function and kept alive between
// requests, at most 4 idle ones for 30 s; CloseIdleConnections closes them.
// Whether the agent serves envd at all is Envd's to say.
func (c *Client) EnvdTransport() *EnvdTransport { return c.envd }

// ErrUnsupportedVersion is the error (via errors.Is) of an agent whose protocol
// version this host does not speak: below proto.MinVersion or above proto.Version.
var ErrUnsupportedVersion = errors.New("unsupported guest agent protocol version")

// VersionError says which version an agent reported and which this host speaks.
// It matches ErrUnsupportedVersion.
type VersionError struct {
	Version  int    // the agent's protocol version
	Agent    string // the agent's build, as it reported it ("" before version 2)
	Min, Max int    // proto.MinVersion, proto.Version
}

func (e *VersionError) Error() string {
	s := fmt.Sprintf("torpor agent speaks protocol version %d", e.Version)
	if e.Agent != "" {
		s += " (" + e.Agent + ")"
	}
	return s + fmt.Sprintf("; this host speaks versions %d to %d: %v", e.Min, e.Max, ErrUnsupportedVersion)
}

func (e *VersionError) Is(target error) bool { return target == ErrUnsupportedVersion }

// Error is an error answer of the agent: HTTP status, proto error code ("not_found",
// "invalid_argument", "internal", …) and message.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("torpor agent: %s: %s (HTTP %d)", e.Code, e.Message, e.Status)
}

// IsNotFound reports whether err is an agent answer with code "not_found".
func IsNotFound(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == proto.CodeNotFound
}

// StartError says the agent could not start a command (not found, bad cwd, …); the
// exec's exit code is 127.
type StartError struct {
	Message string
}

func (e *StartError) Error() string { return "torpor agent: cannot start command: " + e.Message }

// errorFrom turns a non-2xx response into an *Error and closes its body.
func errorFrom(resp *http.Response) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var eb proto.ErrorBody
	if json.Unmarshal(b, &eb) == nil && eb.Error.Code != "" {
		msg := eb.Error.Message
		if msg == "" {
			msg = resp.Status // an error that says nothing still names its status
		}
		return &Error{Status: resp.StatusCode, Code: eb.Error.Code, Message: msg}
	}
	code := proto.CodeInternal
	switch resp.StatusCode {
	case http.StatusNotFound:
		code = proto.CodeNotFound
	case http.StatusBadRequest:
		code = proto.CodeInvalidArgument
	}
	msg := strings.TrimSpace(string(b))
	if msg == "" {
		msg = resp.Status
	}
	return &Error{Status: resp.StatusCode, Code: code, Message: msg}
}

func (c *Client) do(ctx context.Context, method, path string, body io.Reader, size int64, ctype string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, baseURL+path, body)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.ContentLength = size
		if size == 0 {
			req.Body = http.NoBody
		}
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return nil, errorFrom(resp)
	}
	return resp, nil
}

// HealthInfo is the body of GET /health.
type HealthInfo = proto.Health

// Info returns the agent's health answer: its pid (1 in a sandbox), start time
// and (since protocol version 2) its protocol version and build; proto.VersionOf
// reads the version of an answer that has none.
func (c *Client) Info(ctx context.Context) (HealthInfo, error) {
	var h HealthInfo
	resp, err := c.do(ctx, http.MethodGet, proto.PathHealth, nil, 0, "")
	if err != nil {
		return h, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		return h, fmt.Errorf("torpor agent: health: %w", err)
	}
	io.Copy(io.Discard, resp.Body)
	if !h.OK {
		return h, errors.New("torpor agent: health: not ok")
	}
	return h, nil
}

// Health returns nil if the agent answers GET /health with ok.
func (c *Client) Health(ctx context.Context) error {
	_, err := c.Info(ctx)
	return err
}

// WaitReady polls Info until it succeeds, ctx is done or timeout passes; it polls
// every 5 ms at first, backing off to every 50 ms. Each attempt is bounded by 1 s.
// On failure it returns the last Info error. The answer's protocol version (1 when
// absent) becomes ProtocolVersion; a version outside proto.MinVersion..proto.Version
// is a *VersionError (ErrUnsupportedVersion) at once, without further polling.
func (c *Client) WaitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	delay := 5 * time.Millisecond
	for {
		actx, acancel := context.WithTimeout(ctx, time.Second)
		h, err := c.Info(actx)
		acancel()
		if err == nil {
			v := proto.VersionOf(h)
			if v < proto.MinVersion || v > proto.Version {
				return &VersionError{Version: v, Agent: h.Agent, Min: proto.MinVersion, Max: proto.Version}
			}
			c.agent.Store(&h.Agent)
			c.version.Store(int32(v))
			return nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("torpor agent not ready after %v: %w", timeout, err)
		case <-t.C:
		}
		if delay = delay * 3 / 2; delay > 50*time.Millisecond {
			delay = 50 * time.Millisecond
		}
	}
}

// ProtocolVersion returns the protocol version of the agent, as learnt by the last
// successful WaitReady: between proto.MinVersion and proto.Version; 0 before.
func (c *Client) ProtocolVersion() int { return int(c.version.Load()) }

// AgentBuild returns the build the agent reported at WaitReady (e.g.
// "torpor-agent (devel) vcs.revision=…"); "" before, or for a version 1 agent,
// which reports none.
func (c *Client) AgentBuild() string {
	if p := c.agent.Load(); p != nil {
		return *p
	}
	return ""
}

// ExecStream is a running exec's answer, read event by event. Close it when done;
// closing it before the last event drops the connection, which makes the agent kill
// the command's process group.
type ExecStream struct {
	body io.ReadCloser
	dec  *json.Decoder
	done bool
	err  error
}

// Exec starts req in the sandbox and returns its event stream. An agent error answer
// (e.g. empty cmd: 400 invalid_argument) is an *Error. A command that cannot be
// started is not an error here: the stream's only event carries Error and exit code 127.
func (c *Client) Exec(ctx context.Context, req proto.ExecRequest) (*ExecStream, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	resp, err := c.do(ctx, http.MethodPost, proto.PathExec, bytes.NewReader(b), int64(len(b)), proto.ContentTypeJSON)
	if err != nil {
		return nil, err
	}
	return &ExecStream{body: resp.Body, dec: json.NewDecoder(resp.Body)}, nil
}

// Next returns the next event: output chunks (Stream, Data), then a last event with
// ExitCode (foreground), Pid (background start) or Error (not started). After the last
// event it returns io.EOF; if the stream breaks before it, io.ErrUnexpectedEOF or the
// read error.
func (s *ExecStream) Next() (proto.ExecEvent, error) {
	var ev proto.ExecEvent
	if s.done {
		return ev, io.EOF
	}
	if s.err != nil {
		return ev, s.err
	}
	if err := s.dec.Decode(&ev); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		s.err = err
		return proto.ExecEvent{}, err
	}
	if ev.Last() {
		s.done = true
		// Read to the end so the connection goes back to the idle pool.
		io.Copy(io.Discard, io.LimitReader(s.body, 4096))
	}
	return ev, nil
}

// Close releases the stream.
func (s *ExecStream) Close() error { return s.body.Close() }

// Run executes req and collects its output. exitCode is the command's exit code (124
// on timeout, 128+sig when killed by a signal). If the command could not be started,
// err is a *StartError and exitCode 127. For a background start use Start.
func (c *Client) Run(ctx context.Context, req proto.ExecRequest) (stdout, stderr []byte, exitCode int, err error) {
	st, err := c.Exec(ctx, req)
	if err != nil {
		return nil, nil, -1, err
	}
	defer st.Close()
	var out, errb bytes.Buffer
	for {
		ev, err := st.Next()
		if err != nil {
			return out.Bytes(), errb.Bytes(), -1, err
		}
		switch ev.Stream {
		case "stdout":
			out.Write(ev.Data)
		case "stderr":
			errb.Write(ev.Data)
		}
		if ev.Error != "" {
			code := 127
			if ev.ExitCode != nil {
				code = *ev.ExitCode
			}
			return out.Bytes(), errb.Bytes(), code, &StartError{Message: ev.Error}
		}
		if ev.ExitCode != nil {
			return out.Bytes(), errb.Bytes(), *ev.ExitCode, nil
		}
		if ev.Pid != 0 {
			return out.Bytes(), errb.Bytes(), 0, nil
		}
	}
}

// Start runs req in the background (it sets req.Background) and returns the pid of
// the detached process; its output goes to /tmp/torpor-bg-<pid>.log in the sandbox.
func (c *Client) Start(ctx context.Context, req proto.ExecRequest) (int, error) {
	req.Background = true
	st, err := c.Exec(ctx, req)
	if err != nil {
		return 0, err
	}
	defer st.Close()
	ev, err := st.Next()
	if err != nil {
		return 0, err
	}
	if ev.Error != "" {
		return 0, &StartError{Message: ev.Error}
	}
	if ev.Pid == 0 {
		return 0, errors.New("torpor agent: background start answered without a pid")
	}
	return ev.Pid, nil
}

// ReadFile opens the sandbox file at path (absolute) and returns its content and size
// in bytes. The caller must close the reader. Missing: *Error with code "not_found";
// relative path or directory: "invalid_argument".
func (c *Client) ReadFile(ctx context.Context, path string) (io.ReadCloser, int64, error) {
	resp, err := c.do(ctx, http.MethodGet, filesURL(path, ""), nil, 0, "")
	if err != nil {
		return nil, 0, err
	}
	return resp.Body, resp.ContentLength, nil
}

// WriteFile replaces the sandbox file at path (absolute) with size bytes read from r
// (size < 0: unknown, sent chunked), atomically, with mode 0644, creating missing
// parent directories. Relative path or directory: *Error "invalid_argument".
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, size int64) error {
	return c.WriteFileMode(ctx, path, r, size, 0o644)
}

// WriteFileMode is WriteFile with the file's permission bits (e.g. 0755).
func (c *Client) WriteFileMode(ctx context.Context, path string, r io.Reader, size int64, mode uint32) error {
	if r == nil {
		r = http.NoBody
	}
	resp, err := c.do(ctx, http.MethodPut, filesURL(path, strconv.FormatUint(uint64(mode&0o7777), 8)), r, size, proto.ContentTypeFile)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return nil
}

// filesURL is the path and query of the file endpoint for the sandbox file path,
// with the octal mode when not "".
func filesURL(path, mode string) string {
	q := url.Values{proto.QueryPath: {path}}
	if mode != "" {
		q.Set(proto.QueryMode, mode)
	}
	return proto.PathFiles + "?" + q.Encode()
}

// Resume runs the resume contract in the sandbox (POST /resume): the agent writes
// the generation, reseeds, checks the clock, notifies the sandbox's processes and
// waits for its subscribers, runs the user hooks, and answers the report. The call
// lasts as long as the subscribers and hooks take; bound it with ctx. An agent
// without the resume contract enabled gives an *Error with code "not_found".
func (c *Client) Resume(ctx context.Context, req proto.ResumeRequest) (proto.ResumeReport, error) {
	var rep proto.ResumeReport
	b, err := json.Marshal(req)
	if err != nil {
		return rep, err
	}
	resp, err := c.do(ctx, http.MethodPost, proto.PathResume, bytes.NewReader(b), int64(len(b)), proto.ContentTypeJSON)
	if err != nil {
		return rep, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&rep); err != nil {
		return rep, fmt.Errorf("torpor agent: resume report: %w", err)
	}
	io.Copy(io.Discard, resp.Body)
	return rep, nil
}

// PrepareHibernate asks the agent to end its open envd streams before a
// hibernate drains the sandbox's requests (POST /hibernate/prepare) and
// returns how many it ended. An agent below proto.Version4 is not asked
// (0, nil): its streams are drained and cut as before.
func (c *Client) PrepareHibernate(ctx context.Context) (int, error) {
	if c.ProtocolVersion() < proto.Version4 {
		return 0, nil
	}
	resp, err := c.do(ctx, http.MethodPost, proto.PathPrepareHibernate, nil, 0, "")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var rep proto.PrepareHibernateReport
	if err := json.NewDecoder(resp.Body).Decode(&rep); err != nil {
		return 0, fmt.Errorf("torpor agent: prepare hibernate: %w", err)
	}
	return rep.Streams, nil
}

// ErrNoEnvd is the error (via errors.Is) of an envd call to an agent older
// than proto.EnvdMinVersion: a sandbox started, or resumed from a snapshot
// taken, before the agent served E2B's envd.
var ErrNoEnvd = errors.New("this sandbox's agent predates E2B's envd")

// EnvdVersionError names the agent that cannot serve envd. It matches
// ErrNoEnvd.
type EnvdVersionError struct {
	Version int    // the agent's protocol version
	Agent   string // its build, as it reported it ("" before version 2)
}

func (e *EnvdVersionError) Error() string {
	s := fmt.Sprintf("%v: its guest agent speaks torpor protocol version %d", ErrNoEnvd, e.Version)
	if e.Agent != "" {
		s += " (" + e.Agent + ")"
	}
	return s + fmt.Sprintf(" and envd needs version %d or later; the sandbox still serves torpor's own API "+
		"(exec, files); a sandbox created from an image, or from a snapshot taken, on this host serves envd", proto.EnvdMinVersion)
}

func (e *EnvdVersionError) Is(target error) bool { return target == ErrNoEnvd }

// Envd returns nil if the agent serves E2B's envd (protocol version
// proto.EnvdMinVersion or later, as learnt by WaitReady), else an
// *EnvdVersionError (ErrNoEnvd). Before WaitReady succeeded it is an error too
// (version 0). It makes no request.
func (c *Client) Envd() error {
	if v := c.ProtocolVersion(); v < proto.EnvdMinVersion {
		return &EnvdVersionError{Version: v, Agent: c.AgentBuild()}
	}
	return nil
}

// EnvdTransport is an http.RoundTripper for requests to one sandbox's envd,
// written with envd's own paths ("/files", "/process.Process/Start", …): it
// rewrites each path with proto.EnvdPath and sends the request to the agent
// over connections made by dial, HTTP/1.1, with no compression of its own (a
// client's Accept-Encoding is passed on). The request's host name is not used.
// A host front forwarding E2B's SDK can use it as an httputil.ReverseProxy's
// Transport; Connect's unary, server-streaming and client-streaming calls work
// over it (bidirectional streams and gRPC need HTTP/2: dial the agent with an
// HTTP/2 cleartext transport instead).
type EnvdTransport struct {
	tr *http.Transport
}

// NewEnvdTransport returns an EnvdTransport dialling with dial (for a sandbox:
// the manager's connection to the sandbox's agent, which waits for a resume to
// finish and is cut when the sandbox hibernates). At most 4 idle connections
// are kept, each for at most 30 s.
func NewEnvdTransport(dial func(ctx context.Context) (net.Conn, error)) *EnvdTransport {
	return &EnvdTransport{tr: newTransport(dial, 30*time.Second)}
}

// maxBufferedEnvdBody is the largest request body of an RPC (every Connect
// unary and server-streaming call) that EnvdTransport reads whole before
// sending it; larger and unsized bodies (client streams) and every body of
// envd's plain HTTP paths (the uploads of POST /files) are streamed.
const maxBufferedEnvdBody = 1 << 20

// RoundTrip sends req to the agent with its path rewritten (req is not changed).
//
// An upload of unknown length to a plain HTTP path (E2B's JS SDK sends every
// files.write chunked: its body is a stream) is passed on in pieces of
// envdUploadPiece bytes, at least envdUploadMin of them until its end
// (unsizedUpload): net/http's transport would send each 32 KiB it reads as a
// chunk of its own, in three writes, and under gVisor the agent's reads of
// that many small chunks made the front's forwarding of a 1 MiB upload take
// 1.3 to 1.6 times as long as that of the same bytes with a Content-Length.
//
// A small RPC request body of known length is read whole first. envd answers a
// server-streaming call as soon as it has read the request's one message; when
// the answer comes before net/http's transport has finished with the body it
// closes the body, and a body owned by an incoming request (a front forwarding
// it) then fails the transport's last read, which cuts the answer's connection
// mid-stream. A body held in memory cannot fail that way. envd's plain HTTP
// paths (/files, /health, /envs) read the whole body before they answer, so
// an upload is passed on as it arrives, without a copy.
func (t *EnvdTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req.Clone(req.Context())
	if req.Body != nil && req.Body != http.NoBody && req.ContentLength > 0 && req.ContentLength <= maxBufferedEnvdBody && envdRPC(req.URL.Path) {
		// Exactly ContentLength bytes: waiting for EOF would wait for a
		// writer (connect-go's request pipe) that closes only later.
		b := make([]byte, req.ContentLength)
		if _, err := io.ReadFull(req.Body, b); err != nil {
			req.Body.Close()
			return nil, err
		}
		req.Body.Close()
		r.Body = io.NopCloser(bytes.NewReader(b))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
		r.ContentLength = int64(len(b))
	}
	if req.Body != nil && req.Body != http.NoBody && req.ContentLength < 0 && !envdRPC(req.URL.Path) {
		r.Body = unsizedUpload{req.Body}
	}
	u := *req.URL
	u.Scheme, u.Host = "http", "torpor-agent"
	u.Path, u.RawPath = proto.EnvdPath(req.URL.Path), ""
	r.URL, r.Host = &u, ""
	return t.tr.RoundTrip(r)
}

// CloseIdleConnections closes the transport's idle connections (before the
// sandbox hibernates: a checkpoint keeps no connection).
func (t *EnvdTransport) CloseIdleConnections() { t.tr.CloseIdleConnections() }

// envdUploadPiece and envdUploadMin bound the pieces an upload of unknown
// length is passed on in (unsizedUpload): each is what the client has sent
// so far, at most envdUploadPiece bytes and, but for the last, at least
// envdUploadMin.
const (
	envdUploadPiece = 256 << 10
	envdUploadMin   = 64 << 10
)

// uploadPieces are unsizedUpload's buffers, envdUploadPiece bytes each.
var uploadPieces = sync.Pool{New: func() any { b := make([]byte, envdUploadPiece); return &b }}

// unsizedUpload is a request body of unknown length that net/http's
// transport copies through WriteTo (it unwraps its own body wrapper), so
// that each chunk it sends is a large piece rather than 32 KiB.
type unsizedUpload struct{ io.ReadCloser }

// WriteTo writes the body to w (the transport's chunked writer) in pieces of
// envdUploadMin to envdUploadPiece bytes, the last one shorter.
func (u unsizedUpload) WriteTo(w io.Writer) (int64, error) {
	bp := uploadPieces.Get().(*[]byte)
	defer uploadPieces.Put(bp)
	buf := *bp
	var n int64
	for {
		// Not io.ReadAtLeast: it would take a body cut short (its
		// io.ErrUnexpectedEOF) for the end of a short last piece.
		k, err := 0, error(nil)
		for k < envdUploadMin && err == nil {
			var nn int
			nn, err = u.ReadCloser.Read(buf[k:])
			k += nn
		}
		if k > 0 {
			m, werr := w.Write(buf[:k])
			n += int64(m)
			if werr != nil {
				return n, werr
			}
		}
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// envdRPC reports whether an envd path (before proto.EnvdPath) names a method
// of envd's RPC services, not one of its plain HTTP paths ("/files", …).
func envdRPC(path string) bool {
	return strings.HasPrefix(path, proto.EnvdProcessPrefix) || strings.HasPrefix(path, proto.EnvdFilesystemPrefix)
}
