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
	"github.com/torpor/torpor/server/servertest"
)

func TestConformance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	dir := t.TempDir()
	e, err := gvisor.New(gvisor.Config{Runsc: servertest.Runsc(t), StateDir: filepath.Join(dir, "gvisor")})
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
