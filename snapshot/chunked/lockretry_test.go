package chunked

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/snapshot"
)

// blippingLock is a CollectLock whose Shared fails (the database does not
// answer) while fails is above 0, counting down at each call.
type blippingLock struct {
	LocalCollectLock
	fails atomic.Int32
	calls atomic.Int32
}

func (l *blippingLock) Shared(ctx context.Context) (func(), func(context.Context) error, error) {
	l.calls.Add(1)
	if l.fails.Add(-1) >= 0 {
		return nil, nil, errors.New("metadata: collection lock: dial tcp: connection refused")
	}
	return l.LocalCollectLock.Shared(ctx)
}

// TestCommitLockRetried: a commit whose collection lock fails twice (a
// database restarting) is retried and commits; one whose lock never comes
// fails with snapshot.ErrLockUnavailable, keeps its staged files, and
// commits once the lock is back.
func TestCommitLockRetried(t *testing.T) {
	lock := &blippingLock{}
	s, err := New(ctx, Config{Dir: t.TempDir(), CollectLock: lock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	files := map[string][]byte{"pages.img": memImage(64)}
	stage := func(id string) snapshot.Manifest {
		dir, err := s.Stage(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if err := writeFiles(dir, files); err != nil {
			t.Fatal(err)
		}
		return snapshot.Manifest{ID: id, SandboxID: "sbx-t", Engine: "test", CreatedAt: time.Now()}
	}

	lock.fails.Store(2)
	if _, err := s.Commit(ctx, "snap-1", stage("snap-1")); err != nil {
		t.Fatalf("commit through two failed lock attempts: %v", err)
	}
	if n := lock.calls.Load(); n != 3 {
		t.Errorf("%d lock attempts, want 3", n)
	}
	mustOpen(t, s, "snap-1", files)

	lock.fails.Store(1000)
	m := stage("snap-2")
	if _, err := s.Commit(ctx, "snap-2", m); !errors.Is(err, snapshot.ErrLockUnavailable) {
		t.Fatalf("commit without a lock: %v, want ErrLockUnavailable", err)
	}
	lock.fails.Store(0)
	if _, err := s.Commit(ctx, "snap-2", m); err != nil {
		t.Fatalf("commit once the lock is back: %v", err)
	}
	mustOpen(t, s, "snap-2", files)
}
