package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/torpor/torpor/apiv1"
)

// DefaultURL is the server address used when neither New's argument nor TORPOR_URL
// names one.
const DefaultURL = "http://127.0.0.1:7070"

// Client talks to one torpor server. It is safe for concurrent use.
type Client struct {
	// BaseURL is the server's address without a trailing slash, e.g. http://127.0.0.1:7070.
	BaseURL string
	// HTTP is the client used for every request. It has no overall timeout.
	HTTP *http.Client
	// APIKey, when set, is sent with every request as "Authorization: Bearer
	// <key>" (the port proxy's too), as a server with --auth required needs.
	APIKey string
	// Retries is how many times CreateSandbox and Fork send their call again,
	// with the same Idempotency-Key, when its answer was lost (the
	// connection reset or closed before the whole answer, then refused while
	// the server restarts; a first connection refused is not retried: no
	// server listens there); 250 ms, then each wait twice the last. New sets
	// DefaultRetries; 0: no retry.
	Retries int
}

// DefaultRetries is New's Client.Retries: 5 retries wait 7.75 s in all.
const DefaultRetries = 5

// New returns a client for baseURL; "" means env TORPOR_URL, else DefaultURL.
// Its APIKey is env TORPOR_API_KEY; an https server's certificate is checked
// against the system's roots and those of the file env TORPOR_CA_CERT names
// (TrustCA).
func New(baseURL string) *Client {
	if baseURL == "" {
		baseURL = os.Getenv("TORPOR_URL")
	}
	if baseURL == "" {
		baseURL = DefaultURL
	}
	if !strings.Contains(baseURL, "://") {
		baseURL = "http://" + baseURL
	}
	tr := &http.Transport{
		Proxy: http.ProxyFromEnvironment,
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:        32,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}
	c := &Client{
		BaseURL: strings.TrimRight(baseURL, "/"),
		HTTP:    &http.Client{Transport: tr},
		APIKey:  strings.TrimSpace(os.Getenv("TORPOR_API_KEY")),
		Retries: DefaultRetries,
	}
	if ca := os.Getenv(CACertEnv); ca != "" {
		_ = c.TrustCA(ca) // a bad file fails every request with its error
	}
	return c
}

// Authorize adds c's API key to req (a request the caller makes itself with
// c.HTTP, e.g. to a PortURL); every method of Client does it already.
func (c *Client) Authorize(req *http.Request) {
	if c.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
	}
}

// APIError is an error answer of the server: {"error":{"code":…,"message":…}}.
type APIError struct {
	Status  int    // HTTP status
	Code    string // apiv1.Code…
	Message string
}

func (e *APIError) Error() string { return "torpor: " + e.Code + ": " + e.Message }

// IsNotFound reports whether err is an APIError with code not_found.
func IsNotFound(err error) bool { return hasCode(err, apiv1.CodeNotFound) }

// IsUnauthenticated reports whether err is an APIError with code
// unauthenticated: the server requires an API key and the request had none
// or a wrong one.
func IsUnauthenticated(err error) bool { return hasCode(err, apiv1.CodeUnauthenticated) }

// IsConflict reports whether err is an APIError with code conflict.
func IsConflict(err error) bool { return hasCode(err, apiv1.CodeConflict) }

// IsUnavailable reports whether err is an APIError with code unavailable
// (503: a retry later may succeed; the answer's Retry-After says when).
func IsUnavailable(err error) bool { return hasCode(err, apiv1.CodeUnavailable) }

// IsSnapshotCorrupt reports whether err is an APIError with code snapshot_corrupt.
func IsSnapshotCorrupt(err error) bool { return hasCode(err, apiv1.CodeSnapshotCorrupt) }

func hasCode(err error, code string) bool {
	var ae *APIError
	return errors.As(err, &ae) && ae.Code == code
}

// Do sends a request to path (relative to BaseURL, e.g. "/v1/sandboxes/x/ports/8080/")
// and returns the raw answer, whatever its status. It is the way to use the port proxy.
// The caller closes the body.
func (c *Client) Do(ctx context.Context, method, path string, body io.Reader, header http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.url(path), body)
	if err != nil {
		return nil, err
	}
	c.Authorize(req)
	for k, vs := range header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	return c.HTTP.Do(req)
}

func (c *Client) url(path string) string {
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	return c.BaseURL + path
}

// PortURL is the address at which the server proxies to port inside sandbox id,
// e.g. http://127.0.0.1:7070/v1/sandboxes/ID/ports/8080/path.
func (c *Client) PortURL(id string, port int, path string) string {
	return c.BaseURL + "/v1/sandboxes/" + url.PathEscape(id) + "/ports/" + strconv.Itoa(port) + "/" + strings.TrimLeft(path, "/")
}

func sandboxPath(id string, rest ...string) string {
	p := "/v1/sandboxes/" + url.PathEscape(id)
	for _, r := range rest {
		p += "/" + r
	}
	return p
}

// send does one request; a JSON body is marshalled from in when in is not nil and not
// an io.Reader. A non-2xx answer becomes an *APIError. On success the open response
// is returned.
func (c *Client) send(ctx context.Context, method, path string, in any, contentType string) (*http.Response, error) {
	return c.sendHeader(ctx, method, path, in, contentType, nil)
}

// sendHeader is send with the extra request headers hdr.
func (c *Client) sendHeader(ctx context.Context, method, path string, in any, contentType string, hdr http.Header) (*http.Response, error) {
	// An id of "." or ".." would be resolved away by URL path cleaning and
	// reach another endpoint ("inspect .." asking for /v1).
	p, _, _ := strings.Cut(path, "?")
	for _, seg := range strings.Split(p, "/") {
		if seg == "." || seg == ".." {
			return nil, &APIError{Status: http.StatusBadRequest, Code: apiv1.CodeInvalidArgument, Message: fmt.Sprintf("invalid id %q", seg)}
		}
	}
	var body io.Reader
	var size int64 = -1
	switch v := in.(type) {
	case nil:
	case io.Reader:
		body = v
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
		size = int64(len(b))
		if contentType == "" {
			contentType = "application/json"
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, c.url(path), body)
	if err != nil {
		return nil, err
	}
	if size >= 0 {
		req.ContentLength = size
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	req.Header.Set("Accept", "application/json, application/x-ndjson")
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	c.Authorize(req)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	return resp, nil
}

// decodeError turns an error answer into an *APIError; a body that is not an
// ErrorBody still gives one, with a code derived from the status.
func decodeError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var eb apiv1.ErrorBody
	if err := json.Unmarshal(b, &eb); err == nil && eb.Error.Code != "" {
		return &APIError{Status: resp.StatusCode, Code: eb.Error.Code, Message: eb.Error.Message}
	}
	msg := strings.TrimSpace(string(b))
	if msg == "" {
		msg = resp.Status
	}
	return &APIError{Status: resp.StatusCode, Code: codeForStatus(resp.StatusCode), Message: msg}
}

func codeForStatus(status int) string {
	switch status {
	case http.StatusNotFound:
		return apiv1.CodeNotFound
	case http.StatusBadRequest:
		return apiv1.CodeInvalidArgument
	case http.StatusConflict:
		return apiv1.CodeConflict
	case http.StatusUnprocessableEntity:
		return apiv1.CodeSnapshotCorrupt
	case http.StatusServiceUnavailable:
		return apiv1.CodeUnavailable
	case http.StatusInsufficientStorage:
		return apiv1.CodeInsufficientStorage
	case http.StatusUnauthorized:
		return apiv1.CodeUnauthenticated
	case http.StatusTooManyRequests:
		return apiv1.CodeRateLimited
	}
	return apiv1.CodeInternal
}

// call does a JSON request and decodes a JSON answer into out (nil: discard).
func (c *Client) call(ctx context.Context, method, path string, in, out any) error {
	return c.callHeader(ctx, method, path, in, out, nil)
}

// callHeader is call with the extra request headers hdr.
func (c *Client) callHeader(ctx context.Context, method, path string, in, out any, hdr http.Header) error {
	resp, err := c.sendHeader(ctx, method, path, in, "", hdr)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("torpor: decoding %s %s answer: %w", method, path, err)
	}
	return nil
}

// Health calls GET /healthz and returns nil if the server answers ok.
func (c *Client) Health(ctx context.Context) error {
	var h struct {
		OK bool `json:"ok"`
	}
	if err := c.call(ctx, http.MethodGet, "/healthz", nil, &h); err != nil {
		return err
	}
	if !h.OK {
		return &APIError{Status: http.StatusOK, Code: apiv1.CodeUnavailable, Message: "server reports not ok"}
	}
	return nil
}

// CreateSandbox creates and starts a sandbox. It is idempotent: it sends an
// Idempotency-Key (WithIdempotencyKey's, else a new one) and retries a call
// whose answer was lost (see Retries) with the same key, so a retry gets the
// sandbox the first attempt made, never a second one.
func (c *Client) CreateSandbox(ctx context.Context, req apiv1.CreateSandboxRequest) (apiv1.Sandbox, error) {
	var sb apiv1.Sandbox
	err := c.callIdempotent(ctx, http.MethodPost, "/v1/sandboxes", req, &sb)
	return sb, err
}

// ListSandboxes lists every sandbox.
func (c *Client) ListSandboxes(ctx context.Context) ([]apiv1.Sandbox, error) {
	var r apiv1.ListSandboxesResponse
	err := c.call(ctx, http.MethodGet, "/v1/sandboxes", nil, &r)
	return r.Sandboxes, err
}

// GetSandbox returns one sandbox.
func (c *Client) GetSandbox(ctx context.Context, id string) (apiv1.Sandbox, error) {
	var sb apiv1.Sandbox
	err := c.call(ctx, http.MethodGet, sandboxPath(id), nil, &sb)
	return sb, err
}

// SandboxMetrics returns what running or paused sandbox id uses now (CPU time
// since its instance started, memory); it wakes no sandbox. Errors: an
// *APIError with status 404 for an unknown sandbox, 409 for one without an
// instance (hibernated, or between states).
func (c *Client) SandboxMetrics(ctx context.Context, id string) (apiv1.SandboxMetrics, error) {
	var m apiv1.SandboxMetrics
	err := c.call(ctx, http.MethodGet, sandboxPath(id)+"/metrics", nil, &m)
	return m, err
}

// DeleteSandbox destroys a sandbox and its snapshots.
func (c *Client) DeleteSandbox(ctx context.Context, id string) error {
	return c.call(ctx, http.MethodDelete, sandboxPath(id), nil, nil)
}

// Hibernate captures a running sandbox to a snapshot and releases its compute. The
// returned sandbox is hibernated, with Snapshot filled.
func (c *Client) Hibernate(ctx context.Context, id string) (apiv1.Sandbox, error) {
	return c.HibernateWith(ctx, id, apiv1.HibernateRequest{})
}

// HibernateWith is Hibernate with choices (req.AsyncUpload: answer before the
// snapshot is in the durable tier; its Snapshot.Durable says when it is).
func (c *Client) HibernateWith(ctx context.Context, id string, req apiv1.HibernateRequest) (apiv1.Sandbox, error) {
	r, err := c.HibernateCall(ctx, id, req)
	return r.Sandbox, err
}

// HibernateCall is HibernateWith returning the whole answer: its Unchanged
// says the sandbox was already hibernated and the call did nothing.
func (c *Client) HibernateCall(ctx context.Context, id string, req apiv1.HibernateRequest) (apiv1.HibernateResponse, error) {
	var r apiv1.HibernateResponse
	var body any
	if req.AsyncUpload != nil {
		body = req
	}
	err := c.call(ctx, http.MethodPost, sandboxPath(id, "hibernate"), body, &r)
	return r, err
}

// Pause pauses a running sandbox (its processes stop, its memory stays on the
// host); it returns once a committed snapshot of the paused state exists.
// Unchanged says it was already paused. The next request, or Resume,
// unpauses it.
func (c *Client) Pause(ctx context.Context, id string) (apiv1.PauseResponse, error) {
	var r apiv1.PauseResponse
	err := c.call(ctx, http.MethodPost, sandboxPath(id, "pause"), nil, &r)
	return r, err
}

// Resume brings a hibernated sandbox back (the answer carries ResumeMS), or
// unpauses a paused one (LastResume.Event "unpaused", the same generation).
func (c *Client) Resume(ctx context.Context, id string) (apiv1.Sandbox, error) {
	r, err := c.ResumeCall(ctx, id)
	return r.Sandbox, err
}

// ResumeCall is Resume returning the whole answer: its Unchanged says the
// sandbox was already running and the call did nothing.
func (c *Client) ResumeCall(ctx context.Context, id string) (apiv1.ResumeResponse, error) {
	var r apiv1.ResumeResponse
	err := c.call(ctx, http.MethodPost, sandboxPath(id, "resume"), nil, &r)
	return r, err
}

// Fork starts count new sandboxes (0 means 1) from sandbox id's snapshot.
// Idempotent as CreateSandbox: a retry gets the clones the first attempt
// made.
func (c *Client) Fork(ctx context.Context, id string, count int) ([]apiv1.Sandbox, error) {
	if count <= 0 {
		count = 1
	}
	var r apiv1.ForkResponse
	err := c.callIdempotent(ctx, http.MethodPost, sandboxPath(id, "fork"), apiv1.ForkRequest{Count: count}, &r)
	return r.Sandboxes, err
}

// ReadFile returns the contents of the file at the absolute path inside sandbox id.
// The caller closes the reader.
func (c *Client) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, error) {
	resp, err := c.send(ctx, http.MethodGet, sandboxPath(id, "files")+"?path="+url.QueryEscape(path), nil, "")
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// WriteFile creates or replaces the file at the absolute path inside sandbox id with
// the bytes of r.
func (c *Client) WriteFile(ctx context.Context, id, path string, r io.Reader) error {
	if r == nil {
		r = bytes.NewReader(nil)
	}
	resp, err := c.send(ctx, http.MethodPut, sandboxPath(id, "files")+"?path="+url.QueryEscape(path), nopReadCloser(r), "application/octet-stream")
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// nopReadCloser hides the concrete type of r so that net/http does not close a
// caller's file; bytes/strings readers keep their type so their length is sent.
func nopReadCloser(r io.Reader) io.Reader {
	switch r.(type) {
	case *bytes.Reader, *bytes.Buffer, *strings.Reader:
		return r
	}
	return struct{ io.Reader }{r}
}

// ListImages lists the stored images.
func (c *Client) ListImages(ctx context.Context) ([]apiv1.Image, error) {
	var r apiv1.ListImagesResponse
	err := c.call(ctx, http.MethodGet, "/v1/images", nil, &r)
	return r.Images, err
}

// buildEvent is one line of the POST /v1/images/build answer.
type buildEvent struct {
	Log   string             `json:"log,omitempty"`
	Image *apiv1.Image       `json:"image,omitempty"`
	Error *apiv1.ErrorDetail `json:"error,omitempty"`
}

// BuildImage builds an image and waits for it. Each log line of the build is passed
// to progress (which may be nil).
func (c *Client) BuildImage(ctx context.Context, req apiv1.BuildImageRequest, progress func(line string)) (apiv1.Image, error) {
	resp, err := c.send(ctx, http.MethodPost, "/v1/images/build", req, "")
	if err != nil {
		return apiv1.Image{}, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 16<<20)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var ev buildEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			return apiv1.Image{}, fmt.Errorf("torpor: bad image build line %q: %w", line, err)
		}
		switch {
		case ev.Error != nil:
			return apiv1.Image{}, &APIError{Status: resp.StatusCode, Code: ev.Error.Code, Message: ev.Error.Message}
		case ev.Image != nil:
			return *ev.Image, nil
		default:
			if progress != nil {
				progress(ev.Log)
			}
		}
	}
	if err := sc.Err(); err != nil {
		if ctx.Err() != nil {
			return apiv1.Image{}, ctx.Err()
		}
		return apiv1.Image{}, fmt.Errorf("torpor: image build stream: %w", err)
	}
	return apiv1.Image{}, errors.New("torpor: image build stream ended without a result")
}

// ImportImage uploads a tar archive of a root filesystem as image name. size is the
// archive's length in bytes, or -1 if unknown (the body is then sent chunked).
func (c *Client) ImportImage(ctx context.Context, name string, r io.Reader, size int64) (apiv1.Image, error) {
	return c.importImage(ctx, name, r, size, false)
}

// ReplaceImage is ImportImage for a name that may already exist: the name then
// points at the imported image (the old image file stays for sandboxes using it).
func (c *Client) ReplaceImage(ctx context.Context, name string, r io.Reader, size int64) (apiv1.Image, error) {
	return c.importImage(ctx, name, r, size, true)
}

func (c *Client) importImage(ctx context.Context, name string, r io.Reader, size int64, replace bool) (apiv1.Image, error) {
	q := "/v1/images/import?name=" + url.QueryEscape(name)
	if replace {
		q += "&replace=true"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url(q), nopReadCloser(r))
	if err != nil {
		return apiv1.Image{}, err
	}
	req.ContentLength = size
	if size == 0 {
		req.Body = http.NoBody
	}
	req.Header.Set("Content-Type", "application/x-tar")
	c.Authorize(req)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return apiv1.Image{}, ctx.Err()
		}
		return apiv1.Image{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return apiv1.Image{}, decodeError(resp)
	}
	var img apiv1.Image
	if err := json.NewDecoder(resp.Body).Decode(&img); err != nil {
		return apiv1.Image{}, fmt.Errorf("torpor: decoding image import answer: %w", err)
	}
	return img, nil
}
