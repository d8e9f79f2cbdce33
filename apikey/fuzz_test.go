package apikey

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata/sqlite"
)

// FuzzKeyHeaders sends any Authorization, X-API-KEY and peer address to the
// key check of every API. A peer ip:port counts as its IP (an IPv6 one as its
// /64); a header yields a key only from its own text, and the check passes
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
		if ap, err := netip.ParseAddrPort(remote); err == nil {
			want := ap.Addr().Unmap().String()
			if ap.Addr().Unmap().Is6() {
				p, _ := ap.Addr().Unmap().Prefix(64)
				want = p.String()
			}
			if a := ClientAddr(r); a != want {
				t.Fatalf("peer %q counted as %q, want %q", remote, a, want)
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
