package server

import (
	"os"
	"strings"
	"testing"
)

func TestAdvertiseURL(t *testing.T) {
	host, _ := os.Hostname()
	for listen, want := range map[string]string{
		"":               "http://127.0.0.1:7070",
		"127.0.0.1:7171": "http://127.0.0.1:7171",
		"10.0.0.5:7070":  "http://10.0.0.5:7070",
		"[::1]:7070":     "http://[::1]:7070",
		":7070":          "http://" + host + ":7070",
		"0.0.0.0:7070":   "http://" + host + ":7070",
		"[::]:7070":      "http://" + host + ":7070",
		"localhost:80":   "http://localhost:80",
	} {
		if got := advertiseURL(listen, false); got != want {
			t.Errorf("advertiseURL(%q) = %q, want %q", listen, got, want)
		}
	}
	if got := advertiseURL("10.0.0.5:7443", true); got != "https://10.0.0.5:7443" {
		t.Errorf("with TLS: %q", got)
	}
}

// TestCheckAdvertise: an advertised URL is a base URL, http:// or https://
// with a host, nothing after it but "/" (a trial's
// http://127.0.0.1:47120/some/path?x=1 was accepted).
func TestCheckAdvertise(t *testing.T) {
	for _, u := range []string{"http://127.0.0.1:7070", "https://host-a.example:7070/", "http://[::1]:7070", "https://host-a"} {
		if err := CheckAdvertise(u); err != nil {
			t.Errorf("CheckAdvertise(%q): %v", u, err)
		}
	}
	for u, why := range map[string]string{
		"http://127.0.0.1:47120/some/path?x=1": "a path",
		"http://127.0.0.1:7070/v1":             "a path",
		"http://127.0.0.1:7070?x=1":            "a query",
		"http://127.0.0.1:7070/?":              "a query",
		"http://127.0.0.1:7070#top":            "a fragment",
		"http://u:p@127.0.0.1:7070":            "user info",
		"ftp://127.0.0.1:7070":                 "scheme",
		"http://":                              "no host",
		"http:127.0.0.1":                       "no host",
		"127.0.0.1:7070":                       "https://host:port",
	} {
		err := CheckAdvertise(u)
		if err == nil || !strings.Contains(err.Error(), "want http://host:port") || !strings.Contains(err.Error(), why) {
			t.Errorf("CheckAdvertise(%q) = %v, want a refusal for %s", u, err, why)
		}
	}
}
