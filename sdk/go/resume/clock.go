package resume

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// ClockOffset returns what to add to the sandbox's wall clock to get the
// host's, as the agent measured it on the last resume (0 outside torpor or when
// the clocks agree; gVisor forbids clock_settime, so the correction is applied
// by readers, not to the clock).
func ClockOffset() time.Duration {
	b, err := os.ReadFile(filepath.Join(contractDir(), ClockOffsetFile))
	if err != nil {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0
	}
	return time.Duration(n)
}

// Now returns the corrected wall-clock time: the sandbox's clock plus the
// offset the agent measured against the host. It carries no monotonic reading,
// so comparisons with it use the wall clock, which (unlike a monotonic clock on
// some platforms) includes the time spent hibernated.
func Now() time.Time { return time.Now().Add(ClockOffset()).Round(0) }

// Expired reports whether expiry has passed on the corrected clock. Use it for
// tokens and caches whose expiry was computed before a possible hibernation.
func Expired(expiry time.Time) bool { return !Now().Before(expiry.Round(0)) }

// ExpiryIn returns the wall-clock instant ttl from now on the corrected clock
// (for "expires_in" answers: store this, not a monotonic deadline).
func ExpiryIn(ttl time.Duration) time.Time { return Now().Add(ttl) }

// Lease is a time-bounded right (a lock, a token, a reservation) whose
// remaining time is always recomputed against the corrected wall clock, so a
// hibernation spent holding it counts.
type Lease struct {
	Expiry time.Time
}

// NewLease returns a lease expiring ttl from now.
func NewLease(ttl time.Duration) Lease { return Lease{Expiry: ExpiryIn(ttl)} }

// Remaining returns the time left (<= 0 when expired).
func (l Lease) Remaining() time.Duration { return l.Expiry.Round(0).Sub(Now()) }

// Valid reports whether the lease has time left.
func (l Lease) Valid() bool { return l.Remaining() > 0 }

// ValidFor reports whether at least d is left (renew before using the lease
// for an operation that takes d).
func (l Lease) ValidFor(d time.Duration) bool { return l.Remaining() >= d }
