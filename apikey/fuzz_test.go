package apikey

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata/sqlite"
)

// FuzzKeyHeaders sends any Authorization, X-API-KEY and peer address to the
// key check of every API. A peer counts as the same address whatever its
// port; a header yields a key only from its own text, and the check passes
// exactly when that key is the one key made (a key that differs in one
// character, its case or its length is refused).
func FuzzKeyHeaders(f *testing.F) {
	db, err := sqlite.Open(filepath.Join(f.TempDir(), "torpor.db"))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { db.Close() })
	key, _, err := Create(context.Background(), db, "fuzz", time.Now())
	if err != nil {
		f.Fatal(err)
	}
	v := NewVerifier(db, Config{FailureBurst: 1 << 30, FailureRate: 1 << 30, Logger: slog.New(slog.DiscardHandler)})
	f.Add("Bearer "+key, "", "10.0.0.1:1234")
	f.Add("bearer  "+key+" ", key, "[2001:db8::1]:80")
	f.Add("Bearer "+strings.ToUpper(key), key[:len(key)-1], "[::ffff:10.0.0.1]:80")
	f.Add("Basic "+key, key+"0", "not an address")
	f.Add("Bearer", "e2b_", "")
	f.Fuzz(func(t *testing.T, authorization, xAPIKey, remote string) {
		r := httptest.NewRequest("GET", "/v1/sandboxes", nil)
		r.Header["Authorization"] = []string{authorization}
		r.Header["X-Api-Key"] = []string{xAPIKey}
		r.RemoteAddr = remote
		if host, port, err := net.SplitHostPort(remote); err == nil {
			if other := net.JoinHostPort(host, port+"1"); ClientAddr(withPeer(r, other)) != ClientAddr(r) {
				t.Fatalf("peers %q and %q count as two addresses", remote, other)
			}
		}
		for _, c := range []struct{ header, key string }{{authorization, FromBearer(r)}, {xAPIKey, FromXAPIKey(r)}} {
			if !strings.Contains(c.header, c.key) {
				t.Fatalf("key %q read from header %q", c.key, c.header)
			}
			_, err := v.Check(r, c.key)
			if (err == nil) != (c.key == key) {
				t.Fatalf("key %q (header %q): check %v", c.key, c.header, err)
			}
		}
	})
}

func withPeer(r *http.Request, addr string) *http.Request {
	r2 := r.Clone(r.Context())
	r2.RemoteAddr = addr
	return r2
}
