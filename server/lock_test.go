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
// kind, or an S3 bucket, that contradicts the record is refused, naming it; a
// pre-record chunks/ directory without manifests (maybe an S3 store's local
// side) needs an explicit kind.
func TestResolveStoreKind(t *testing.T) {
	kind := func(k string) StoreConfig { return StoreConfig{Kind: k} }
	dir := t.TempDir()
	if k, err := ResolveStoreKind(dir, kind("")); err != nil || k != "chunked" {
		t.Fatalf("new directory: %q %v", k, err)
	}
	if k, err := ResolveStoreKind(dir, kind("local")); err != nil || k != "chunked" {
		t.Fatalf("alias local: %q %v", k, err)
	}
	if _, err := ResolveStoreKind(dir, kind("tape")); err == nil {
		t.Fatal("unknown kind accepted")
	}
	legacy := t.TempDir()
	if err := os.MkdirAll(filepath.Join(legacy, "snapshots", "snap-1"), 0o700); err != nil {
		t.Fatal(err)
	}
	if k, err := ResolveStoreKind(legacy, kind("")); err != nil || k != "plain" {
		t.Fatalf("directory with plain snapshots: %q %v", k, err)
	}
	ambiguous := t.TempDir()
	if err := os.MkdirAll(filepath.Join(ambiguous, "chunks", "open"), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := ResolveStoreKind(ambiguous, kind("")); err == nil || !strings.Contains(err.Error(), "--store s3") {
		t.Fatalf("pre-record chunks/ without manifests: %v", err)
	}
	if k, err := ResolveStoreKind(ambiguous, kind("s3")); err != nil || k != "s3" {
		t.Fatalf("pre-record chunks/ with --store s3: %q %v", k, err)
	}
	s3 := StoreConfig{Kind: "s3", S3Bucket: "snaps", S3Prefix: "torpor/"}
	if err := recordStoreKind(dir, s3); err != nil {
		t.Fatal(err)
	}
	if err := recordStoreKind(dir, kind("plain")); err != nil { // a record is written once
		t.Fatal(err)
	}
	if k, err := ResolveStoreKind(dir, s3); err != nil || k != "s3" {
		t.Fatalf("recorded s3: %q %v", k, err)
	}
	_, err := ResolveStoreKind(dir, kind("chunked"))
	if err == nil || !strings.Contains(err.Error(), "--store s3") {
		t.Fatalf("contradicting kind: %v", err)
	}
	// Without a bucket and prefix the record's are used.
	bare := withRecordedS3(dir, kind("s3"))
	if bare.S3Bucket != "snaps" || bare.S3Prefix != "torpor/" {
		t.Fatalf("bucket and prefix from the record: %+v", bare)
	}
	if k, err := ResolveStoreKind(dir, kind("")); err != nil || k != "s3" {
		t.Fatalf("recorded s3 without flags: %q %v", k, err)
	}
	// Only one of them given: the other is the record's.
	if k, err := ResolveStoreKind(dir, StoreConfig{Kind: "s3", S3Prefix: "torpor/"}); err != nil || k != "s3" {
		t.Fatalf("recorded prefix given alone: %q %v", k, err)
	}
	if k, err := ResolveStoreKind(dir, StoreConfig{Kind: "s3", S3Bucket: "snaps"}); err != nil || k != "s3" {
		t.Fatalf("recorded bucket given alone: %q %v", k, err)
	}
	if half := withRecordedS3(dir, StoreConfig{Kind: "s3", S3Bucket: "snaps"}); half.S3Prefix != "torpor/" {
		t.Fatalf("prefix from the record: %+v", half)
	}
	_, err = ResolveStoreKind(dir, StoreConfig{Kind: "s3", S3Prefix: "p8/"})
	if err == nil || strings.Contains(err.Error(), `--s3-bucket "`) || !strings.Contains(err.Error(), `--s3-prefix "p8/"`) {
		t.Fatalf("another prefix given alone: %v", err)
	}
	other := s3
	other.S3Bucket = "other"
	if _, err := ResolveStoreKind(dir, other); err == nil || !strings.Contains(err.Error(), "bucket=snaps") {
		t.Fatalf("another bucket: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "store"), []byte("banana\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ResolveStoreKind(dir, kind("")); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "store")) {
		t.Fatalf("unknown recorded kind: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "store"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := recordStoreKind(dir, kind("chunked")); err != nil { // an empty record is rewritten
		t.Fatal(err)
	}
	if k, err := ResolveStoreKind(dir, kind("")); err != nil || k != "chunked" {
		t.Fatalf("after rewriting an empty record: %q %v", k, err)
	}
}
