package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// Prepared containers (engine/gvisor/prepared.go): `torpor serve
// --prepared-containers N` keeps containers created ahead of time, and a
// resume restores into one of its shape.

// preparedLeft lists what of prepared containers is on the host for the
// shared data directory: runsc processes, network namespaces, cgroups,
// mounts, runsc state, bundles, aliases. only, when set, keeps those of
// these runsc ids.
func preparedLeft(only ...string) []string {
	gv := filepath.Join(dataDir, "gvisor")
	scope := gvisor.Scope(gv)
	keep := func(s string) bool {
		if len(only) == 0 {
			return strings.Contains(s, "prep-")
		}
		for _, o := range only {
			if strings.Contains(s, o) {
				return true
			}
		}
		return false
	}
	var out []string
	for _, p := range hostProcs(filepath.Join(gv, "root")) {
		if keep(p) {
			out = append(out, "process "+p)
		}
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), scope+"-") && keep(e.Name()) {
			out = append(out, "netns "+e.Name())
		}
	}
	var globs []string
	for _, pat := range []string{"/sys/fs/cgroup/*/torpor-" + scope + "/*", "/sys/fs/cgroup/torpor-" + scope + "/*",
		filepath.Join(gv, "root", "*"), filepath.Join(gv, "bundles", "*")} {
		m, _ := filepath.Glob(pat)
		globs = append(globs, m...)
	}
	for _, g := range globs {
		if keep(filepath.Base(g)) {
			out = append(out, "file "+g)
		}
	}
	if len(only) == 0 {
		if a, _ := os.ReadDir(filepath.Join(gv, "aliases")); len(a) > 0 {
			out = append(out, "aliases: "+strings.Join(names(a), " "))
		}
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(mi), "\n") {
		if strings.Contains(l, gv) && keep(l) {
			out = append(out, "mount "+l)
		}
	}
	return out
}

// noneLeft waits (up to 30 s: an exited instance is removed after the
// answer) until preparedLeft(only...) is empty, and returns what is left then.
func noneLeft(only ...string) []string {
	deadline := time.Now().Add(30 * time.Second)
	for {
		left := preparedLeft(only...)
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func names(ents []os.DirEntry) []string {
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// readyPrepared waits (up to a minute) until a prepared container's sandbox
// process runs on the shared data directory and returns its runsc id.
func readyPrepared(t *testing.T, not ...string) string {
	t.Helper()
	root := filepath.Join(dataDir, "gvisor", "root")
	deadline := time.Now().Add(time.Minute)
	for {
		m, _ := filepath.Glob(filepath.Join(root, "prep-*_sandbox:*.state"))
		for _, f := range m {
			rid, _, _ := strings.Cut(filepath.Base(f), "_sandbox:")
			b, _ := os.ReadFile(f)
			if bytes.Contains(b, []byte(`"status":"created"`)) && !contains(not, rid) {
				return rid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no prepared container became ready in a minute (state files %v)", m)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// aliasOf returns the runsc id instance sandbox id's current instance was
// restored into ("" when it runs in a container of its own).
func aliasOf(t *testing.T, id string) string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(dataDir, "gvisor", "aliases"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), id+"-") {
			b, _ := os.ReadFile(filepath.Join(dataDir, "gvisor", "aliases", e.Name()))
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// checksummed creates a sandbox running the workload with 64 MiB and
// returns its id and the workload's /checksum answer.
func checksummed(t *testing.T, ctx context.Context, c *client.Client) (string, workload.State) {
	t.Helper()
	id := create(t, c, apiv1.CreateSandboxRequest{}).ID
	if err := workload.Start(ctx, c, id, 64); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	return id, first
}

// checksumFirst resumes hibernated sandbox id by GET /checksum through the
// port proxy, so that hashing its whole 64 MiB buffer is the workload's first
// act after the restore, and checks the hash and that the counter continued.
func checksumFirst(t *testing.T, ctx context.Context, c *client.Client, id string, first workload.State, count *int64, what string) {
	t.Helper()
	t0 := time.Now()
	cs, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatalf("%s: GET /checksum: %v", what, err)
	}
	if cs.SHA256 != first.SHA256 || cs.Bytes != first.Bytes || cs.Pid != first.Pid {
		t.Fatalf("%s: checksum %s of %d bytes in pid %d, want %s of %d in pid %d", what, cs.SHA256, cs.Bytes, cs.Pid, first.SHA256, first.Bytes, first.Pid)
	}
	if cs.Count != *count+1 {
		t.Errorf("%s: count %d, want %d", what, cs.Count, *count+1)
	}
	*count = cs.Count
	t.Logf("%s: checksum right, first answer after %v", what, time.Since(t0).Round(time.Millisecond))
}

// TestPreparedResume: with --prepared-containers 1 a sandbox's hibernate
// prepares a container of its shape, and its first resume restores into it;
// each resume prepares the next. The workload's first act, a checksum of its
// whole 64 MiB buffer, is right; a hibernate right after a resume and a resume
// again keep it right; exec and the file system work in the restored
// sandbox; deleting it removes its container, and the server's shutdown
// removes the prepared one.
func TestPreparedResume(t *testing.T) {
	srv := start(t, servertest.Options{PreparedContainers: 1})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	eng, ok := srv.Engine.(*gvisor.Engine)
	if !ok {
		t.Fatalf("engine %T is not gVisor", srv.Engine)
	}
	if left := preparedLeft(); len(left) > 0 {
		t.Fatalf("prepared containers before the test:\n%s", strings.Join(left, "\n"))
	}
	id, first := checksummed(t, ctx, c)
	count := first.Count
	writeFile(t, c, id, "/root/kept.txt", []byte("kept"))
	if left := preparedLeft(); len(left) > 0 {
		t.Fatalf("prepared containers before any hibernate or resume:\n%s", strings.Join(left, "\n"))
	}

	hibernate(t, c, id)
	rid := readyPrepared(t)
	checksumFirst(t, ctx, c, id, first, &count, "first resume, into the container its hibernate prepared")
	if n := eng.PreparedRestores(); n != 1 {
		t.Fatalf("%d restores into prepared containers, want 1", n)
	}
	if got := aliasOf(t, id); got != rid {
		t.Fatalf("the sandbox's instance runs in %q, want the prepared %s", got, rid)
	}
	next := readyPrepared(t, rid)
	hibernate(t, c, id)
	checksumFirst(t, ctx, c, id, first, &count, "second resume, into the container the first prepared")
	if n := eng.PreparedRestores(); n != 2 {
		t.Fatalf("%d restores into prepared containers, want 2", n)
	}
	if got := aliasOf(t, id); got != next {
		t.Fatalf("the sandbox's instance runs in %q, want the prepared %s", got, next)
	}
	// At once: pages may still be loading in a restore that returned early.
	hibernate(t, c, id)
	checksumFirst(t, ctx, c, id, first, &count, "resume after a hibernate right after a resume")
	if got := string(readFile(t, c, id, "/root/kept.txt")); got != "kept" {
		t.Errorf("/root/kept.txt after resumes: %q", got)
	}
	if out := sh(t, c, id, "echo ok"); out != "ok\n" {
		t.Errorf("exec after resumes: %q", out)
	}
	if sb := wantState(t, c, id, apiv1.StateRunning); sb.LastResume == nil {
		t.Errorf("no resume report after a resume into a prepared container")
	}
	claimed := aliasOf(t, id)
	ready := readyPrepared(t, claimed)
	if err := c.DeleteSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertGone(t, srv, id)
	srv.Manager.Wait()
	if claimed != "" {
		if left := preparedLeft(claimed); len(left) > 0 {
			t.Errorf("after the delete, the container the sandbox was restored into is left:\n%s", strings.Join(left, "\n"))
		}
	}
	if left := preparedLeft(ready); len(left) == 0 {
		t.Errorf("the ready prepared container %s is gone before the shutdown", ready)
	}
	srv.Stop()
	if left := preparedLeft(); len(left) > 0 {
		t.Errorf("after the server's shutdown, prepared containers are left:\n%s", strings.Join(left, "\n"))
	}
}

// TestPreparedCrash: a server killed while it has a prepared container and
// a sandbox restored into another: the next server (without preparation)
// stops the prepared one in its reconcile, reattaches the sandbox by its
// instance id (the alias) with its memory intact, and hibernates and
// resumes it; after its delete and a clean shutdown nothing is left.
func TestPreparedCrash(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--prepared-containers", "1"}}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start()
	defer p.stop()
	c := p.client()
	ctx := ctxFor(t, 10*time.Minute)
	id, first := checksummed(t, ctx, c)
	defer c.DeleteSandbox(context.Background(), id)
	count := first.Count
	hibernate(t, c, id)
	claimed := readyPrepared(t)
	checksumFirst(t, ctx, c, id, first, &count, "resume into the container its hibernate prepared")
	if got := aliasOf(t, id); got != claimed {
		t.Fatalf("the sandbox's instance runs in %q, want the prepared %s", got, claimed)
	}
	ready := readyPrepared(t, claimed)

	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	p.waitKilled()
	if left := preparedLeft(ready); len(left) == 0 {
		t.Fatalf("the prepared container %s did not outlive the killed server", ready)
	}
	p.args = []string{"--prepared-containers", "0"} // only the crashed server's containers remain
	p.start()
	if left := noneLeft(ready); len(left) > 0 {
		t.Errorf("after the restart, the crashed server's prepared container is left:\n%s", strings.Join(left, "\n"))
	}
	wantState(t, c, id, apiv1.StateRunning)
	cs, err := workload.Get(ctx, c, id, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	if cs.SHA256 != first.SHA256 || cs.Pid != first.Pid || cs.Count != count+1 {
		t.Fatalf("reattached sandbox: %+v, want checksum %s, pid %d, count %d", cs, first.SHA256, first.Pid, count+1)
	}
	count = cs.Count
	if out := sh(t, c, id, "echo ok"); out != "ok\n" {
		t.Errorf("exec in the reattached sandbox: %q", out)
	}
	hibernate(t, c, id)
	if left := noneLeft(claimed); len(left) > 0 {
		t.Errorf("after the hibernate, the container the sandbox ran in is left:\n%s", strings.Join(left, "\n"))
	}
	checksumFirst(t, ctx, c, id, first, &count, "resume after the restart")
	if err := c.DeleteSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	p.stop()
	if left := noneLeft(); len(left) > 0 {
		t.Errorf("after the delete and a clean shutdown:\n%s", strings.Join(left, "\n"))
	}
}

// TestResumeOpenedCopyRemoved: a restore reads the snapshot's opened copy
// (chunks/open/<snapshot>), which the store may remove at any time (over its
// bound), and with gvisor.Config.BackgroundRestore reads it after the restore
// returned. Removed right after the resume's answer, the workload's checksum
// of its whole 64 MiB buffer is right; a hibernate then (its parent's copy
// gone) and a resume (the copy rebuilt from the chunks) keep it right. Both a
// restore into a prepared container and a plain one: with one prepared
// container, a second sandbox of another shape (its environment) hibernated
// within a minute of the first's use is turned away from the pool
// (gvisor.Engine.HeldShapes) and restores on its own.
func TestResumeOpenedCopyRemoved(t *testing.T) {
	srv := start(t, servertest.Options{PreparedContainers: 1})
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	eng := srv.Engine.(*gvisor.Engine)
	removed := func(id string, first workload.State, what string) {
		t.Helper()
		count := first.Count
		sb := hibernate(t, c, id)
		if what == "restore into a prepared container" {
			readyPrepared(t)
		}
		before := eng.PreparedRestores()
		dir := filepath.Join(srv.DataDir, "chunks", "open", sb.Snapshot.ID)
		if _, err := c.Resume(ctx, id); err != nil {
			t.Fatalf("%s: resume: %v", what, err)
		}
		if n := eng.PreparedRestores() - before; (n == 1) != (what == "restore into a prepared container") {
			t.Fatalf("%s: %d restores into prepared containers", what, n)
		}
		if !fileExists(filepath.Join(dir, "pages.img")) {
			t.Fatalf("%s: no opened copy %s to remove", what, dir)
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		// The sandbox holds pages.img open until its pages are loaded.
		t.Logf("%s: opened copy removed; its pages.img still open in %d descriptors", what, openedDeleted(sb.Snapshot.ID))
		checksumFirst(t, ctx, c, id, first, &count, what+", its opened copy removed")
		hibernate(t, c, id)
		checksumFirst(t, ctx, c, id, first, &count, what+", then a hibernate and a resume")
	}
	id, first := checksummed(t, ctx, c)
	removed(id, first, "restore into a prepared container")

	other := create(t, c, apiv1.CreateSandboxRequest{Env: map[string]string{"TORPOR_TEST_SHAPE": "other"}}).ID
	if err := workload.Start(ctx, c, other, 64); err != nil {
		t.Fatal(err)
	}
	otherFirst, err := workload.Get(ctx, c, other, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	held := eng.HeldShapes()
	removed(other, otherFirst, "plain restore")
	if eng.HeldShapes() == held {
		t.Errorf("the second shape was not turned away from the full pool")
	}
}

// openedDeleted counts the open descriptors, in all processes, of a removed
// pages.img of snapshot id (the sandbox's mount namespace may show it under
// another prefix).
func openedDeleted(id string) int {
	n := 0
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.Contains(l, id) && strings.HasSuffix(l, "/pages.img (deleted)") {
			n++
		}
	}
	return n
}

// TestPreparedAfterReattach: a sandbox reattached by a restarted server
// (stopped cleanly with the sandbox running) is hibernated there: the
// hibernate prepares a container of its shape, which its resume restores
// into, with the workload's checksum right. A new-user trial found no
// container prepared: the engine knew the shapes of the instances it had
// launched only in memory.
func TestPreparedAfterReattach(t *testing.T) {
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log"),
		args: []string{"--prepared-containers", "1"}}
	p.start()
	defer p.restartAndDeleteAll()
	c := p.client()
	ctx := ctxFor(t, 10*time.Minute)
	id, first := checksummed(t, ctx, c)
	count := first.Count
	p.stop() // the sandbox keeps running
	p.start()
	wantState(t, c, id, apiv1.StateRunning)
	hibernate(t, c, id)
	claimed := readyPrepared(t)
	checksumFirst(t, ctx, c, id, first, &count, "resume of the reattached sandbox")
	if got := aliasOf(t, id); got != claimed {
		t.Fatalf("the sandbox's instance runs in %q, want the prepared %s", got, claimed)
	}
}
