package watchdog

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/node"
)

func TestHeartbeatFile(t *testing.T) {
	dir := t.TempDir()
	if _, _, err := LastHeartbeat(dir); !os.IsNotExist(err) {
		t.Fatalf("no file: %v, want not exist", err)
	}
	at := time.Unix(1700000000, 123456789)
	if err := writeHeartbeat(dir, at, 4242); err != nil {
		t.Fatal(err)
	}
	got, pid, err := LastHeartbeat(dir)
	if err != nil || !got.Equal(at) || pid != 4242 {
		t.Fatalf("read back %v %d %v; want %v 4242", got, pid, err, at)
	}
	os.WriteFile(filepath.Join(dir, HeartbeatFile), []byte("12 x\n"), 0o644)
	if _, _, err := LastHeartbeat(dir); err == nil || !strings.Contains(err.Error(), "malformed") {
		t.Fatalf("malformed file: %v", err)
	}
}

func TestLateRegistration(t *testing.T) {
	prev := time.Now()
	for _, c := range []struct {
		prev, at time.Time
		late     bool
	}{
		{time.Time{}, prev.Add(time.Hour), false},
		{prev, prev.Add(node.SelfFenceAfter - time.Second), false},
		{prev, prev.Add(node.SelfFenceAfter + time.Second), true},
	} {
		if got := LateRegistration(c.prev, c.at); got != c.late {
			t.Errorf("LateRegistration(%v, +%v) = %v", c.prev, c.at.Sub(c.prev), got)
		}
	}
}

func TestLockHandover(t *testing.T) {
	dir := t.TempDir()
	unlock, err := LockHandover(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := LockHandover(ctx, dir); err == nil {
		t.Fatal("a second holder took the lock")
	}
	unlock()
	again, err := LockHandover(context.Background(), dir)
	if err != nil {
		t.Fatalf("after unlock: %v", err)
	}
	again()
}

// A data directory removed meanwhile is not made again.
func TestAfterServerDirGone(t *testing.T) {
	w, _ := testWatch(t)
	w.last = time.Now().Add(-node.SelfFenceAfter - time.Second)
	if err := w.afterServer(false, time.Now()); err == nil || listed(w) {
		t.Fatalf("no engine state: %v, listed %v", err, listed(w))
	}
	if _, err := os.Stat(filepath.Join(w.cfg.DataDir, "gvisor")); !os.IsNotExist(err) {
		t.Errorf("the engine's state directory was made: %v", err)
	}
}

// testWatch is a watch on a temporary data directory whose runsc is a
// script that records its arguments in DIR/runsc.args and lists nothing.
func testWatch(t *testing.T) (*watch, *bytes.Buffer) {
	t.Helper()
	dir := t.TempDir()
	runsc := filepath.Join(dir, "runsc")
	script := "#!/bin/sh\necho \"$@\" >> " + filepath.Join(dir, "runsc.args") + "\necho '[]'\n"
	if err := os.WriteFile(runsc, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	return &watch{cfg: Config{DataDir: dir, Runsc: runsc, Node: "n1"}, log: slog.New(slog.NewTextHandler(&log, nil)), server: 1000}, &log
}

func listed(w *watch) bool {
	b, _ := os.ReadFile(filepath.Join(w.cfg.DataDir, "runsc.args"))
	return strings.Contains(string(b), "list")
}

func TestRead(t *testing.T) {
	w, _ := testWatch(t)
	clean := w.read(strings.NewReader("hb 1700000000000000000\nnoise\nhb 1700000005000000000\n"))
	if clean || !w.last.Equal(time.Unix(1700000005, 0)) {
		t.Fatalf("clean %v last %v", clean, w.last)
	}
	if !w.read(strings.NewReader("hb 1\nclean\n")) {
		t.Fatal("clean not read")
	}
}

// A server that stopped clean, or died before any heartbeat, leaves
// nothing to stop.
func TestAfterServerNothing(t *testing.T) {
	w, _ := testWatch(t)
	if err := w.afterServer(true, time.Now()); err != nil || listed(w) {
		t.Fatalf("clean: %v, listed %v", err, listed(w))
	}
	w.last = time.Time{}
	if err := w.afterServer(false, time.Now()); err != nil || listed(w) {
		t.Fatalf("no heartbeat: %v, listed %v", err, listed(w))
	}
}

// A new server's heartbeat, newer than the dead server's last, hands the
// instances over; an older one, or the dead server's own, does not.
func TestAfterServerHandover(t *testing.T) {
	w, log := testWatch(t)
	w.last = time.Now().Add(-node.SelfFenceAfter + 2*time.Second)
	writeHeartbeat(w.cfg.DataDir, w.last, w.server)
	go func() {
		time.Sleep(500 * time.Millisecond)
		writeHeartbeat(w.cfg.DataDir, time.Now(), 2000)
	}()
	if err := w.afterServer(false, time.Now()); err != nil || listed(w) {
		t.Fatalf("handover: %v, listed %v", err, listed(w))
	}
	if !strings.Contains(log.String(), "new_server_pid=2000") {
		t.Errorf("log: %s", log.String())
	}
}

// Past the deadline with no new server, the instances are listed and
// stopped (here: none), even while a server holds the handover lock.
func TestAfterServerStops(t *testing.T) {
	w, log := testWatch(t)
	os.Mkdir(filepath.Join(w.cfg.DataDir, "gvisor"), 0o700)
	w.last = time.Now().Add(-node.SelfFenceAfter - time.Second)
	writeHeartbeat(w.cfg.DataDir, w.last, w.server)
	writeHeartbeat(w.cfg.DataDir, w.last.Add(-time.Minute), 2000) // an older server's: no handover
	unlock, err := LockHandover(context.Background(), w.cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if err := w.afterServer(false, time.Now()); err != nil || !listed(w) {
		t.Fatalf("after the deadline: %v, listed %v\n%s", err, listed(w), log.String())
	}
	if !strings.Contains(log.String(), "handover lock was not taken") || !strings.Contains(log.String(), "the server is gone: stopped its instances") {
		t.Errorf("log: %s", log.String())
	}
}

// A server that is still there (its pipe open) but sends no heartbeat for
// the self-fence time has its instances stopped (listed, here: none), once
// for that heartbeat; a fresh heartbeat re-arms the check; the server's end
// is returned as read it.
func TestWhileServerHung(t *testing.T) {
	w, log := testWatch(t)
	os.Mkdir(filepath.Join(w.cfg.DataDir, "gvisor"), 0o700)
	args := filepath.Join(w.cfg.DataDir, "runsc.args")
	lists := func() int {
		b, _ := os.ReadFile(args)
		return strings.Count(string(b), "list")
	}
	done := make(chan bool, 1)
	w.last = time.Now().Add(-node.SelfFenceAfter - time.Second) // past the self-fence, not HungAfter: the server's own fence acts
	ended := make(chan bool, 1)
	go func() { ended <- w.whileServer(done, 10*time.Millisecond) }()
	time.Sleep(100 * time.Millisecond)
	if n := lists(); n != 0 {
		t.Fatalf("a heartbeat past the self-fence time but not HungAfter: the instances were listed %d times", n)
	}
	w.mu.Lock()
	w.last = time.Now().Add(-HungAfter - time.Second) // stale: the server hangs
	w.mu.Unlock()
	for deadline := time.Now().Add(5 * time.Second); lists() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a stale heartbeat: the instances were not stopped\n%s", log.String())
		}
	}
	time.Sleep(100 * time.Millisecond)
	if n := lists(); n != 1 {
		t.Errorf("the same stale heartbeat stopped the instances %d times, want once", n)
	}
	done <- true
	if clean := <-ended; !clean {
		t.Error("whileServer did not return read's answer")
	}
	// The stop is logged as what it was: the server runs (it is not dead).
	if l := log.String(); !strings.Contains(l, "has sent no heartbeat past its self-fence time") ||
		!strings.Contains(l, "the server runs but sent no heartbeat for") || strings.Contains(l, "dead server") {
		t.Errorf("log: %s", l)
	}
}
