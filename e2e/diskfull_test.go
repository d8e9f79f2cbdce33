package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
)

// TestDiskFull runs a server whose whole data directory is a small tmpfs
// (1 GiB, mounted by the test and unmounted at its end) and fills the disk
// with a file of the test's own (docs/operations.md#a-full-disk), first to
// 24 MiB free (less than a snapshot needs, room for the database), then to
// nothing:
//
//   - hibernate and pause answer 507 insufficient_storage, naming the data
//     directory's disk, within seconds; the sandbox goes on running (its
//     workload's pid and counter continue, its files read back); no snapshot
//     is recorded and no staging directory is left;
//   - a file write into the sandbox (its writable layer lives in the
//     sandbox's memory, not on the data directory) and a create either
//     succeed or answer 507;
//   - once the file is removed, the same hibernate succeeds and the sandbox
//     resumes with its workload and files.
func TestDiskFull(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1g,mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs at %s: %v: %s", dir, err, out)
	}
	t.Cleanup(func() { // after the server's own clean-up (registered later, run first)
		syscall.Unmount(filepath.Join(dir, "gvisor", "root", "null-netns"), syscall.MNT_DETACH)
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
			syscall.Unmount(dir, syscall.MNT_DETACH)
		}
	})
	srv := servertest.Start(t, servertest.Options{DataDir: dir, Store: server.StoreConfig{Kind: "chunked"}})
	filler := filepath.Join(dir, "filler")
	t.Cleanup(func() { os.Remove(filler) }) // before the server's clean-up deletes the sandboxes
	c := srv.Client
	ctx := ctxFor(t, 10*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 256})
	if err := workload.Start(ctx, c, sb.ID, 32); err != nil {
		t.Fatal(err)
	}
	first, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	count, gen := first.Count, sb.Generation
	kept := map[string][]byte{}
	writeKept := func(path string) error {
		data := make([]byte, 256<<10)
		rand.Read(data)
		if err := c.WriteFile(ctx, sb.ID, path, bytes.NewReader(data)); err != nil {
			return err
		}
		kept[path] = data
		return nil
	}
	if err := writeKept("/root/before-full"); err != nil {
		t.Fatal(err)
	}
	snapsBefore := snapshotIDs(t, c)
	var extra []string

	for _, leave := range []int64{24 << 20, 0} {
		free := fillDisk(t, filler, leave)
		t.Logf("disk filled: %d KiB free on %s", free>>10, dir)
		refusedFull(t, ctx, c, sb.ID, dir, first, &count)
		// A write into the sandbox and a create: done, or refused with 507.
		if err := writeKept(fmt.Sprintf("/root/while-full-%d", leave)); err != nil {
			t.Logf("file write with the disk full: %v", err)
			wantFull(t, "file write", err, dir)
		}
		if sb2, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 128}); err != nil {
			t.Logf("create with the disk full: %v", err)
			wantFull(t, "create", err, dir)
		} else {
			t.Logf("create with the disk full: %s, %s", sb2.ID, sb2.State)
			extra = append(extra, sb2.ID)
		}
		readBack(t, ctx, c, sb.ID, kept)
		if got := snapshotIDs(t, c); len(got) != len(snapsBefore) {
			t.Errorf("snapshots with the disk full: %v, before %v", got, snapsBefore)
		}
		for _, sub := range []string{"chunks/staging", "snapshots/.staging"} {
			if ents, _ := os.ReadDir(filepath.Join(dir, sub)); len(ents) > 0 {
				t.Errorf("%s holds %d entries after the refused calls", sub, len(ents))
			}
		}
	}

	// Space freed: the same calls succeed.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	h := hibernate(t, c, sb.ID)
	if h.Snapshot == nil {
		t.Fatal("hibernate after freeing space: no snapshot")
	}
	resumeByRequest(t, ctx, c, sb.ID, 1, first, &count, &gen)
	readBack(t, ctx, c, sb.ID, kept)
	pause(t, c, sb.ID)
	checkWorkload(t, ctx, c, sb.ID, "unpaused after freeing space", first, &count)
	extra = append(extra, create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 128}).ID)
	for _, id := range extra {
		if err := c.DeleteSandbox(ctx, id); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
}

// refusedFull checks that hibernate and pause of running sandbox id answer
// 507 naming the disk of dir, within 30 s, and leave it running with its
// workload continuing.
func refusedFull(t *testing.T, ctx context.Context, c *client.Client, id, dir string, first workload.State, count *int64) {
	t.Helper()
	for _, op := range []string{"hibernate", "pause"} {
		t0 := time.Now()
		var err error
		if op == "hibernate" {
			_, err = c.Hibernate(ctx, id)
		} else {
			_, err = c.Pause(ctx, id)
		}
		took := time.Since(t0)
		t.Logf("%s with the disk full: %v after %v", op, err, took.Round(time.Millisecond))
		wantFull(t, op, err, dir)
		if took > 30*time.Second {
			t.Errorf("%s with the disk full answered after %v", op, took)
		}
		if st := get(t, c, id).State; st != apiv1.StateRunning {
			t.Fatalf("after the refused %s: state %s, want running", op, st)
		}
		checkWorkload(t, ctx, c, id, "after the refused "+op, first, count)
	}
}

// fillDisk writes path (appending) until its filesystem has at most leave
// bytes free, or none, and returns the bytes left free (statfs f_bavail).
func fillDisk(t *testing.T, path string, leave int64) int64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	free := func() int64 {
		var st syscall.Statfs_t
		if err := syscall.Statfs(path, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Bavail) * int64(st.Bsize)
	}
	buf := make([]byte, 1<<20)
	for n := len(buf); free() > leave; {
		if _, err := f.Write(buf[:n]); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill %s: %v", path, err)
			}
			if n == 4096 {
				break
			}
			n = 4096 // the last MiB, in pages
		}
	}
	return free()
}

// wantFull fails t unless err is the API's 507 insufficient_storage whose
// message names the data directory's disk.
func wantFull(t *testing.T, op string, err error, dir string) {
	t.Helper()
	var ae *client.APIError
	if !errors.As(err, &ae) {
		t.Fatalf("%s with the disk full: %v; want 507 insufficient_storage", op, err)
	}
	if ae.Status != http.StatusInsufficientStorage || ae.Code != apiv1.CodeInsufficientStorage ||
		!strings.Contains(ae.Message, "disk is full") || !strings.Contains(ae.Message, dir) {
		t.Fatalf("%s with the disk full: HTTP %d %s %q; want 507 insufficient_storage naming the disk of %s", op, ae.Status, ae.Code, ae.Message, dir)
	}
}

// snapshotIDs lists the snapshots' ids.
func snapshotIDs(t *testing.T, c *client.Client) []string {
	t.Helper()
	snaps, err := c.ListSnapshots(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range snaps {
		ids = append(ids, s.ID)
	}
	return ids
}

// readBack checks that every file of kept reads back from sandbox id.
func readBack(t *testing.T, ctx context.Context, c *client.Client, id string, kept map[string][]byte) {
	t.Helper()
	for p, want := range kept {
		rc, err := c.ReadFile(ctx, id, p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil || !bytes.Equal(b, want) {
			t.Fatalf("read %s: %d bytes (err %v), want the %d written", p, len(b), err, len(want))
		}
	}
}
