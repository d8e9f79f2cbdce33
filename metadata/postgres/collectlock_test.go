package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata/postgres/pgtest"
)

// testCollectLock checks the collection lock's semantics between two
// stores (two nodes) on one database: shared holds coexist, the exclusive
// try-lock fails at once while one exists (and a shared hold waits for an
// exclusive one), other store ids are other locks, and a hold whose session
// ends reports itself lost.
func testCollectLock(t *testing.T, c *pgtest.Cluster) {
	url := c.NewDatabase(t)
	a, err := Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	la, lb := a.CollectLock("store-1"), b.CollectLock("store-1")

	relA, heldA, err := la.Shared(ctx)
	if err != nil {
		t.Fatal(err)
	}
	relB, _, err := lb.Shared(ctx) // shared holds coexist
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if _, _, ok, err := lb.TryExclusive(ctx); err != nil || ok {
		t.Fatalf("exclusive while shared held: ok %v err %v, want false", ok, err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("the try-lock waited %v", d)
	}
	if rel, _, ok, err := b.CollectLock("store-2").TryExclusive(ctx); err != nil || !ok {
		t.Fatalf("another store id's lock: ok %v err %v", ok, err)
	} else {
		rel()
	}
	if err := heldA(ctx); err != nil {
		t.Fatalf("held: %v", err)
	}
	relA()
	if _, _, ok, _ := lb.TryExclusive(ctx); ok {
		t.Fatal("exclusive granted while B holds it shared")
	}
	relB()

	relX, heldX, ok, err := lb.TryExclusive(ctx)
	if err != nil || !ok {
		t.Fatalf("exclusive with nothing held: ok %v err %v", ok, err)
	}
	if err := heldX(ctx); err != nil {
		t.Fatalf("held: %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, _, err = la.Shared(wctx) // waits for the collection, here until its deadline
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("shared while exclusive held: %v, want the deadline", err)
	}
	if _, _, ok, _ := la.TryExclusive(ctx); ok {
		t.Fatal("two exclusive holders")
	}
	got := make(chan error, 1)
	go func() {
		rel, _, err := la.Shared(ctx)
		if err == nil {
			rel()
		}
		got <- err
	}()
	time.Sleep(100 * time.Millisecond)
	select {
	case err := <-got:
		t.Fatalf("shared granted during the collection (%v)", err)
	default:
	}
	relX()
	if err := <-got; err != nil {
		t.Fatalf("shared after the collection: %v", err)
	}

	// A session that ends (the database restarts it, the network drops it)
	// loses its lock, and its holder learns so.
	relS, heldS, err := la.Shared(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.sql.ExecContext(ctx, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objsubid = 2 AND l.granted`, int64(collectLockKey)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for heldS(ctx) == nil {
		if time.Now().After(deadline) {
			t.Fatal("a terminated session's hold still reports itself held")
		}
		time.Sleep(20 * time.Millisecond)
	}
	relS() // releasing a lost hold is harmless
	// The server releases the session's locks once its backend has exited,
	// which may be just after the client saw the connection go.
	for {
		rel, _, ok, err := lb.TryExclusive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			rel()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("exclusive not granted after the holder's session ended")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The pool still works after the broken connection was discarded.
	if rel, _, err := la.Shared(ctx); err != nil {
		t.Fatal(err)
	} else {
		rel()
	}
}
