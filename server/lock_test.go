package server

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestDataDirLock: a second server on a data directory is refused, naming the
// first one's pid, until the first one lets go.
func TestDataDirLock(t *testing.T) {
	dir := t.TempDir()
	first, err := lockDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = lockDataDir(dir)
	if err == nil || !strings.Contains(err.Error(), "in use by another torpor server (pid "+strconv.Itoa(os.Getpid())+")") {
		t.Fatalf("second lock: %v, want refused naming pid %d", err, os.Getpid())
	}
	first.Close()
	again, err := lockDataDir(dir)
	if err != nil {
		t.Fatalf("lock after the first was released: %v", err)
	}
	again.Close()
}

// TestDataDirLockSurvivesLockFileRemoval: removing DIR/lock while a server
// holds the directory does not let a second one in.
func TestDataDirLockSurvivesLockFileRemoval(t *testing.T) {
	dir := t.TempDir()
	first, err := lockDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if err := os.Remove(dir + "/lock"); err != nil {
		t.Fatal(err)
	}
	if second, err := lockDataDir(dir); err == nil {
		second.Close()
		t.Fatal("a second lock was granted after DIR/lock was removed")
	}
}
