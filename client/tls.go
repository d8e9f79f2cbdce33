package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
)

// CACertEnv names the environment variable New reads: a PEM file of
// certificates to trust, besides the system's, for an https server (a
// server with `torpor serve --tls-cert` whose certificate no system
// authority signed, e.g. a self-signed one).
const CACertEnv = "TORPOR_CA_CERT"

// TrustCA makes c trust the certificates in the PEM file path, besides the
// system's roots, for https servers. Errors: the file cannot be read or
// holds no certificate; every later request of c then fails with that
// error too (it never falls back to trusting less, or more).
func (c *Client) TrustCA(path string) error {
	tr, ok := c.HTTP.Transport.(*http.Transport)
	if !ok {
		return errors.New("torpor: TrustCA: the client's transport is not an *http.Transport")
	}
	pool, err := caPool(path)
	if err != nil {
		c.HTTP.Transport = failing{err}
		return err
	}
	tr = tr.Clone()
	if tr.TLSClientConfig == nil {
		tr.TLSClientConfig = &tls.Config{}
	}
	tr.TLSClientConfig.RootCAs = pool
	c.HTTP.Transport = tr
	return nil
}

// caPool is the system's roots with the certificates of PEM file path.
func caPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("torpor: CA certificate: %w", err)
	}
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("torpor: CA certificate %s: no PEM certificate in it", path)
	}
	return pool, nil
}

// failing is a transport whose every request fails with err.
type failing struct{ err error }

func (f failing) RoundTrip(*http.Request) (*http.Response, error) { return nil, f.err }
