package chunked

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Every Open takes its snapshot's lock in s.opening; the entries must go when
// the last Open of a snapshot is done, or a long-running server's map grows
// with every snapshot it ever opened.
func TestOpeningLocksReleased(t *testing.T) {
	s := newFSStore(t)
	const n = 40
	files := make([]map[string][]byte, n)
	for i := range files {
		files[i] = map[string][]byte{"pages.img": memImage(16), "checkpoint.img": []byte(fmt.Sprint("kernel ", i))}
		commit(t, s, fmt.Sprintf("snap-%d", i), files[i])
	}
	dropLocal(t, s) // the first round rebuilds every copy, the second verifies it
	for round := 0; round < 2; round++ {
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			for j := 0; j < 3; j++ { // three Opens of each snapshot at once
				wg.Add(1)
				go func() {
					defer wg.Done()
					id := fmt.Sprintf("snap-%d", i)
					dir, _, err := s.Open(ctx, id)
					if err != nil {
						t.Errorf("open %s: %v", id, err)
						return
					}
					for name, want := range files[i] {
						if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(got, want) {
							t.Errorf("open %s: file %s differs (%v)", id, name, err)
						}
					}
				}()
			}
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		if got := s.opening.len(); got != 0 {
			t.Fatalf("round %d: after %d snapshots were opened, %d entries remain in the opening map", round, n, got)
		}
	}
}

// A snapshot's lock excludes a second holder until it is released, whatever
// entry removal does in between; another snapshot's lock is independent.
func TestSnapshotLocksExclude(t *testing.T) {
	l := snapshotLocks{locks: map[string]*snapshotLock{}}
	unlock := l.lock("a")
	var got atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		u := l.lock("a")
		got.Store(true)
		u()
	}()
	for users := 0; users < 2; { // until the second caller waits for the lock
		time.Sleep(time.Millisecond)
		l.mu.Lock()
		users = l.locks["a"].users
		l.mu.Unlock()
	}
	unlockB := l.lock("b") // not held up by a's holder
	unlockB()
	time.Sleep(10 * time.Millisecond)
	if got.Load() {
		t.Fatal("a second caller took snapshot a's lock while the first held it")
	}
	unlock()
	<-done
	if !got.Load() {
		t.Fatal("the second caller never got the lock")
	}
	if n := l.len(); n != 0 {
		t.Fatalf("%d entries left after every lock was released", n)
	}
}
