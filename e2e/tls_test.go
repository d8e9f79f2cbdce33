package e2e

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/internal/testcert"
)

// TestServeTLS: `torpor serve --tls-cert --tls-key` serves the API over
// HTTPS to a client that trusts the certificate (client.TrustCA, as
// TORPOR_CA_CERT or --ca-cert do) and to no other; after the files are
// replaced and the process gets SIGHUP, new connections get the new
// certificate, and a broken pair then leaves it in use.
func TestServeTLS(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, first := testcert.Write(t, dir, 1, "*.sandbox.test")
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--tls-cert", certFile, "--tls-key", keyFile}, ca: certFile}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start()
	defer p.stop()
	ctx := ctxFor(t, 2*time.Minute)
	if err := p.client().Health(ctx); err != nil {
		t.Fatalf("health over https with the CA trusted: %v", err)
	}
	p.ca = ""
	if err := p.client().Health(ctx); err == nil {
		t.Error("plain http to the TLS server answered")
	}
	roots := x509.NewCertPool()
	roots.AddCert(first)
	serial := func() int64 {
		t.Helper()
		c, err := tls.Dial("tcp", p.addr, &tls.Config{RootCAs: roots})
		if err != nil {
			t.Fatalf("TLS dial: %v", err)
		}
		defer c.Close()
		if proto := c.ConnectionState().NegotiatedProtocol; proto != "" && proto != "http/1.1" {
			t.Errorf("ALPN %q, want http/1.1", proto)
		}
		return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
	}
	if got := serial(); got != 1 {
		t.Fatalf("serial %d, want 1", got)
	}
	if _, err := tls.Dial("tcp", p.addr, &tls.Config{RootCAs: x509.NewCertPool()}); err == nil {
		t.Error("a client trusting nothing completed the handshake")
	}

	_, _, second := testcert.Write(t, dir, 2, "*.sandbox.test")
	roots.AddCert(second)
	hup := func() {
		t.Helper()
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}
	hup()
	deadline := time.Now().Add(10 * time.Second)
	for serial() != 2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := serial(); got != 2 {
		t.Fatalf("after SIGHUP: serial %d, want 2\n%s", got, p.logText())
	}
	if err := os.WriteFile(keyFile, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	hup()
	time.Sleep(500 * time.Millisecond)
	if got := serial(); got != 2 {
		t.Errorf("after SIGHUP with a broken key: serial %d, want 2 (kept)", got)
	}
	p.ca = certFile
	if err := p.client().Health(ctx); err != nil {
		t.Errorf("health after the reloads: %v", err)
	}
	// The reloads and net/http's handshake error (of the client that trusted
	// nothing) are logged as the rest, through slog, not in Go's plain log
	// format ("2006/01/02 15:04:05 …").
	logText := p.logText()
	for _, want := range []string{"TLS certificate reloaded", "TLS certificate reload failed", "TLS handshake error"} {
		found := false
		for _, line := range strings.Split(logText, "\n") {
			if strings.Contains(line, want) {
				found = true
				if !strings.HasPrefix(line, "time=") || !strings.Contains(line, "level=") {
					t.Errorf("log line not in slog's format: %q", line)
				}
			}
		}
		if !found {
			t.Errorf("no log line with %q:\n%s", want, logText)
		}
	}
	if plain := regexp.MustCompile(`(?m)^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d `).FindAllString(logText, -1); len(plain) > 0 {
		t.Errorf("%d log lines in Go's plain log format:\n%s", len(plain), logText)
	}
}
