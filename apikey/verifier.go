package apikey

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/torpor/torpor/metadata"
)

// Errors of Verify and Check (test with errors.Is). Their messages are safe
// to show a client: they say only that the key is missing or wrong.
var (
	// ErrMissing: the request carries no key.
	ErrMissing = errors.New("missing API key")
	// ErrInvalid: the key is malformed, unknown or removed.
	ErrInvalid = errors.New("invalid API key")
	// ErrLimited: too many refused attempts from the client's address; the
	// error is a *LimitedError with the wait.
	ErrLimited = errors.New("too many failed API key attempts from this address")
)

// LimitedError is Check's answer to an address out of attempts. It matches
// ErrLimited.
type LimitedError struct {
	// RetryAfter is how long until the address may try again.
	RetryAfter time.Duration
}

func (e *LimitedError) Error() string {
	return fmt.Sprintf("%v; retry after %v", ErrLimited, e.RetryAfter.Round(time.Second))
}

func (e *LimitedError) Is(target error) bool { return target == ErrLimited }

// Config tunes a Verifier. Zero values take the defaults.
type Config struct {
	// TouchInterval is how often a key's LastUsedAt is written at most
	// (default 1 minute).
	TouchInterval time.Duration
	// FailureBurst is how many refused attempts an address may make at once
	// (default 10); FailureRate how many more per second after that (default
	// 1).
	FailureBurst int
	FailureRate  float64
	// MaxAddresses bounds the addresses whose refusals are counted (default
	// 4096).
	MaxAddresses int
	// Logger receives refused attempts (default slog.Default()).
	Logger *slog.Logger
	// Now is the clock (default time.Now; tests set it).
	Now func() time.Time
}

func (c *Config) fill() {
	if c.TouchInterval <= 0 {
		c.TouchInterval = time.Minute
	}
	if c.FailureBurst <= 0 {
		c.FailureBurst = 10
	}
	if c.FailureRate <= 0 {
		c.FailureRate = 1
	}
	if c.MaxAddresses <= 0 {
		c.MaxAddresses = 4096
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Verifier checks keys against a store (see the package doc for revocation
// and the failure limits). It is safe for concurrent use.
type Verifier struct {
	keys metadata.Keys
	cfg  Config

	mu      sync.Mutex
	touched map[string]time.Time
	fails   *failures
}

// NewVerifier returns a Verifier of the keys in keys.
func NewVerifier(keys metadata.Keys, cfg Config) *Verifier {
	cfg.fill()
	return &Verifier{keys: keys, cfg: cfg, touched: map[string]time.Time{},
		fails: newFailures(cfg.FailureBurst, cfg.FailureRate, cfg.MaxAddresses)}
}

// Verify returns the record of key, read from the store every time (by its
// hash: one indexed read), so that a key removed from the store is refused
// from the removal's commit on, by every server on the store. Errors:
// ErrMissing (key is ""), ErrInvalid (malformed, unknown or removed), or the
// store's failure (wrapped; not a refusal: the caller answers it as
// unavailable). Verify counts no failures; request handlers call Check.
func (v *Verifier) Verify(ctx context.Context, key string) (metadata.APIKey, error) {
	if key == "" {
		return metadata.APIKey{}, ErrMissing
	}
	if !Valid(key) {
		return metadata.APIKey{}, ErrInvalid
	}
	h := Hash(key)
	rec, err := v.keys.APIKeyByHash(ctx, h)
	if errors.Is(err, metadata.ErrNotFound) {
		return metadata.APIKey{}, ErrInvalid
	}
	if err != nil {
		return metadata.APIKey{}, fmt.Errorf("apikey: verify %s: %w", PublicPrefix(key), err)
	}
	if subtle.ConstantTimeCompare(rec.Hash, h) != 1 {
		return metadata.APIKey{}, ErrInvalid
	}
	v.touch(ctx, rec, v.cfg.Now())
	return rec, nil
}

// touch writes rec's LastUsedAt if the last write (or the stored value) is
// TouchInterval old. A failed write is logged, not returned: it must not
// refuse a good key.
func (v *Verifier) touch(ctx context.Context, rec metadata.APIKey, now time.Time) {
	v.mu.Lock()
	last, ok := v.touched[rec.ID]
	if !ok && rec.LastUsedAt != nil {
		last, ok = *rec.LastUsedAt, true
	}
	if ok && now.Sub(last) < v.cfg.TouchInterval {
		v.touched[rec.ID] = last
		v.mu.Unlock()
		return
	}
	v.touched[rec.ID] = now
	v.mu.Unlock()
	if err := v.keys.TouchAPIKey(context.WithoutCancel(ctx), rec.ID, now); err != nil && !errors.Is(err, metadata.ErrNotFound) {
		v.cfg.Logger.Warn("api key: record last use", "key", rec.ID, "err", err)
	}
}

// Check is Verify for a request r presenting key (FromBearer, FromXAPIKey).
// Only failed attempts are throttled: a valid key is admitted whatever its
// address's refusals, so that one misconfigured client does not stall the
// good ones behind the same address (every client of one host, or of one
// proxy). An address out of attempts gets a *LimitedError for a missing or
// malformed key without a lookup, and for a well-formed key that Verify
// refuses (one lookup, as for any key). Every refusal while the address has
// attempts is counted and logged (the client's address, the path, the
// reason, a well-formed key's public prefix); refusals while it is out of
// them are neither. Otherwise Check returns Verify's answer.
func (v *Verifier) Check(r *http.Request, key string) (metadata.APIKey, error) {
	addr := ClientAddr(r)
	now := v.cfg.Now()
	wait := v.fails.wait(addr, now)
	if wait > 0 && !Valid(key) {
		return metadata.APIKey{}, &LimitedError{RetryAfter: wait}
	}
	rec, err := v.Verify(r.Context(), key)
	if err == nil || !(errors.Is(err, ErrMissing) || errors.Is(err, ErrInvalid)) {
		return rec, err
	}
	if wait > 0 {
		return metadata.APIKey{}, &LimitedError{RetryAfter: wait}
	}
	limited := v.fails.add(addr, now)
	attrs := []any{"addr", addr, "method", r.Method, "path", r.URL.Path, "reason", err.Error()}
	if p := PublicPrefix(key); p != "" {
		attrs = append(attrs, "prefix", p)
	}
	if limited {
		attrs = append(attrs, "limited", true)
	}
	v.cfg.Logger.Warn("api key refused", attrs...)
	return metadata.APIKey{}, err
}

type contextKey struct{}

// FromContext returns the record of the key that Require admitted the
// request with.
func FromContext(ctx context.Context) (metadata.APIKey, bool) {
	k, ok := ctx.Value(contextKey{}).(metadata.APIKey)
	return k, ok
}

// Require returns a handler that serves next only to requests whose key
// (from(r)) Check admits, with the key's record in the request's context
// (FromContext); every other request gets deny(w, r, err) with Check's error.
func (v *Verifier) Require(next http.Handler, from func(*http.Request) string, deny func(http.ResponseWriter, *http.Request, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec, err := v.Check(r, from(r))
		if err != nil {
			deny(w, r, err)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), contextKey{}, rec)))
	})
}

// StoreRetryAfter is what a refusal because the key store failed (Deny's
// 503) tells the caller to wait before it retries: one node heartbeat, about
// as long as a database that blinked takes to answer again.
const StoreRetryAfter = 5 * time.Second

// Deny says how to answer a request Check refused with err: status 401
// (ErrMissing, ErrInvalid), 429 with retryAfter (ErrLimited) or 503 with StoreRetryAfter (the
// store failed: the key may be good; the caller logs err), and a message
// that is safe to show the client (it says only that the key is missing or
// wrong, or when to retry). Each API writes them in its own error shape and
// adds its own headers (REST v1: WWW-Authenticate; both: Retry-After).
func Deny(err error) (status int, retryAfter time.Duration, message string) {
	var le *LimitedError
	switch {
	case errors.As(err, &le):
		return http.StatusTooManyRequests, le.RetryAfter, le.Error()
	case errors.Is(err, ErrMissing):
		return http.StatusUnauthorized, 0, ErrMissing.Error()
	case errors.Is(err, ErrInvalid):
		return http.StatusUnauthorized, 0, ErrInvalid.Error()
	}
	return http.StatusServiceUnavailable, StoreRetryAfter, "cannot check the API key now; retry"
}
