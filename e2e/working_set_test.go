package e2e

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/server"
	"github.com/torpor/torpor/server/servertest"
	"github.com/torpor/torpor/workload"
	"golang.org/x/sys/unix"
)

// TestResumeReadsWholeMemoryFile measures the working set of a resume at the
// pinned runsc: a 1 GiB sandbox holding 64 MiB is hibernated to the chunked
// store and resumed with its engine restore held back 4 s (ResumeDelay); once
// the store has opened (and read, to verify) the copy, its pages.img is
// written back and dropped from the page cache, and once the resume's first
// request (/count, which touches none of the data) is answered, mincore(2)
// tells which of its pages runsc read (the kernel's readahead counts too).
// runsc's restore loads every page of pages.img before the application runs
// (docs/snapshot-store.md#cold-resumes-and-the-working-set), so the test
// expects all of them: if a runsc upgrade reads less, a streamed cold resume
// (docs/snapshot-store.md#streamed-cold-resumes) pays without --background,
// and this test says so. It
// also checks that pages.img holds the pages the sandbox used, not its memory
// size (why a 1 GiB sandbox holding 64 MiB resumes as fast as a 64 MiB one),
// and that the resumed process kept its counter and data.
func TestResumeReadsWholeMemoryFile(t *testing.T) {
	srv := startWithOptions(t, servertest.Options{Store: server.StoreConfig{Kind: "chunked"}, ResumeDelay: 4 * time.Second})
	c := srv.Client
	ctx := ctxFor(t, 3*time.Minute)
	sb := create(t, c, apiv1.CreateSandboxRequest{MemoryMiB: 1024})
	if err := workload.Start(ctx, c, sb.ID, 64); err != nil {
		t.Fatal(err)
	}
	before, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.Hibernate(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	pages := filepath.Join(dataDir, "chunks", "open", h.Snapshot.ID, "pages.img")
	f, err := os.Open(pages)
	if err != nil {
		t.Fatalf("opened copy: %v", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > 160<<20 {
		t.Errorf("pages.img of a 1 GiB sandbox holding 64 MiB is %d MiB: gVisor saved more than the pages in use", st.Size()>>20)
	}
	type answer struct {
		st  workload.State
		err error
	}
	got := make(chan answer, 1)
	go func() { // resumes the sandbox; /count touches none of the data
		st, err := workload.Get(ctx, c, sb.ID, "/count")
		got <- answer{st, err}
	}()
	time.Sleep(2 * time.Second) // the store's Open (a few ms) is done; the restore waits
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if in, n := residentPages(t, f, st.Size()); in > n/10 {
		t.Fatalf("pages.img: %d of %d pages still in the page cache after FADV_DONTNEED", in, n)
	}
	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	in, n := residentPages(t, f, st.Size())
	after, err := workload.Get(ctx, c, sb.ID, "/checksum")
	if err != nil {
		t.Fatal(err)
	}
	if a.st.Count != before.Count+1 || after.Count != before.Count+2 || after.SHA256 != before.SHA256 || after.Pid != before.Pid {
		t.Fatalf("after the resume: %+v then %+v, before %+v", a.st, after, before)
	}
	t.Logf("pages.img %d MiB (sandbox 1 GiB, 64 MiB of data): %d of %d pages read by the restore (%.1f%%)",
		st.Size()>>20, in, n, 100*float64(in)/float64(n))
	if float64(in) < 0.95*float64(n) {
		t.Errorf("the restore read %d of %d pages of pages.img before its first request: runsc now restores lazily; "+
			"measure --stream-cold-resumes without --background-restore (docs/snapshot-store.md)", in, n)
	}
}

// residentPages reports how many of the 4 KiB pages of f's first size bytes
// are in the page cache (mincore of a read-only shared mapping), and of how many.
func residentPages(t *testing.T, f *os.File, size int64) (in, n int) {
	t.Helper()
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, e := syscall.Syscall(syscall.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatalf("mincore: %v", e)
	}
	for _, v := range vec {
		in += int(v & 1)
	}
	return in, len(vec)
}
