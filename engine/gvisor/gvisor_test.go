package gvisor_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/enginetest"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/sandboxnet"
	"github.com/torpor/torpor/server/servertest"
)

func TestConformance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	dir := t.TempDir()
	// Spare network pairs as the server has them by default.
	e, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: filepath.Join(dir, "gvisor"), SpareNetworks: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() }) // after the suite's own cleanup (LIFO)
	db, err := sqlite.Open(filepath.Join(dir, "images.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	images, err := image.Open(filepath.Join(dir, "images"), db)
	if err != nil {
		t.Fatal(err)
	}
	images.SetBuildCache(image.BuildCacheFromEnv())
	img, err := images.EnsureBase(context.Background(), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	agent, err := os.ReadFile(servertest.AgentBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(agent)
	guest := filepath.Join(dir, "guest", hex.EncodeToString(sum[:]))
	os.MkdirAll(guest, 0o755)
	if err := os.WriteFile(filepath.Join(guest, "torpor-agent"), agent, 0o555); err != nil {
		t.Fatal(err)
	}
	enginetest.Run(t, enginetest.Setup{Engine: e, Spec: engine.Spec{
		RootFS: images.Path(img.Digest), GuestDir: guest, MemoryMiB: 256, CPUs: 1,
		PidsLimit: 512, WritableMiB: 128, TmpMiB: 64, // restores must reproduce them (limits.go)
	}, KeepsProcesses: true, KillProcesses: func(t *testing.T, id string) {
		pid, err := gvisor.SandboxPid(e, id)
		if err != nil || pid <= 0 {
			t.Fatalf("sandbox pid of %s: %d, %v", id, pid, err)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		// Gone before the next call: its control socket file then refuses
		// the dial, and the engine must say ErrNotRunning without running
		// runsc (counted below; CI saw one fall back when the kill won).
		for deadline := time.Now().Add(10 * time.Second); syscall.Kill(pid, 0) == nil; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("sandbox process %d still there 10 s after SIGKILL", pid)
			}
		}
	}, AfterCheckpointExit: func(t *testing.T, id string) {
		// The exited sandbox waits frozen for Stop, its teardown off the
		// commit's CPU (CheckpointExit).
		st, err := gvisor.FreezerState(e, id)
		if err != nil || (st != "FROZEN" && st != "FREEZING" && st != "1") {
			t.Fatalf("after CheckpointExit: freezer state %q (%v), want it frozen", st, err)
		}
		// A server killed in this window: the next one's engine thaws what
		// is frozen, and listing does not hang on it (it did, until thawed by
		// hand: runsc list waits for every running sandbox's answer).
		e2, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: filepath.Join(dir, "gvisor")})
		if err != nil {
			t.Fatal(err)
		}
		if st, err := gvisor.FreezerState(e2, id); err == nil && (st == "FROZEN" || st == "FREEZING" || st == "1") {
			t.Fatalf("a new engine on the same state left %s frozen (%s)", id, st)
		}
		lctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if _, err := e2.List(lctx); err != nil {
			t.Fatalf("list by a new engine after a CheckpointExit: %v", err)
		}
	}})
	// Every checkpoint of the suite went through the control socket: a runsc
	// whose state file or protocol changed would fall back to `runsc
	// checkpoint` silently and lose the ~10 ms the direct call saves.
	if n := gvisor.RunscCheckpoints(e); n != 0 {
		t.Errorf("%d checkpoints fell back to runsc checkpoint; want 0", n)
	}
	if n := gvisor.RunscPauses(e); n != 0 {
		t.Errorf("%d pauses or unpauses fell back to runsc; want 0", n)
	}
}

// TestLeftoverCgroup: a cgroup an instance left without anything else (a
// runsc delete cut short by a server killed while it ran) is listed, and
// Stop removes it.
func TestLeftoverCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	e, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: filepath.Join(t.TempDir(), "gvisor")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	const id = "sbx-leftover-00000001"
	var dirs []string
	if st, err := os.Stat("/sys/fs/cgroup/memory"); err == nil && st.IsDir() { // cgroup v1
		for _, c := range []string{"memory", "pids", "cpu"} {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", c, "torpor-"+e.HostScope(), id))
		}
	} else {
		dirs = append(dirs, filepath.Join("/sys/fs/cgroup", "torpor-"+e.HostScope(), id))
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Rmdir(d) })
	}
	listed := func() bool {
		infos, err := e.List(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range infos {
			if i.ID == id {
				if i.Running {
					t.Errorf("the leftover cgroup's instance is listed running")
				}
				return true
			}
		}
		return false
	}
	if !listed() {
		t.Fatalf("an instance with only its cgroups %v is not listed", dirs)
	}
	if err := e.Stop(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("cgroup %s still there after Stop", d)
		}
	}
	if listed() {
		t.Errorf("the instance is still listed after Stop")
	}
}

// TestSpareNetworks: the engine keeps its spare pairs made and out of List,
// gives one to an instance by renaming it and makes another; a new engine on
// the same state directory (a crashed server's successor) lists the old
// spares and Stop removes them; DiscardPrepared removes the engine's own.
func TestSpareNetworks(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ctx := context.Background()
	state := filepath.Join(t.TempDir(), "gvisor")
	e, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: state, SpareNetworks: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	names := func() []string {
		n, _ := sandboxnet.List(e.HostScope())
		return n
	}
	waitReady := func(e *gvisor.Engine, want int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if r, _ := e.SpareNetworks(); r == want {
				return
			}
			if time.Now().After(deadline) {
				r, _ := e.SpareNetworks()
				t.Fatalf("%d spare pairs ready after 10 s, want %d (namespaces %v)", r, want, names())
			}
		}
	}
	waitReady(e, 2)
	if got := names(); len(got) != 4 {
		t.Fatalf("namespaces with 2 spare pairs ready: %v", got)
	}
	listIDs := func(e *gvisor.Engine) map[string]bool {
		infos, err := e.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ids := map[string]bool{}
		for _, i := range infos {
			ids[i.ID] = true
		}
		return ids
	}
	if ids := listIDs(e); len(ids) != 0 {
		t.Errorf("List shows the engine's own spares: %v", ids)
	}

	const inst = "sbx-spare-00000001"
	if err := gvisor.TakeNetwork(e, inst); err != nil {
		t.Fatal(err)
	}
	p := sandboxnet.For(e.HostScope(), inst)
	for _, n := range []string{p.Guest, p.Host} {
		if _, err := os.Stat("/run/netns/" + n); err != nil {
			t.Errorf("the instance's namespace %s: %v", n, err)
		}
	}
	if _, taken := e.SpareNetworks(); taken != 1 {
		t.Errorf("taken %d, want 1", taken)
	}
	waitReady(e, 2)
	if got := names(); len(got) != 6 {
		t.Errorf("namespaces after a take and the refill: %v, want the instance's 2 and 4 spares'", got)
	}
	if ids := listIDs(e); len(ids) != 1 || !ids[inst] {
		t.Errorf("List after the take: %v, want only %s", ids, inst)
	}
	if err := e.Stop(ctx, inst); err != nil {
		t.Fatal(err)
	}

	// A successor on the same state directory lists the spares it did not
	// make, and Stop removes them.
	e2, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: state})
	if err != nil {
		t.Fatal(err)
	}
	old := listIDs(e2)
	if len(old) != 2 {
		t.Fatalf("a new engine lists %v, want the 2 spares the first left", old)
	}
	if err := e.DiscardPrepared(ctx); err != nil {
		t.Fatal(err)
	}
	if got := names(); len(got) != 0 {
		t.Errorf("namespaces after DiscardPrepared: %v", got)
	}
	for id := range old {
		if err := e2.Stop(ctx, id); err != nil {
			t.Errorf("stop a spare the first engine left: %v", err)
		}
	}
}
