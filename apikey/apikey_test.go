package apikey

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
)

var ctx = context.Background()

// sdkKeyRE is the check E2B's SDKs (JS 2.27–2.45, Python 2.45) make before
// sending a key.
var sdkKeyRE = regexp.MustCompile(`^e2b_[0-9a-f]+$`)

func TestGenerate(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 200; i++ {
		k, err := Generate()
		if err != nil {
			t.Fatal(err)
		}
		if len(k) != 44 || !sdkKeyRE.MatchString(k) || !Valid(k) {
			t.Fatalf("key %q: length %d, SDK form %v, Valid %v", k, len(k), sdkKeyRE.MatchString(k), Valid(k))
		}
		if seen[k] {
			t.Fatalf("key %q generated twice", k)
		}
		seen[k] = true
		if p := PublicPrefix(k); p != k[:12] {
			t.Fatalf("prefix of %q: %q", k, p)
		}
	}
}

func TestValid(t *testing.T) {
	good := "e2b_" + strings.Repeat("0123456789", 4)
	for key, want := range map[string]bool{
		good:                                   true,
		"e2b_" + strings.Repeat("af", 20):      true,
		"":                                     false,
		"e2b_":                                 false,
		good[:43]:                              false, // 39 digits
		good + "0":                             false, // 41
		"E2B_" + good[4:]:                      false,
		"e2b-" + good[4:]:                      false,
		"e2b_" + strings.Repeat("A", 40):       false, // upper case
		"e2b_" + strings.Repeat("g", 40):       false,
		"e2b_" + strings.Repeat("0", 39) + " ": false,
		"x" + good[1:]:                         false,
	} {
		if got := Valid(key); got != want {
			t.Errorf("Valid(%q) = %v, want %v", key, got, want)
		}
		if p := PublicPrefix(key); (p != "") != want {
			t.Errorf("PublicPrefix(%q) = %q", key, p)
		}
	}
}

func TestHash(t *testing.T) {
	// FIPS 180-2's example: SHA-256("abc").
	if got := hex.EncodeToString(Hash("abc")); got != "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad" {
		t.Errorf("Hash(abc) = %s", got)
	}
	k, _ := Generate()
	want := sha256.Sum256([]byte(k))
	if !bytes.Equal(Hash(k), want[:]) {
		t.Errorf("Hash(%s) is not its SHA-256", k)
	}
}

func TestValidName(t *testing.T) {
	for name, want := range map[string]bool{"": true, "ci runner": true, "laptop—émile": true,
		strings.Repeat("a", MaxNameLen): true, strings.Repeat("a", MaxNameLen+1): false, "a\nb": false, "a\x00": false} {
		if got := ValidName(name); got != want {
			t.Errorf("ValidName(%q) = %v, want %v", name, got, want)
		}
	}
}

// countingKeys is a store that counts reads by hash and touches, and fails
// every call while fail is set.
type countingKeys struct {
	metadata.Keys
	byHash, touches atomic.Int64
	fail            atomic.Bool
}

func (c *countingKeys) APIKeyByHash(ctx context.Context, h []byte) (metadata.APIKey, error) {
	c.byHash.Add(1)
	if c.fail.Load() {
		return metadata.APIKey{}, errors.New("database is locked")
	}
	return c.Keys.APIKeyByHash(ctx, h)
}

func (c *countingKeys) TouchAPIKey(ctx context.Context, id string, at time.Time) error {
	c.touches.Add(1)
	return c.Keys.TouchAPIKey(ctx, id, at)
}

func openStore(t *testing.T) *countingKeys {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return &countingKeys{Keys: db}
}

// clock is a settable clock for Config.Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newClock() *clock { return &clock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)} }

func TestCreateAndVerify(t *testing.T) {
	st := openStore(t)
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	key, rec, err := Create(ctx, st, "ci", now)
	if err != nil {
		t.Fatal(err)
	}
	if !Valid(key) || !regexp.MustCompile(`^key_[0-9a-f]{12}$`).MatchString(rec.ID) || rec.Name != "ci" || rec.Prefix != key[:12] || !rec.CreatedAt.Equal(now) {
		t.Fatalf("created %q %+v", key, rec)
	}
	stored, err := st.GetAPIKey(ctx, rec.ID)
	if err != nil || !bytes.Equal(stored.Hash, Hash(key)) || strings.Contains(fmt.Sprintf("%+v %x", stored, stored.Hash), key[12:]) {
		t.Fatalf("stored record %+v %v: want the key's hash and nothing of the key past its prefix", stored, err)
	}
	if _, _, err := Create(ctx, st, "bad\nname", now); err == nil {
		t.Error("a name with a newline was accepted")
	}

	v := NewVerifier(st, Config{})
	got, err := v.Verify(ctx, key)
	if err != nil || got.ID != rec.ID {
		t.Fatalf("verify the key: %+v %v", got, err)
	}
	other, _ := Generate()
	for k, want := range map[string]error{"": ErrMissing, other: ErrInvalid, key[:43]: ErrInvalid, strings.ToUpper(key): ErrInvalid} {
		if _, err := v.Verify(ctx, k); !errors.Is(err, want) {
			t.Errorf("verify %q: %v, want %v", k, err, want)
		}
	}
	// Malformed keys and missing ones never reach the store.
	before := st.byHash.Load()
	for _, k := range []string{"", "e2b_x", "Bearer " + key, key + "0"} {
		v.Verify(ctx, k)
	}
	if n := st.byHash.Load() - before; n != 0 {
		t.Errorf("malformed keys cost %d store reads", n)
	}
	// A second key made later works at once (refusals are not cached).
	key2, _, err := Create(ctx, st, "", now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(ctx, key2); err != nil {
		t.Errorf("a new key: %v", err)
	}
}

// TestRevocationImmediate: every verification reads the store, so a key
// removed from it is refused by the very next verification (issue 18, D8:
// it had been kept for a cache's 5 s).
func TestRevocationImmediate(t *testing.T) {
	st := openStore(t)
	clk := newClock()
	v := NewVerifier(st, Config{Now: clk.Now})
	key, rec, err := Create(ctx, st, "", clk.Now())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if _, err := v.Verify(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	if n := st.byHash.Load(); n != 50 {
		t.Fatalf("50 verifications read the store %d times, want 50", n)
	}
	if err := st.DeleteAPIKey(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(ctx, key); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a removed key at once: %v, want ErrInvalid", err)
	}
}

// TestTouch: LastUsedAt is written at most once per TouchInterval per key,
// and the first use of a key used recently (its stored LastUsedAt) waits for
// the interval too.
func TestTouch(t *testing.T) {
	st := openStore(t)
	clk := newClock()
	v := NewVerifier(st, Config{Now: clk.Now})
	key, rec, _ := Create(ctx, st, "", clk.Now())
	for i := 0; i < 120; i++ { // two minutes, a verification every second
		if _, err := v.Verify(ctx, key); err != nil {
			t.Fatal(err)
		}
		clk.Add(time.Second)
	}
	if n := st.touches.Load(); n != 2 {
		t.Errorf("%d writes of last use in two minutes, want 2", n)
	}
	got, _ := st.GetAPIKey(ctx, rec.ID)
	if want := time.Date(2030, 1, 1, 0, 1, 0, 0, time.UTC); got.LastUsedAt == nil || !got.LastUsedAt.Equal(want) {
		t.Errorf("last used %v, want %v", got.LastUsedAt, want)
	}
	// A new verifier (a restarted server) takes the stored time as its last write.
	v2 := NewVerifier(st, Config{Now: clk.Now})
	before := st.touches.Load()
	v2.Verify(ctx, key) // 2 min after the first use, 1 min after the stored last use
	clk.Add(-30 * time.Second)
	v3 := NewVerifier(st, Config{Now: clk.Now})
	v3.Verify(ctx, key) // 30 s after the stored last use
	if n := st.touches.Load() - before; n != 1 {
		t.Errorf("restarted verifiers wrote last use %d times, want 1 (only the one a minute after the stored time)", n)
	}
}

// TestStoreFailure: a store that fails is not a refusal: Check returns the
// error without counting it against the address.
func TestStoreFailure(t *testing.T) {
	st := openStore(t)
	clk := newClock()
	v := NewVerifier(st, Config{FailureBurst: 1, Now: clk.Now})
	key, _, _ := Create(ctx, st, "", clk.Now())
	st.fail.Store(true)
	for i := 0; i < 3; i++ {
		_, err := v.Check(request("10.0.0.1:5000", key), key)
		if err == nil || errors.Is(err, ErrInvalid) || errors.Is(err, ErrLimited) {
			t.Fatalf("check with a failing store: %v, want the store's error", err)
		}
		if strings.Contains(err.Error(), key[12:]) {
			t.Fatalf("the error shows the key: %v", err)
		}
	}
	st.fail.Store(false)
	if _, err := v.Check(request("10.0.0.1:5000", key), key); err != nil {
		t.Fatalf("after the store recovers: %v", err)
	}
}

func request(remote, bearer string) *http.Request {
	r := httptest.NewRequest("GET", "/v1/sandboxes", nil)
	r.RemoteAddr = remote
	if bearer != "" {
		r.Header.Set("Authorization", "Bearer "+bearer)
	}
	return r
}

// TestCheckLimitsAddress: refusals from one address use up its bucket; then
// a missing, malformed or wrong key from it waits (ErrLimited, with the time
// to wait) while a good key is admitted at once, whether or not it was used
// recently (issue 18, D3: only failed attempts are throttled); other
// addresses are not affected, and the address gets one attempt per
// 1/FailureRate. Refusals are logged with the address and a well-formed
// key's prefix, nothing more of any key, and not while limited.
func TestCheckLimitsAddress(t *testing.T) {
	st := openStore(t)
	clk := newClock()
	var logs bytes.Buffer
	v := NewVerifier(st, Config{FailureBurst: 3, FailureRate: 0.5, Now: clk.Now,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	good, _, _ := Create(ctx, st, "", clk.Now())
	wrong, _ := Generate()
	const bad = "10.0.0.1:4000"
	for i, k := range []string{wrong, "", "e2b_not-hex-" + good[12:]} {
		if _, err := v.Check(request(bad, k), k); !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrMissing) {
			t.Fatalf("attempt %d: %v", i, err)
		}
	}
	var le *LimitedError
	for _, k := range []string{wrong, "", "e2b_not-hex-" + good[12:]} {
		if _, err := v.Check(request("10.0.0.1:4001", k), k); !errors.As(err, &le) || le.RetryAfter != 2*time.Second {
			t.Fatalf("key %.12q from the address out of attempts (another port): %v, want ErrLimited after 2s", k, err)
		}
	}
	if _, err := v.Check(request("10.0.0.1:4001", good), good); err != nil {
		t.Fatalf("a good key never used from the address out of attempts: %v, want admitted", err)
	}
	if _, err := v.Check(request("10.0.0.2:4000", wrong), wrong); !errors.Is(err, ErrInvalid) {
		t.Fatalf("another address: %v, want ErrInvalid (its own bucket)", err)
	}
	// Past the cache's time, a good key is still admitted (read again).
	clk.Add(time.Second)
	fresh, _, _ := Create(ctx, st, "", clk.Now())
	for _, k := range []string{good, fresh} {
		if _, err := v.Check(request(bad, k), k); err != nil {
			t.Fatalf("a good key from the address out of attempts: %v, want admitted", err)
		}
	}
	if _, err := v.Check(request(bad, wrong), wrong); !errors.As(err, &le) || le.RetryAfter != time.Second {
		t.Fatalf("half way: %v, want a wait of 1s", err)
	}
	clk.Add(time.Second)
	if _, err := v.Check(request(bad, wrong), wrong); !errors.Is(err, ErrInvalid) {
		t.Fatalf("after the wait one more wrong key: %v, want ErrInvalid", err)
	}
	if _, err := v.Check(request(bad, wrong), wrong); !errors.Is(err, ErrLimited) {
		t.Fatalf("and then another: %v, want ErrLimited again", err)
	}

	out := logs.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 5 || strings.Count(out, "addr=10.0.0.1") != 4 || strings.Count(out, "limited=true") != 2 {
		t.Errorf("want 5 refusals logged with the address, 4 of 10.0.0.1, two of them limiting:\n%s", out)
	}
	if !strings.Contains(out, "prefix="+wrong[:12]) || !strings.Contains(out, "reason=\"missing API key\"") {
		t.Errorf("log lacks the wrong key's prefix or the reason:\n%s", out)
	}
	for _, secret := range []string{wrong[12:], good[12:], good[:12]} {
		if strings.Contains(out, secret) {
			t.Errorf("log shows key material %q:\n%s", secret, out)
		}
	}
}

// TestFailuresBounded: the buckets of many failing addresses stay within
// MaxAddresses, full ones going first.
func TestFailuresBounded(t *testing.T) {
	f := newFailures(2, 1, 8)
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	f.add("keep", now)
	f.add("keep", now) // out of attempts
	for i := 0; i < 100; i++ {
		f.add(fmt.Sprintf("10.0.%d.%d", i/256, i%256), now.Add(time.Duration(i)*time.Hour))
		if n := f.len(); n > 8 {
			t.Fatalf("%d buckets, want at most 8", n)
		}
	}
	if f.wait("10.0.0.99", now.Add(99*time.Hour)) != 0 {
		t.Error("one refusal with a burst of 2 limited the address")
	}
	g := newFailures(2, 1, 3)
	for _, a := range []string{"a", "b", "c"} {
		g.add(a, now)
		g.add(a, now)
	}
	g.add("d", now) // nothing full: one bucket goes
	if n := g.len(); n != 3 {
		t.Errorf("%d buckets, want 3", n)
	}
}

func TestClientAddr(t *testing.T) {
	for remote, want := range map[string]string{
		"10.1.2.3:5000":              "10.1.2.3",
		"[2001:db8:1:2:3:4:5:6]:443": "2001:db8:1:2::/64",
		"[2001:db8:1:2:ffff::1]:443": "2001:db8:1:2::/64",
		"[::ffff:192.0.2.7]:80":      "192.0.2.7",
		"[::1]:7070":                 "::/64",
		"pipe":                       "pipe",
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = remote
		if got := ClientAddr(r); got != want {
			t.Errorf("ClientAddr(%s) = %s, want %s", remote, got, want)
		}
	}
}

func TestFromRequest(t *testing.T) {
	for header, want := range map[string]string{
		"Bearer e2b_ab": "e2b_ab", "bearer e2b_ab": "e2b_ab", "BEARER  e2b_ab ": "e2b_ab",
		"Basic e2b_ab": "", "e2b_ab": "", "": "", "Bearer": "",
	} {
		r := httptest.NewRequest("GET", "/", nil)
		if header != "" {
			r.Header.Set("Authorization", header)
		}
		if got := FromBearer(r); got != want {
			t.Errorf("FromBearer(%q) = %q, want %q", header, got, want)
		}
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", " e2b_cd ")
	r.Header.Set("Authorization", "Bearer e2b_ab")
	if got := FromXAPIKey(r); got != "e2b_cd" {
		t.Errorf("FromXAPIKey = %q", got)
	}
	if got := FromXAPIKey(httptest.NewRequest("GET", "/", nil)); got != "" {
		t.Errorf("FromXAPIKey without the header = %q", got)
	}
}

func TestRequire(t *testing.T) {
	st := openStore(t)
	v := NewVerifier(st, Config{Logger: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil))})
	key, rec, _ := Create(ctx, st, "", time.Now())
	h := v.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, ok := FromContext(r.Context())
		if !ok || k.ID != rec.ID {
			t.Errorf("record in the context: %+v %v", k, ok)
		}
		w.WriteHeader(http.StatusNoContent)
	}), FromXAPIKey, func(w http.ResponseWriter, r *http.Request, err error) {
		http.Error(w, err.Error(), http.StatusUnauthorized)
	})
	// A key that differs from the real one in its last digit (whatever that is).
	last := "0"
	if key[43:] == "0" {
		last = "1"
	}
	for k, want := range map[string]int{key: http.StatusNoContent, "": http.StatusUnauthorized, key[:43] + last: http.StatusUnauthorized} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("X-API-KEY", k)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != want {
			t.Errorf("key %q: status %d, want %d", k, w.Code, want)
		}
	}
}

func TestDeny(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
		retry  time.Duration
		msg    string
	}{
		{ErrMissing, 401, 0, "missing API key"},
		{ErrInvalid, 401, 0, "invalid API key"},
		{&LimitedError{RetryAfter: 3 * time.Second}, 429, 3 * time.Second, "too many failed API key attempts from this address; retry after 3s"},
		{fmt.Errorf("apikey: verify e2b_12345678: %w", errors.New("disk I/O error")), 503, StoreRetryAfter, "cannot check the API key now; retry"},
	} {
		status, retry, msg := Deny(c.err)
		if status != c.status || retry != c.retry || msg != c.msg {
			t.Errorf("Deny(%v) = %d %v %q, want %d %v %q", c.err, status, retry, msg, c.status, c.retry, c.msg)
		}
	}
}
