package server

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/internal/testcert"
	"github.com/torpor/torpor/metadata/postgres/pgtest"
)

// syncBuffer is a log both the server and the test use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// runCluster runs Run with cfg on the fake engine in a new data directory,
// as a node of the PostgreSQL database db, and returns Run's result on a
// channel, and the log.
func runCluster(t *testing.T, ctx context.Context, db string, cfg Config) (<-chan error, *syncBuffer) {
	t.Helper()
	dir := t.TempDir()
	_, engines, agent := fakeEngines(t, dir)
	log := &syncBuffer{}
	cfg.DataDir, cfg.AgentPath, cfg.Engines, cfg.Store, cfg.DisableLifecycle = filepath.Join(dir, "data"), agent, engines, StoreConfig{Kind: "plain"}, true
	cfg.Database, cfg.Auth, cfg.Logger = db, AuthNone, slog.New(slog.NewTextHandler(log, nil))
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	return done, log
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestRunAdvertiseReachesItself: a cluster server checks, once it serves,
// that GET <advertise>/healthz answers from itself (its Torpor-Node
// header). An advertised URL where nothing listens (the trial's: every call
// forwarded to the node then got 502), or where another server answers,
// ends Run with an error naming the URL and what it reached, the node's
// lock given up (a server under the node's name starts after it); its own
// URL, the default one of a picked port and an https:// one whose
// certificate does not name its host are its own.
func TestRunAdvertiseReachesItself(t *testing.T) {
	defer func(d time.Duration) { advertiseCheckFor = d }(advertiseCheckFor)
	advertiseCheckFor = 2 * time.Second
	db := pgtest.Start(t).NewDatabase(t)

	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(NodeHeader, "n2@1700000000000")
	}))
	defer other.Close()
	plain := httptest.NewServer(http.NotFoundHandler())
	defer plain.Close()
	nobody := "http://" + freeAddr(t)
	for _, tc := range []struct{ advertise, reached string }{
		{nobody, "reached nothing (connection refused)"},
		{other.URL + "/", "reached another torpor server (Torpor-Node n2@1700000000000)"},
		{plain.URL, "reached a server that sends no Torpor-Node header (404 Not Found"},
	} {
		listen := freeAddr(t)
		done, log := runCluster(t, context.Background(), db, Config{Node: "n1", Listen: listen, Advertise: tc.advertise})
		var err error
		select {
		case err = <-done:
		case <-time.After(advertiseCheckFor + time.Minute):
			t.Fatalf("--advertise %s: Run still runs\n%s", tc.advertise, log)
		}
		if err == nil || !strings.Contains(err.Error(), "--advertise "+tc.advertise+" does not reach this server (node n1") ||
			!strings.Contains(err.Error(), tc.reached) {
			t.Errorf("--advertise %s: Run = %v, want a refusal saying it %s\n%s", tc.advertise, err, tc.reached, log)
		}
		if c, err := net.Dial("tcp", listen); err == nil {
			c.Close()
			t.Errorf("--advertise %s: %s still listens after Run returned", tc.advertise, listen)
		}
	}

	// The node's lock and name are free: a server with its own URL starts
	// as n1 and serves until its context ends.
	ctx, cancel := context.WithCancel(context.Background())
	done, log := runCluster(t, ctx, db, Config{Node: "n1", Listen: "127.0.0.1:0"})
	waitLog(t, done, log, "the advertised URL reaches this server")
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run with its own URL: %v\n%s", err, log)
	}

	// TLS: the certificate names 127.0.0.1 only, the URL localhost.
	certFile, keyFile, _ := testcert.Write(t, t.TempDir(), 1)
	_, port, _ := net.SplitHostPort(freeAddr(t))
	ctx, cancel = context.WithCancel(context.Background())
	done, log = runCluster(t, ctx, db, Config{Node: "n1", Listen: "127.0.0.1:" + port, Advertise: "https://localhost:" + port,
		TLSCert: certFile, TLSKey: keyFile})
	waitLog(t, done, log, "the advertised URL reaches this server")
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run over TLS: %v\n%s", err, log)
	}
}

// waitLog waits for want in log while Run (done) runs.
func waitLog(t *testing.T, done <-chan error, log *syncBuffer, want string) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); !strings.Contains(log.String(), want); time.Sleep(50 * time.Millisecond) {
		select {
		case err := <-done:
			t.Fatalf("Run ended before its log said %q: %v\n%s", want, err, log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the log does not say %q:\n%s", want, log)
		}
	}
}
