package server

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/internal/testcert"
)

// servedSerial connects to addr trusting roots and returns the serial number
// of the certificate the server presented.
func servedSerial(t *testing.T, addr string, roots *x509.CertPool) int64 {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots})
	if err != nil {
		t.Fatalf("TLS dial: %v", err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
}

// TestCertReload: a server on the reloader's configuration presents the
// first pair; after the files are replaced it presents the new one once
// reloaded (by Reload, then by SIGHUP); a bad pair keeps the one in use.
func TestCertReload(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, first := testcert.Write(t, dir, 1, "*.sandbox.test")
	certs, err := NewCertReloader(certFile, keyFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", certs.TLSConfig())
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	addr := ln.Addr().String()
	roots := x509.NewCertPool()
	roots.AddCert(first)
	if got := servedSerial(t, addr, roots); got != 1 {
		t.Fatalf("served serial %d, want 1", got)
	}

	_, _, second := testcert.Write(t, dir, 2) // the same two files, replaced
	roots.AddCert(second)
	if got := servedSerial(t, addr, roots); got != 1 {
		t.Errorf("before the reload: serial %d, want 1 (still the loaded pair)", got)
	}
	if err := certs.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := servedSerial(t, addr, roots); got != 2 {
		t.Errorf("after Reload: serial %d, want 2", got)
	}

	// A broken pair (a key that is not the certificate's) is refused and
	// the certificate in use stays.
	_, otherKey, _ := testcert.Write(t, t.TempDir(), 3)
	kb, _ := os.ReadFile(otherKey)
	if err := os.WriteFile(keyFile, kb, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := certs.Reload(); err == nil {
		t.Error("Reload of a mismatched pair: no error")
	}
	if got := servedSerial(t, addr, roots); got != 2 {
		t.Errorf("after a failed reload: serial %d, want 2", got)
	}

	// SIGHUP reloads.
	_, _, fourth := testcert.Write(t, dir, 4)
	roots.AddCert(fourth)
	stop := reloadOnSIGHUP(certs)
	defer stop()
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for certs.Certificate().Leaf.SerialNumber.Int64() != 4 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := servedSerial(t, addr, roots); got != 4 {
		t.Errorf("after SIGHUP: serial %d, want 4", got)
	}

	if _, err := NewCertReloader(certFile, "", nil); err == nil {
		t.Error("a certificate without a key was accepted")
	}
	if _, err := NewCertReloader(filepath.Join(dir, "none.pem"), keyFile, nil); err == nil {
		t.Error("a missing certificate file was accepted")
	}
}
