package server

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRunBusyAddressSetsUpNothing: a server whose address is in use fails
// before it makes its data directory (a new-user trial's second `torpor serve`
// on a busy port created the database, guest files and images first).
func TestRunBusyAddressSetsUpNothing(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	dir := filepath.Join(t.TempDir(), "data")
	err = Run(context.Background(), Config{DataDir: dir, Listen: busy.Addr().String()})
	if err == nil || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("Run on a busy address: %v, want address already in use", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the data directory %s exists after the failed start (%v)", dir, err)
	}
}

// TestNewUnreachableDatabaseLeavesNoDataDir: a start refused because its
// PostgreSQL database cannot be reached removes the data directory it made
// (the cluster trial found a new directory with a lock file after each such
// refusal).
func TestNewUnreachableDatabaseLeavesNoDataDir(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now: the connection is refused
	dir := filepath.Join(t.TempDir(), "data")
	s, err := New(context.Background(), Config{DataDir: dir, Listen: "127.0.0.1:0", Database: "postgres://torpor@" + addr + "/torpor?connect_timeout=5"})
	if err == nil {
		s.Close()
		t.Fatal("New with an unreachable database succeeded")
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the data directory %s exists after the refused start (%v)", dir, err)
	}
}
