package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/internal/ingress"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/sandbox"
)

// TestPaginate: pages in either order cover every entry once, and an entry
// made between two pages shifts nothing of what follows.
func TestPaginate(t *testing.T) {
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	var items []cursor
	for i := 0; i < 7; i++ {
		// Two entries share each time: the id orders them.
		items = append(items, cursor{At: base.Add(time.Duration(i/2) * time.Second), ID: fmt.Sprintf("sbx-%d", i)})
	}
	pos := func(c cursor) cursor { return c }
	for _, desc := range []bool{false, true} {
		in := append([]cursor(nil), items...)
		if desc {
			for i, j := 0, len(in)-1; i < j; i, j = i+1, j-1 {
				in[i], in[j] = in[j], in[i]
			}
		}
		var got []cursor
		tok := ""
		for pages := 0; ; pages++ {
			page, next, err := paginate(in, pos, desc, 3, tok)
			if err != nil {
				t.Fatal(err)
			}
			if pages > 3 {
				t.Fatal("too many pages")
			}
			got = append(got, page...)
			if next == "" {
				if pages != 2 {
					t.Errorf("desc %v: %d pages, want 3", desc, pages+1)
				}
				break
			}
			tok = next
			if pages == 0 {
				// A new entry before the cursor's position (on a page already
				// read) moves nothing of what follows.
				extra := cursor{At: base.Add(-time.Hour), ID: "sbx-new"}
				if desc {
					extra.At = base.Add(time.Hour)
				}
				in = append([]cursor{extra}, in...)
			}
		}
		if want := in[1:]; !reflect.DeepEqual(got, want) {
			t.Errorf("desc %v: pages %v, want %v", desc, got, want)
		}
	}
	if _, _, err := paginate(items, pos, false, 3, "not-a-token"); !errors.Is(err, sandbox.ErrInvalidArgument) {
		t.Errorf("a bad token: %v, want invalid argument", err)
	}
}

func TestAccessToken(t *testing.T) {
	s := &Service{cfg: Config{Secret: make([]byte, 32)}}
	other := &Service{cfg: Config{Secret: append(make([]byte, 31), 1)}}
	a, b := s.AccessToken("sbx-a"), s.AccessToken("sbx-b")
	if a == b || a == other.AccessToken("sbx-a") || a != s.AccessToken("sbx-a") || len(a) != 64 {
		t.Errorf("tokens %q %q %q: want stable, per sandbox and per secret", a, b, other.AccessToken("sbx-a"))
	}
	if !s.tokenOK("sbx-a", a) || s.tokenOK("sbx-a", b) || s.tokenOK("sbx-a", "") {
		t.Error("tokenOK accepts a wrong token or refuses the right one")
	}
	// The traffic token: as stable and per sandbox, and neither token is the other.
	ta, tb := s.TrafficToken("sbx-a"), s.TrafficToken("sbx-b")
	if ta == tb || ta == a || ta == other.TrafficToken("sbx-a") || ta != s.TrafficToken("sbx-a") || len(ta) != 64 {
		t.Errorf("traffic tokens %q %q (envd token %q): want stable, per sandbox and per secret, not the envd token", ta, tb, a)
	}
	if !s.trafficTokenOK("sbx-a", ta) || s.trafficTokenOK("sbx-a", tb) || s.trafficTokenOK("sbx-a", a) || s.trafficTokenOK("sbx-a", "") {
		t.Error("trafficTokenOK accepts a wrong token (another sandbox's, the envd token, none) or refuses the right one")
	}
	if _, ok := s.trafficRefusal("sbx-a", ta); !ok {
		t.Error("trafficRefusal refuses the right token")
	}
	for tok, want := range map[string]string{"": "'e2b-traffic-access-token' is missing", tb: "Provided token is invalid"} {
		if msg, ok := s.trafficRefusal("sbx-a", tok); ok || !strings.Contains(msg, want) {
			t.Errorf("trafficRefusal(%q) = %q, %v; want a refusal saying %q", tok, msg, ok, want)
		}
	}
}

func TestLoadSecret(t *testing.T) {
	p := filepath.Join(t.TempDir(), "e2b-secret")
	a, err := LoadSecret(p)
	if err != nil || len(a) != 32 {
		t.Fatalf("first load: %d bytes, %v", len(a), err)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", fi.Mode().Perm())
	}
	if b, err := LoadSecret(p); err != nil || !reflect.DeepEqual(a, b) {
		t.Errorf("second load %x %v, want %x", b, err, a)
	}
	os.WriteFile(p, []byte("short\n"), 0o600)
	if _, err := LoadSecret(p); err == nil {
		t.Error("a malformed secret file was accepted")
	}
}

// TestShareSecret: two servers with their own secret files on one database
// end with the first one's secret, in memory and in both files, and so make
// the same envdAccessTokens.
func TestShareSecret(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	db, err := sqlite.Open(filepath.Join(dir, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var secrets [2][]byte
	for i := range secrets {
		p := filepath.Join(dir, fmt.Sprintf("node%d-e2b-secret", i))
		local, err := LoadSecret(p)
		if err != nil {
			t.Fatal(err)
		}
		if secrets[i], err = ShareSecret(ctx, db, p, local); err != nil {
			t.Fatal(err)
		}
		if i == 0 && !reflect.DeepEqual(secrets[0], local) {
			t.Fatal("the first server on the database did not keep its own secret")
		}
		if again, err := LoadSecret(p); err != nil || !reflect.DeepEqual(again, secrets[0]) {
			t.Fatalf("node %d's file holds %x (%v), want the shared %x", i, again, err, secrets[0])
		}
	}
	a, b := &Service{cfg: Config{Secret: secrets[0]}}, &Service{cfg: Config{Secret: secrets[1]}}
	if a.AccessToken("sbx-a") != b.AccessToken("sbx-a") {
		t.Error("two nodes on one database make different envdAccessTokens")
	}
}

func TestStatusOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{sandbox.Errorf(sandbox.NotFound, "x"), http.StatusNotFound},
		{fmt.Errorf("wrapped: %w", sandbox.Errorf(sandbox.Conflict, "x")), http.StatusConflict},
		{sandbox.Errorf(sandbox.InvalidArgument, "x"), http.StatusBadRequest},
		{sandbox.Errorf(sandbox.SnapshotCorrupt, "x"), http.StatusUnprocessableEntity},
		{sandbox.Errorf(sandbox.Unavailable, "x"), http.StatusServiceUnavailable},
		{context.Canceled, http.StatusServiceUnavailable},
		{&net.OpError{Op: "dial", Err: errors.New("refused")}, http.StatusBadGateway},
		{fmt.Errorf("%w (%w)", ingress.ErrNoAnswer, io.EOF), http.StatusBadGateway},
		{fmt.Errorf("sandbox sbx-1: %w", metadata.ErrNotFound), http.StatusNotFound},
		{fmt.Errorf("sandbox sbx-1 version 4 (stored: 5): %w", metadata.ErrStale), http.StatusConflict},
		{errors.New("boom"), http.StatusInternalServerError},
	} {
		if got := StatusOf(c.err); got != c.want {
			t.Errorf("StatusOf(%v) = %d, want %d", c.err, got, c.want)
		}
	}
}

// TestFailInSandboxNoAnswer: an in-sandbox request whose server closed the
// connection without answering is 502 in E2B's body form (a new-user trial
// got 500 {"code":500,"message":"EOF"}) and is logged.
func TestFailInSandboxNoAnswer(t *testing.T) {
	var logs bytes.Buffer
	s := &Service{log: slog.New(slog.NewTextHandler(&logs, nil))}
	rec := httptest.NewRecorder()
	s.failInSandbox(rec, httptest.NewRequest(http.MethodGet, "http://8002-sbx-1.e2b.local/reset", nil), fmt.Errorf("%w (%w)", ingress.ErrNoAnswer, io.EOF))
	var body Error
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusBadGateway || body.Code != http.StatusBadGateway {
		t.Fatalf("answer %d %s (%v), want 502 {\"code\":502}", rec.Code, rec.Body.String(), err)
	}
	if !strings.Contains(logs.String(), "no answer") {
		t.Errorf("not logged: %q", logs.String())
	}
}
