package server

import (
	"os"
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
