package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"syscall"
	"time"

	"github.com/torpor/torpor/apiv1"
)

type idempotencyKey struct{}

// WithIdempotencyKey returns ctx carrying key (1 to 255 printable ASCII
// characters) as the Idempotency-Key of the CreateSandbox or Fork call made
// with it: a caller that retries across processes (or after its own crash)
// sends the same key again and gets the sandboxes of the first call. Without
// it each call makes its own key.
func WithIdempotencyKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, idempotencyKey{}, key)
}

// NewIdempotencyKey returns a new random key (32 hex digits).
func NewIdempotencyKey() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// callIdempotent is call with an Idempotency-Key, retried with the same key
// while the answer is lost (lostAnswer), c.Retries times at most; a first
// attempt whose connection is refused is not retried (no server listens).
func (c *Client) callIdempotent(ctx context.Context, method, path string, in, out any) error {
	key, _ := ctx.Value(idempotencyKey{}).(string)
	if key == "" {
		key = NewIdempotencyKey()
	}
	hdr := http.Header{apiv1.IdempotencyKeyHeader: {key}}
	wait := 250 * time.Millisecond
	reached := false // an attempt reached the server (its answer was lost)
	for attempt := 0; ; attempt++ {
		err := c.callHeader(ctx, method, path, in, out, hdr)
		if err == nil || attempt >= c.Retries || ctx.Err() != nil || !lostAnswer(err) {
			return err
		}
		// A refused connection before any attempt reached the server means
		// no server there (nothing to retry); after one, a server restarting.
		refused := errors.Is(err, syscall.ECONNREFUSED)
		if refused && !reached {
			return err
		}
		reached = reached || !refused
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
		wait *= 2
	}
}

// lostAnswer says whether err means the call's answer never arrived whole:
// the connection was refused (a server restarting), reset, or closed before
// or during the answer. An answer that arrived (an *APIError), an ended
// context and a failed TLS check are not.
func lostAnswer(err error) bool {
	var ae *APIError
	if errors.As(err, &ae) {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
