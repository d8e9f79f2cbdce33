package apikey

import (
	"math"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// FromBearer returns the key of an "Authorization: Bearer <key>" header
// (the scheme in any case, RFC 9110 §11.1), "" if there is none. torpor's
// REST v1 reads keys this way.
func FromBearer(r *http.Request) string {
	scheme, key, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(key)
}

// FromXAPIKey returns the key of an "X-API-KEY: <key>" header (what E2B's
// SDKs send), "" if there is none.
func FromXAPIKey(r *http.Request) string {
	return strings.TrimSpace(r.Header.Get("X-API-KEY"))
}

// ClientAddr is the address refusals are counted by: the IP of r's peer
// (RemoteAddr), an IPv6 address as its /64 (one host usually has a whole
// /64). A RemoteAddr that is no IP is used as it is.
func ClientAddr(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	ip = ip.Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// failures are the per-address token buckets of refused attempts. Only
// addresses with refusals have one; a bucket refilled to the full burst is
// the same as none and is dropped first when the table is full.
type failures struct {
	mu    sync.Mutex
	burst int
	every rate.Limit
	max   int
	by    map[string]*rate.Limiter
}

func newFailures(burst int, perSecond float64, max int) *failures {
	return &failures{burst: burst, every: rate.Limit(perSecond), max: max, by: map[string]*rate.Limiter{}}
}

// wait returns how long addr must wait before its next attempt (0: it may
// try now).
func (f *failures) wait(addr string, now time.Time) time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.by[addr]
	if !ok {
		return 0
	}
	tokens := l.TokensAt(now)
	if tokens >= 1 {
		return 0
	}
	return time.Duration(math.Ceil((1 - tokens) / float64(f.every) * float64(time.Second)))
}

// add counts a refusal of addr and reports whether addr is out of attempts
// now.
func (f *failures) add(addr string, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.by[addr]
	if !ok {
		if len(f.by) >= f.max {
			f.evict(now)
		}
		l = rate.NewLimiter(f.every, f.burst)
		f.by[addr] = l
	}
	l.AllowN(now, 1)
	return l.TokensAt(now) < 1
}

// evict drops the full buckets, and if none is full one bucket (the map's
// order: arbitrary), so the table stays within max.
func (f *failures) evict(now time.Time) {
	for a, l := range f.by {
		if l.TokensAt(now) >= float64(f.burst) {
			delete(f.by, a)
		}
	}
	for a := range f.by {
		if len(f.by) < f.max {
			break
		}
		delete(f.by, a)
	}
}

// len is the number of addresses with a bucket.
func (f *failures) len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.by)
}
