// Package s3test starts a real S3-compatible server (versitygw with its posix
// backend, Apache-2.0) for tests: on 127.0.0.1 at a free port, with its data in a
// test's temporary directory, stopped by its pid when the test ends.
//
// The binary is installed by `make setup` into .tools/versitygw-<Version>; tests
// find it through $TORPOR_VERSITYGW or by looking for that file above the working
// directory, and skip with a message saying how to install it when it is missing.
package s3test

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Version is the pinned versitygw version (keep in step with the Makefile).
const Version = "v1.8.0"

// Server is a running versitygw.
type Server struct {
	Endpoint  string // http://127.0.0.1:PORT
	Addr      string // 127.0.0.1:PORT
	AccessKey string
	SecretKey string
	Region    string
	bin, dir  string
	cmd       *exec.Cmd
	exited    chan struct{}
	t         testing.TB
}

// Binary returns the versitygw binary's path, or "" when it is not installed.
func Binary() string {
	if p := os.Getenv("TORPOR_VERSITYGW"); p != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		p := filepath.Join(dir, ".tools", "versitygw-"+Version)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// Start starts a server for t, or skips t when the binary is missing. The server
// is stopped when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin := Binary()
	if bin == "" {
		t.Skipf("versitygw %s not installed: run `make setup` (installs .tools/versitygw-%s) or set TORPOR_VERSITYGW", Version, Version)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	s := &Server{Endpoint: "http://" + addr, Addr: addr, AccessKey: "torpor-test", SecretKey: "torpor-test-secret",
		Region: "us-east-1", bin: bin, dir: t.TempDir(), t: t}
	s.Restart()
	t.Cleanup(s.Stop)
	return s
}

// Restart starts the server again (same address and data) after Stop.
func (s *Server) Restart() {
	s.t.Helper()
	if s.cmd != nil {
		return
	}
	data := filepath.Join(s.dir, "data")
	if err := os.MkdirAll(data, 0o700); err != nil {
		s.t.Fatal(err)
	}
	log, err := os.OpenFile(filepath.Join(s.dir, "versitygw.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		s.t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(s.bin, "--access", s.AccessKey, "--secret", s.SecretKey, "--region", s.Region,
		"--port", s.Addr, "--quiet", "posix", data)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY_ID=", "ROOT_SECRET_ACCESS_KEY=")
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("start versitygw: %v", err)
	}
	s.cmd = cmd
	exited := make(chan struct{})
	s.exited = exited
	go func() { cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", s.Addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-exited:
			s.cmd = nil
			b, _ := os.ReadFile(filepath.Join(s.dir, "versitygw.log"))
			s.t.Fatalf("versitygw exited at start: %s", strings.TrimSpace(string(b)))
		default:
		}
		if time.Now().After(deadline) {
			s.Stop()
			s.t.Fatalf("versitygw did not listen on %s within 15 s", s.Addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server (by its pid) and waits until its port is closed.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
	}
	s.cmd = nil
	for i := 0; i < 100; i++ {
		c, err := net.DialTimeout("tcp", s.Addr, 50*time.Millisecond)
		if err != nil {
			return
		}
		c.Close()
		time.Sleep(20 * time.Millisecond)
	}
}

// Freeze stops the server's process (SIGSTOP) without closing its port, as a
// hung server: connections are accepted and never answered. Thaw resumes it.
//
// It returns once every thread of the process is stopped (state T in
// /proc/PID/task/*/stat, polled each millisecond, 10 s at most): kill(2)
// returns before that, and a group stop begins only when one thread takes the
// signal, so on a loaded machine another thread could still answer a request
// sent right after (a CI run's store opened against a "frozen" server that
// had answered its bucket check).
func (s *Server) Freeze() {
	if s.cmd == nil {
		return
	}
	pid := s.cmd.Process.Pid
	if err := s.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		s.t.Fatalf("versitygw: SIGSTOP pid %d: %v", pid, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !allStopped(pid) {
		if time.Now().After(deadline) {
			s.t.Fatalf("versitygw pid %d: not stopped 10 s after SIGSTOP", pid)
		}
		time.Sleep(time.Millisecond)
	}
}

// allStopped reports whether every thread of pid is in state T (stopped), from
// /proc/PID/task/TID/stat (proc(5): the state follows the parenthesised
// command name).
func allStopped(pid int) bool {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			return false
		}
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return true
}

// Thaw resumes a frozen server (SIGCONT).
func (s *Server) Thaw() {
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(syscall.SIGCONT)
	}
}

// DataDir is the directory versitygw keeps its buckets in (one
// sub-directory per bucket, one file per object): what tests read to check
// what reached the server.
func (s *Server) DataDir() string { return filepath.Join(s.dir, "data") }

// String describes the server.
func (s *Server) String() string { return fmt.Sprintf("versitygw %s at %s", Version, s.Endpoint) }
