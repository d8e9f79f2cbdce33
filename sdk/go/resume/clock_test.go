package resume

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestTimeHelpers(t *testing.T) {
	dir := t.TempDir()
	SetDir(dir)
	defer SetDir(DefaultDir)

	if Expired(time.Now().Add(time.Hour)) || !Expired(time.Now().Add(-time.Millisecond)) {
		t.Error("Expired without an offset")
	}
	l := NewLease(2 * time.Second)
	if !l.Valid() || l.Remaining() > 2*time.Second || l.Remaining() < time.Second {
		t.Errorf("fresh lease remaining %v", l.Remaining())
	}

	// The agent measured the sandbox clock 10 s behind the host's.
	if err := os.WriteFile(filepath.Join(dir, ClockOffsetFile), []byte("10000000000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if d := ClockOffset(); d != 10*time.Second {
		t.Fatalf("offset %v", d)
	}
	if d := Now().Sub(time.Now()); d < 9*time.Second || d > 11*time.Second {
		t.Errorf("Now is %v ahead of the raw clock, want ~10s", d)
	}
	if !Expired(time.Now().Add(5*time.Second)) || l.Valid() || l.ValidFor(time.Millisecond) {
		t.Error("a token expiring 5 s from the uncorrected clock is not seen as expired with a +10 s offset")
	}
	if strings.Contains(Now().String(), "m=") {
		t.Error("Now carries a monotonic reading")
	}
}
