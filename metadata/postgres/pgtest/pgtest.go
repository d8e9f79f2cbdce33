// Package pgtest starts a private PostgreSQL cluster for tests: initdb in a
// new temporary directory, then the postgres server listening only on a unix
// socket in that directory (no TCP port), stopped by its pid and removed when
// the test ends. The binaries are Debian's (package postgresql, which `make
// setup` installs): the newest /usr/lib/postgresql/*/bin, or $TORPOR_PG_BIN.
//
// initdb refuses to run as root, so under root the cluster belongs to the
// system user postgres (made by Debian's package), else nobody; the
// directory is made theirs. Tests skip only when they are not root and no
// binaries are found; as root (`make test`) missing binaries fail the test.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Cluster is a running private cluster. Its superuser is "torpor", trusted
// on the socket without a password.
type Cluster struct {
	// Dir holds the data directory (data/), the socket and the server's log
	// (log).
	Dir string
	// pid is the server's; exited receives once it has exited (nil: not
	// running).
	pid    int
	exited chan error
	n      atomic.Int64
}

// BinDir returns the directory of initdb and postgres: $TORPOR_PG_BIN, else
// the newest /usr/lib/postgresql/<major>/bin; "" if there is none.
func BinDir() string {
	if d := os.Getenv("TORPOR_PG_BIN"); d != "" {
		return d
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return major(dirs[i]) < major(dirs[j]) })
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "initdb")); err == nil {
			return dirs[i]
		}
	}
	return ""
}

func major(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

// Start starts a cluster and stops it (and removes its directory) in
// t.Cleanup. Startup takes a second or two (initdb).
func Start(t testing.TB) *Cluster {
	t.Helper()
	bin := BinDir()
	if bin == "" {
		if os.Geteuid() != 0 {
			t.Skip("no PostgreSQL binaries (initdb) in /usr/lib/postgresql/*/bin: run `make setup` as root (it installs Debian's postgresql) or set TORPOR_PG_BIN")
		}
		t.Fatal("no PostgreSQL binaries (initdb) in /usr/lib/postgresql/*/bin: `make setup` installs Debian's postgresql")
	}
	dir, err := os.MkdirTemp("", "torpor-pg-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir}
	t.Cleanup(func() {
		c.stop(t)
		if t.Failed() {
			if log, err := os.ReadFile(filepath.Join(dir, "log")); err == nil {
				t.Logf("PostgreSQL's log (%s):\n%s", dir, log)
			}
		}
		os.RemoveAll(dir)
	})
	cred, err := owner(dir)
	if err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "data")
	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", "torpor", "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	if cred != nil {
		os.Chown(logf.Name(), int(cred.Uid), int(cred.Gid))
	}
	// Only the socket in dir, no TCP; durability is not a test cluster's job.
	proc := exec.Command(filepath.Join(bin, "postgres"), "-D", data, "-k", dir, "-c", "listen_addresses=",
		"-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	proc.Stdout, proc.Stderr, proc.Dir = logf, logf, dir
	// If the test process dies, so does the cluster: SIGINT (a fast
	// shutdown) when the thread that started it ends, which is kept for the
	// cluster alone until it exits (a Go thread can end under a process).
	proc.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGINT}
	started, exited := make(chan error), make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := proc.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		exited <- proc.Wait()
	}()
	if err := <-started; err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	c.pid, c.exited = proc.Process.Pid, exited
	deadline := time.Now().Add(60 * time.Second)
	for {
		conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
		if err == nil {
			conn.Close(context.Background())
			break
		}
		select {
		case werr := <-exited:
			c.exited = nil
			log, _ := os.ReadFile(filepath.Join(dir, "log"))
			t.Fatalf("postgres exited at start (%v):\n%s", werr, log)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("postgres does not answer on %s: %v", dir, err)
		}
	}
	return c
}

// owner returns the credential the cluster runs with (nil: the current
// user) and makes dir theirs.
func owner(dir string) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	var u *user.User
	var err error
	for _, name := range []string{"postgres", "nobody"} {
		if u, err = user.Lookup(name); err == nil {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("pgtest: initdb refuses root and there is no user postgres or nobody: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
}

// URL returns the connection URL of database db on the cluster (over its
// socket, as user torpor).
func (c *Cluster) URL(db string) string {
	return "postgres://torpor@/" + url.PathEscape(db) + "?host=" + url.QueryEscape(c.Dir)
}

// NewDatabase makes a new empty database on the cluster and returns its URL.
// A cluster that is recovering (a backend died: the log says which) is
// waited for up to 30 s.
func (c *Cluster) NewDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("test_%d", c.n.Add(1))
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := c.exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize())
		if err == nil {
			return c.URL(name)
		}
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "57P03" || time.Now().After(deadline) { // cannot_connect_now
			t.Fatalf("create database %s: %v", name, err)
		}
		t.Logf("create database %s: %v; waiting", name, err)
		time.Sleep(100 * time.Millisecond)
	}
}

// exec runs one statement on database postgres.
func (c *Cluster) exec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// stop shuts the server down (SIGINT, fast shutdown: open sessions are
// ended) and waits for it; after 20 s it is killed.
func (c *Cluster) stop(t testing.TB) {
	if c.exited == nil {
		return
	}
	pid := c.pid
	syscall.Kill(pid, syscall.SIGINT)
	select {
	case <-c.exited:
	case <-time.After(20 * time.Second):
		t.Logf("postgres %d did not stop in 20 s: killed", pid)
		syscall.Kill(pid, syscall.SIGKILL)
		<-c.exited
	}
	c.exited = nil
}
