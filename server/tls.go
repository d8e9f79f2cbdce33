package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// CertReloader serves the TLS certificate of a pair of PEM files (a
// certificate chain and its private key, as `torpor serve --tls-cert
// --tls-key` name them) and loads them again on Reload (Run calls it on
// SIGHUP), so a renewed certificate is taken without a restart. A pair that
// does not load keeps the certificate in use. Safe for concurrent use.
type CertReloader struct {
	certFile, keyFile string
	log               *slog.Logger
	cert              atomic.Pointer[tls.Certificate]
}

// NewCertReloader loads the pair certFile and keyFile. Errors: a file cannot
// be read, is not PEM, or the key does not match the certificate (each
// naming the files).
func NewCertReloader(certFile, keyFile string, log *slog.Logger) (*CertReloader, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
	}
	if log == nil {
		log = slog.Default()
	}
	c := &CertReloader{certFile: certFile, keyFile: keyFile, log: log}
	cert, err := c.load()
	if err != nil {
		return nil, err
	}
	c.cert.Store(cert)
	return c, nil
}

func (c *CertReloader) load() (*tls.Certificate, error) {
	cert, err := tls.LoadX509KeyPair(c.certFile, c.keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate %s with key %s: %w", c.certFile, c.keyFile, err)
	}
	if cert.Leaf == nil && len(cert.Certificate) > 0 {
		cert.Leaf, _ = x509.ParseCertificate(cert.Certificate[0])
	}
	return &cert, nil
}

// Reload loads the pair again. On success the new certificate serves every
// handshake from now on (connections already open keep theirs) and its names
// and expiry are logged; on failure the certificate in use stays, the error
// is logged and returned.
func (c *CertReloader) Reload() error {
	cert, err := c.load()
	if err != nil {
		c.log.Error("TLS certificate reload failed; still serving the previous certificate", "err", err)
		return err
	}
	c.cert.Store(cert)
	attrs := []any{"cert", c.certFile}
	if l := cert.Leaf; l != nil {
		names := slices.Clone(l.DNSNames)
		for _, ip := range l.IPAddresses {
			names = append(names, ip.String())
		}
		attrs = append(attrs, "names", strings.Join(names, ","), "not_after", l.NotAfter.UTC().Format(time.RFC3339))
	}
	c.log.Info("TLS certificate reloaded", attrs...)
	return nil
}

// Certificate returns the certificate in use.
func (c *CertReloader) Certificate() *tls.Certificate { return c.cert.Load() }

// TLSConfig returns a server configuration that serves the certificate in
// use at each handshake: TLS 1.2 at least, HTTP/1.1 only (ALPN), as over
// plain TCP, since the port proxy's WebSocket upgrades need HTTP/1.1.
func (c *CertReloader) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return c.cert.Load(), nil
		},
	}
}
