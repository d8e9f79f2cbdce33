package manager_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// wantRefused checks that err is admission control's refusal: kind
// Unavailable, an *AdmissionError with a retry time, a message that says the
// host's memory is full.
func wantRefused(t *testing.T, what string, err error) {
	t.Helper()
	var ae *manager.AdmissionError
	if sandbox.KindOf(err) != sandbox.Unavailable || !errors.As(err, &ae) || manager.RetryAfterSeconds(err) != 7 {
		t.Fatalf("%s: %v (kind %v, retry %d s), want admission's refusal with a retry after 7 s", what, err, sandbox.KindOf(err), manager.RetryAfterSeconds(err))
	}
	t.Logf("%s refused: %v", what, err)
}

// TestAdmission: with room for one 64 MiB sandbox (100 MiB × 1.0) a create
// is admitted and the next refused, with nothing recorded for it; a
// hibernated sandbox holds no memory (another create fits, its resume then
// does not); a fork that would not fit is refused before it makes clones;
// a deleted sandbox frees its memory. A ratio of 1.5 admits two.
func TestAdmission(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{limits: manager.LimitsConfig{HostMemoryBytes: 100 << 20, RetryAfter: 7 * time.Second}})
	a := h.create()
	_, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	wantRefused(t, "second create", err)
	if all, _ := h.m.List(ctx); len(all) != 1 {
		t.Fatalf("after a refused create: %d sandboxes, want 1", len(all))
	}
	if _, err := h.m.Hibernate(ctx, a.ID, manager.HibernateOptions{}); err != nil {
		t.Fatal(err)
	}
	b := h.create() // a hibernated sandbox holds no memory
	_, err = h.m.Resume(ctx, a.ID)
	wantRefused(t, "resume", err)
	if got := h.record(a.ID); got.State != sandbox.StateHibernated {
		t.Errorf("refused resume left %s in state %s, want hibernated", a.ID, got.State)
	}
	_, err = h.m.Fork(ctx, b.ID, 1)
	wantRefused(t, "fork", err)
	if all, _ := h.m.List(ctx); len(all) != 2 {
		t.Errorf("after a refused fork: %d sandboxes, want 2", len(all))
	}
	if err := h.m.Delete(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Resume(ctx, a.ID); err != nil {
		t.Errorf("resume once memory is free: %v", err)
	}

	h2 := newHost(t, hostOpts{limits: manager.LimitsConfig{HostMemoryBytes: 100 << 20, MemoryOvercommit: 1.5, RetryAfter: 7 * time.Second}})
	h2.create()
	h2.create()
	_, err = h2.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	wantRefused(t, "third create at ratio 1.5", err)
}

// TestAdmissionConcurrent: creates that arrive together with room for one
// are admitted once (a call's reservation counts before its record exists).
func TestAdmissionConcurrent(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{limits: manager.LimitsConfig{HostMemoryBytes: 100 << 20, RetryAfter: 7 * time.Second}})
	const n = 4
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
		}()
	}
	wg.Wait()
	ok := 0
	for _, err := range errs {
		if err == nil {
			ok++
		} else {
			wantRefused(t, "concurrent create", err)
		}
	}
	if ok != 1 {
		t.Errorf("%d of %d concurrent creates admitted, want 1", ok, n)
	}
}

// TestPidsLimit: a sandbox that asks for none gets one task per MiBPerPid
// MiB of its memory, capped by the server's configured pids limit, or the
// limit its spec asks for (in range), and its clones keep it.
func TestPidsLimit(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{limits: manager.LimitsConfig{PidsLimit: 300}})
	for mib, want := range map[int]int{64: 32, 256: 128, 512: 256, 1024: 300, 4096: 300} {
		def, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: mib})
		if err != nil {
			t.Fatal(err)
		}
		if def.PidsLimit != want || h.record(def.ID).PidsLimit != want {
			t.Errorf("default pids limit of %d MiB under a cap of 300: %d (record %d), want %d", mib, def.PidsLimit, h.record(def.ID).PidsLimit, want)
		}
		h.m.Delete(ctx, def.ID)
	}
	own, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, PidsLimit: 64})
	if err != nil || own.PidsLimit != 64 {
		t.Fatalf("create with pids_limit 64: %+v %v", own.PidsLimit, err)
	}
	clones, err := h.m.Fork(ctx, own.ID, 1)
	if err != nil || clones[0].PidsLimit != 64 {
		t.Errorf("clone's pids limit %v (%v), want 64", clones, err)
	}
	for _, bad := range []int{-1, manager.MinPidsLimit - 1, manager.MaxPidsLimit + 1} {
		if _, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, PidsLimit: bad}); sandbox.KindOf(err) != sandbox.InvalidArgument {
			t.Errorf("pids_limit %d: %v, want invalid argument", bad, err)
		}
	}
	h2 := newHost(t, hostOpts{})
	if d, err := h2.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 4096}); err != nil || d.PidsLimit != manager.DefaultPidsLimit {
		t.Errorf("pids limit of 4096 MiB without a configured cap: %d (%v), want %d", d.PidsLimit, err, manager.DefaultPidsLimit)
	}
	if d, err := newHost(t, hostOpts{limits: manager.LimitsConfig{PidsLimit: -1}}).m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64}); err != nil || d.PidsLimit != 0 {
		t.Errorf("pids limit with none configured: %d (%v), want 0 (none)", d.PidsLimit, err)
	}
}

// TestChosenIDs: a create and a fork may choose their sandboxes' ids (an
// idempotent call does); a malformed or taken id is refused and makes nothing.
func TestChosenIDs(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	id := manager.NewSandboxID()
	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, ID: id})
	if err != nil || sb.ID != id {
		t.Fatalf("create with id %s: %s %v", id, sb.ID, err)
	}
	if _, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, ID: id}); sandbox.KindOf(err) != sandbox.Conflict {
		t.Errorf("create with a taken id: %v, want conflict", err)
	}
	if _, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, ID: "sbx-NOPE"}); sandbox.KindOf(err) != sandbox.InvalidArgument {
		t.Errorf("create with a malformed id: %v, want invalid argument", err)
	}
	ids := []string{manager.NewSandboxID(), manager.NewSandboxID()}
	clones, err := h.m.Fork(ctx, id, 2, manager.ForkOptions{IDs: ids})
	if err != nil || len(clones) != 2 || clones[0].ID != ids[0] || clones[1].ID != ids[1] {
		t.Fatalf("fork with ids %v: %v %v", ids, clones, err)
	}
	for _, bad := range []struct {
		count int
		ids   []string
	}{{1, ids[:1]}, {2, []string{manager.NewSandboxID()}}, {2, []string{"x", "y"}}} {
		if _, err := h.m.Fork(ctx, id, bad.count, manager.ForkOptions{IDs: bad.ids}); err == nil {
			t.Errorf("fork of %d with ids %v: made clones", bad.count, bad.ids)
		}
	}
	dup := manager.NewSandboxID()
	if _, err := h.m.Fork(ctx, id, 2, manager.ForkOptions{IDs: []string{dup, dup}}); sandbox.KindOf(err) != sandbox.InvalidArgument {
		t.Errorf("fork with one id twice: %v, want invalid argument", err)
	}
	if all, _ := h.m.List(ctx); len(all) != 3 {
		t.Errorf("%d sandboxes after the refused calls, want 3", len(all))
	}
}
