package server

import (
	"os"
	"path/filepath"
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

// The store kind: chunked for a new data directory, plain for one holding plain
// snapshots from before the record, the recorded kind otherwise; an explicit
// kind that contradicts the record is refused, naming both.
func TestResolveStoreKind(t *testing.T) {
	dir := t.TempDir()
	if k, err := ResolveStoreKind(dir, ""); err != nil || k != "chunked" {
		t.Fatalf("new directory: %q %v", k, err)
	}
	if k, err := ResolveStoreKind(dir, "local"); err != nil || k != "chunked" {
		t.Fatalf("alias local: %q %v", k, err)
	}
	if _, err := ResolveStoreKind(dir, "tape"); err == nil {
		t.Fatal("unknown kind accepted")
	}
	legacy := t.TempDir()
	if err := os.MkdirAll(filepath.Join(legacy, "snapshots", "snap-1"), 0o700); err != nil {
		t.Fatal(err)
	}
	if k, err := ResolveStoreKind(legacy, ""); err != nil || k != "plain" {
		t.Fatalf("directory with plain snapshots: %q %v", k, err)
	}
	if err := recordStoreKind(dir, "s3"); err != nil {
		t.Fatal(err)
	}
	if err := recordStoreKind(dir, "plain"); err != nil { // a record is written once
		t.Fatal(err)
	}
	if k, err := ResolveStoreKind(dir, ""); err != nil || k != "s3" {
		t.Fatalf("recorded s3: %q %v", k, err)
	}
	_, err := ResolveStoreKind(dir, "chunked")
	if err == nil || !strings.Contains(err.Error(), "--store s3") {
		t.Fatalf("contradicting kind: %v", err)
	}
}
