package e2b

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"syscall"

	"github.com/torpor/torpor/apikey"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Config wires a Service to the server's parts.
type Config struct {
	// Manager is the sandbox manager every call goes to.
	Manager *manager.Manager
	// Images resolves templateIDs that name an image.
	Images *image.Store
	// Keys verifies the API key (X-API-KEY) of every control-plane call: the
	// server's one verifier when it requires keys; nil = keys are not
	// required (a server on loopback with --auth none or auto).
	Keys *apikey.Verifier
	// Secret is the key of the HMAC that derives each sandbox's
	// envdAccessToken (see AccessToken); at least 32 bytes (LoadSecret).
	Secret []byte
	// Domain is the domain of host-routed in-sandbox requests
	// ("<port>-<sandboxID>.<Domain>", see RouteOf) and the create answer's
	// domain; "" = only header routing.
	Domain string
	// BaseImage is the image template "base" names ("" = image.E2BBaseName,
	// E2B's base template: Debian with python3, node, git, curl and the
	// account user).
	BaseImage string
	// Ingress forwards in-sandbox requests (shared with torpor's port proxy).
	Ingress *ingress.Proxy
	Logger  *slog.Logger
	// Refer, if set, is asked first by every failure path with the call's
	// error: true means that the server sends the call to the node that
	// owns the sandbox (err a *manager.NotOwnerError) and nothing is to be
	// written (the cluster front's referral, server.Server.refer).
	Refer func(r *http.Request, err error) bool
}

// Service serves E2B's control plane and routes in-sandbox requests (envd
// and every other port) to the sandboxes, over the same manager as torpor's
// REST API v1. docs/e2b.md says what maps to what.
type Service struct {
	cfg  Config
	log  *slog.Logger
	envd envdCalls
}

// New returns a Service. Errors: a Secret shorter than 32 bytes, no Manager.
func New(cfg Config) (*Service, error) {
	if cfg.Manager == nil || cfg.Images == nil {
		return nil, errors.New("e2b: no manager or image store")
	}
	if len(cfg.Secret) < 32 {
		return nil, fmt.Errorf("e2b: secret of %d bytes, want at least 32", len(cfg.Secret))
	}
	if cfg.BaseImage == "" {
		cfg.BaseImage = image.E2BBaseName
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Ingress == nil {
		cfg.Ingress = ingress.New(slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn))
	}
	return &Service{cfg: cfg, log: cfg.Logger}, nil
}

// LoadSecret returns the secret kept in the file at path (32 random bytes,
// hex), making the file (mode 0600) on first use. Errors: the file cannot be
// read or written, or holds something else.
func LoadSecret(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		raw := make([]byte, 32)
		rand.Read(raw)
		if err := atomicfile.WriteFile(path, []byte(hex.EncodeToString(raw)+"\n"), 0o600); err != nil {
			return nil, fmt.Errorf("e2b secret %s: %w", path, err)
		}
		return raw, nil
	}
	if err != nil {
		return nil, fmt.Errorf("e2b secret %s: %w", path, err)
	}
	raw, err := hex.DecodeString(string(trimSpace(b)))
	if err != nil || len(raw) < 32 {
		return nil, fmt.Errorf("e2b secret %s: want 64 hex digits", path)
	}
	return raw, nil
}

// SecretName is the name of the E2B surface's secret in metadata.Secrets.
const SecretName = "e2b-token-key"

// ShareSecret returns the secret of every server that shares db: the first
// server to start on the database stores its own (local, LoadSecret's), and
// every other one takes that one instead and writes it to path (mode 0600), so
// that an envdAccessToken made by any node is good on all. Errors: the
// database's, or path cannot be written.
func ShareSecret(ctx context.Context, db metadata.Secrets, path string, local []byte) ([]byte, error) {
	shared, err := db.EnsureSecret(ctx, SecretName, local)
	if err != nil {
		return nil, fmt.Errorf("e2b secret: %w", err)
	}
	if !bytes.Equal(shared, local) {
		if err := atomicfile.WriteFile(path, []byte(hex.EncodeToString(shared)+"\n"), 0o600); err != nil {
			return nil, fmt.Errorf("e2b secret %s: %w", path, err)
		}
	}
	return shared, nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == ' ' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

// AccessToken is sandbox id's envdAccessToken: the hex HMAC-SHA256 of
// "envd-access-token:" and the id under the server's secret. It is derived,
// not stored: the same for every create, connect and info answer of the
// sandbox, different for every sandbox (a clone has its own), and known to
// no one without the secret.
func (s *Service) AccessToken(id string) string { return s.derive("envd-access-token:", id) }

// TrafficToken is sandbox id's trafficAccessToken: the hex HMAC-SHA256 of
// "traffic-access-token:" and the id under the server's secret. Derived as
// AccessToken is (nothing stored: a hibernate, a resume or a restart of the
// server keeps it; a clone has its own) and unrelated to it: one does not
// give the other. Only a sandbox whose traffic is not public is given it.
func (s *Service) TrafficToken(id string) string { return s.derive("traffic-access-token:", id) }

// derive is the hex HMAC-SHA256 of purpose and id under the server's secret.
func (s *Service) derive(purpose, id string) string {
	mac := hmac.New(sha256.New, s.cfg.Secret)
	mac.Write([]byte(purpose + id))
	return hex.EncodeToString(mac.Sum(nil))
}

func (s *Service) tokenOK(id, token string) bool { return matches(token, s.AccessToken(id)) }

func (s *Service) trafficTokenOK(id, token string) bool { return matches(token, s.TrafficToken(id)) }

// matches compares a token a request carries with the one wanted, in
// constant time; an empty token never matches.
func matches(got, want string) bool {
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// reply answers v as JSON with status.
func reply(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// replyError answers E2B's error body {"code": status, "message": msg}.
func replyError(w http.ResponseWriter, status int, msg string) {
	reply(w, status, Error{Code: status, Message: msg})
}

// StatusOf is the HTTP status of an error of the manager (or of this
// package) in E2B's form: a sandbox.Error by its Kind (NotFound 404,
// InvalidArgument 400, Conflict 409, SnapshotCorrupt 422, Unavailable 503);
// an ended context 503; a metadata record another node deleted meanwhile
// 404, or changed under every retry 409; a refused dial into a sandbox, or a server there that
// closed the connection without answering (ingress.ErrNoAnswer), 502;
// anything else 500.
func StatusOf(err error) int {
	var se *sandbox.Error
	switch {
	case errors.As(err, &se) && se.Kind != sandbox.Internal:
		switch se.Kind {
		case sandbox.NotFound:
			return http.StatusNotFound
		case sandbox.InvalidArgument:
			return http.StatusBadRequest
		case sandbox.Conflict:
			return http.StatusConflict
		case sandbox.SnapshotCorrupt:
			return http.StatusUnprocessableEntity
		case sandbox.Unavailable:
			return http.StatusServiceUnavailable
		case sandbox.InsufficientStorage:
			return http.StatusInsufficientStorage
		}
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return http.StatusServiceUnavailable
	case errors.Is(err, metadata.ErrNotFound): // deleted through another node meanwhile
		return http.StatusNotFound
	case errors.Is(err, metadata.ErrStale): // changed through another node under each retry
		return http.StatusConflict
	case isDialError(err), errors.Is(err, ingress.ErrNoAnswer):
		return http.StatusBadGateway
	}
	return http.StatusInternalServerError
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) || errors.Is(err, syscall.ECONNREFUSED)
}

// fail answers err in E2B's form, logging internal errors.
func (s *Service) fail(w http.ResponseWriter, r *http.Request, err error) {
	if s.referred(r, err) {
		return
	}
	status := StatusOf(err)
	if status >= 500 && status != http.StatusBadGateway && status != http.StatusServiceUnavailable {
		s.log.Error("e2b request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	// A refusal of admission control (the host's memory is full: 503) says
	// when to retry.
	if n := manager.RetryAfterSeconds(err); n > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(n))
	}
	replyError(w, status, err.Error())
}

// referred says whether Config.Refer took the call that failed with err.
func (s *Service) referred(r *http.Request, err error) bool {
	return s.cfg.Refer != nil && s.cfg.Refer(r, err)
}

// Fail answers err in E2B's form, as the service's own handlers do (the
// cluster front's refusals of E2B calls).
func (s *Service) Fail(w http.ResponseWriter, r *http.Request, err error) { s.fail(w, r, err) }

func invalid(format string, a ...any) error {
	return sandbox.Errorf(sandbox.InvalidArgument, format, a...)
}
