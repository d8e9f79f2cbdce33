// Package storetest is the conformance suite of metadata.Store: every
// implementation runs Run from its own tests and must pass it unchanged. It
// checks what the sandbox manager relies on: every record kind's create,
// read, list order, update and delete (API keys: by id and by hash, the
// last-used time), the not-found and exists errors, the
// version check on sandbox updates, idempotency keys (one claim of a key
// wins, also at once; finish, delete, expiry by time) (also inside BeginRestore and
// CommitHibernate, which must then write nothing), the generation counter,
// concurrent updates of different records, and that records survive a
// reopen (a schema set up once is set up again without change); node
// records: register again, heartbeat, draining kept over a restart; warm
// pool settings (set, replace, list order, delete, a template snapshot
// recorded with its pool and kept from collection while a pool names it).
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// Opener gives each test a new, empty place to keep records (a database file,
// a database schema) and returns the function that opens a Store on it. open
// may be called several times: each call returns a new Store over the same
// records (a reopen). The suite closes the stores it opens.
type Opener func(t *testing.T) (open func() (metadata.Store, error))

// Run runs the suite against the implementation that newStore opens.
func Run(t *testing.T, newStore Opener) {
	for _, c := range []struct {
		name string
		f    func(*testing.T, metadata.Store)
	}{
		{"SandboxRoundTrip", testSandboxRoundTrip},
		{"SandboxErrors", testSandboxErrors},
		{"SandboxOrder", testSandboxOrder},
		{"StaleUpdate", testStaleUpdate},
		{"StaleTransactions", testStaleTransactions},
		{"Generation", testGeneration},
		{"Snapshots", testSnapshots},
		{"KeptSnapshots", testKeptSnapshots},
		{"Volumes", testVolumes},
		{"Images", testImages},
		{"APIKeys", testAPIKeys},
		{"IdempotencyKeys", testIdempotencyKeys},
		{"ConcurrentUpdates", testConcurrentUpdates},
		{"Nodes", testNodes},
		{"Leases", testLeases},
		{"ConcurrentClaims", testConcurrentClaims},
		{"Pools", testPools},
		{"Secrets", testSecrets},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.f(t, openStore(t, newStore(t)))
		})
	}
	t.Run("Reopen", func(t *testing.T) { testReopen(t, newStore(t)) })
}

func openStore(t *testing.T, open func() (metadata.Store, error)) metadata.Store {
	t.Helper()
	st, err := open()
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

var ctx = context.Background()

// at is a whole-second time; at(n).Add(d) gives sub-second ones.
func at(sec int) time.Time { return time.Date(2030, 1, 1, 0, 0, sec, 0, time.UTC) }

func tp(t time.Time) *time.Time { return &t }

// fullSandbox is a record with every field set.
func fullSandbox(id string) *metadata.Sandbox {
	return &metadata.Sandbox{
		ID: id, State: sandbox.StateHibernated, Image: "base", ImageDigest: "sha256:aa", GuestDigest: "g1",
		MemoryMiB: 256, CPUs: 0.5, Env: map[string]string{"A": "1", "B": "two words"}, PidsLimit: 333, Generation: 7,
		ForkedFrom: "sbx-src", SnapshotID: "snap-" + id, PendingSnapshot: "snap-p" + id, Instance: id + "-00000003", Seq: 3,
		Owner: "node-a", SnapshotNode: "node-b",
		Error: "an error", Deleting: true, CreatedAt: at(1).Add(250 * time.Millisecond), StateChangedAt: at(2),
		LastHibernateAt: tp(at(3)), LastResumeAt: tp(at(4).Add(time.Microsecond)), ResumeMS: 321,
		Policy: sandbox.Policy{IdleTimeoutS: 60, TimeoutS: 3600, OnTimeout: sandbox.OnTimeoutDelete,
			HibernationMode: sandbox.ModeFilesystem, OnResume: []string{"sh", "-c", "serve"},
			Volumes:   []sandbox.VolumeMount{{Name: "data", Path: "/data"}, {Name: "cache", Path: "/cache"}},
			ExpiresAt: tp(at(100)), ResumeOnRequest: true,
			Network: sandbox.Network{InternetAccess: true, AllowOut: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")},
				DenyOut:        []netip.Prefix{netip.MustParsePrefix("203.0.113.7/32"), netip.MustParsePrefix("2001:db8::/32")},
				PrivateTraffic: true}},
		Metadata: map[string]string{"user": "abc", "my key": "a&b=c"},
		Meter:    metadata.Meter{RunningMS: 90000, SnapshotByteS: 123.5, UsageAt: at(5), TimeoutBaseMS: 1000},
		LastResume: &sandbox.ResumeReport{Event: "resume", Generation: 7, Forked: true, SnapshotID: "snap-0",
			Steps:       []sandbox.ResumeStep{{Name: "reseed", MS: 0.25, OK: true, Detail: "d"}},
			Clock:       sandbox.ResumeClock{SkewMS: -3.5, Corrected: "offset-file"},
			Subscribers: sandbox.ResumeSubscribers{Total: 2, Acked: 1, TimedOut: []string{"pid 7"}},
			Hooks:       []sandbox.ResumeHook{{Name: "10-x", ExitCode: 3, MS: 5, TimedOut: true, Output: "out"}},
			OK:          false, WindowMS: 12.5, AgentMS: 30, Error: "e"},
	}
}

// minimalSandbox is a record with only what a create always sets.
func minimalSandbox(id string, created time.Time) *metadata.Sandbox {
	return &metadata.Sandbox{ID: id, State: sandbox.StateCreating, Image: "base", ImageDigest: "sha256:aa",
		GuestDigest: "g1", MemoryMiB: 512, CPUs: 1, Generation: 1, Seq: 1, Instance: id + "-00000001",
		CreatedAt: created, StateChangedAt: created,
		Policy: sandbox.Policy{IdleTimeoutS: 15, OnTimeout: sandbox.OnTimeoutHibernate, HibernationMode: sandbox.ModeMemory}}
}

func create(t *testing.T, st metadata.Store, s *metadata.Sandbox) {
	t.Helper()
	if err := st.CreateSandbox(ctx, s); err != nil {
		t.Fatalf("create %s: %v", s.ID, err)
	}
}

func get(t *testing.T, st metadata.Store, id string) *metadata.Sandbox {
	t.Helper()
	s, err := st.GetSandbox(ctx, id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return s
}

// equal compares records by value; times by instant.
func equal(a, b any) bool {
	return reflect.DeepEqual(normal(reflect.ValueOf(a)).Interface(), normal(reflect.ValueOf(b)).Interface())
}

// normal returns a copy of v with every time.Time in UTC.
func normal(v reflect.Value) reflect.Value {
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			return v
		}
		p := reflect.New(v.Type().Elem())
		p.Elem().Set(normal(v.Elem()))
		return p
	case reflect.Struct:
		if t, ok := v.Interface().(time.Time); ok {
			return reflect.ValueOf(t.UTC())
		}
		c := reflect.New(v.Type()).Elem()
		for i := 0; i < v.NumField(); i++ {
			if c.Field(i).CanSet() {
				c.Field(i).Set(normal(v.Field(i)))
			}
		}
		return c
	case reflect.Slice:
		if v.IsNil() {
			return v
		}
		c := reflect.MakeSlice(v.Type(), v.Len(), v.Len())
		for i := 0; i < v.Len(); i++ {
			c.Index(i).Set(normal(v.Index(i)))
		}
		return c
	}
	return v
}

// testSandboxRoundTrip: every field of a record reads back as written, after
// a create and after an update; nil and empty lists stay apart in the resume
// report; versions start at 1 and advance by one per update.
func testSandboxRoundTrip(t *testing.T, st metadata.Store) {
	full := fullSandbox("sbx-full")
	create(t, st, full)
	if full.Version != 1 || full.LeaseToken != 1 {
		t.Fatalf("version and lease token after create: %d %d, want 1 1", full.Version, full.LeaseToken)
	}
	if got := get(t, st, "sbx-full"); !equal(got, full) {
		t.Fatalf("created record read back as\n%+v\nwant\n%+v", got, full)
	}
	min := minimalSandbox("sbx-min", at(1))
	create(t, st, min)
	if got := get(t, st, "sbx-min"); !equal(got, min) {
		t.Fatalf("minimal record read back as\n%+v\nwant\n%+v", got, min)
	}

	// Change every changeable field, clear the optional ones.
	s := get(t, st, "sbx-full")
	s.State, s.Error, s.Deleting, s.Instance, s.PendingSnapshot = sandbox.StateRunning, "", false, "", ""
	s.Owner, s.SnapshotNode = "", "node-c"
	s.Env = map[string]string{"C": "3"}
	s.LastHibernateAt, s.ExpiresAt, s.OnResume, s.Volumes = nil, nil, nil, nil
	s.Generation, s.Seq, s.ResumeMS, s.RunningMS, s.UsageAt = 8, 4, 12, 91000, at(6)
	s.LastResume = &sandbox.ResumeReport{Event: "start", Steps: []sandbox.ResumeStep{}, OK: true}
	// A network policy of private traffic alone (no egress) is kept too.
	s.Network = sandbox.Network{PrivateTraffic: true}
	if err := st.UpdateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	if s.Version != 2 {
		t.Fatalf("version after update: %d, want 2", s.Version)
	}
	got := get(t, st, "sbx-full")
	if !equal(got, s) {
		t.Fatalf("updated record read back as\n%+v\nwant\n%+v", got, s)
	}
	if got.LastResume.Steps == nil || got.LastResume.Hooks != nil {
		t.Errorf("resume report lists: steps %#v (want empty), hooks %#v (want nil)", got.LastResume.Steps, got.LastResume.Hooks)
	}
	got.LastResume = nil
	if err := st.UpdateSandbox(ctx, got); err != nil {
		t.Fatal(err)
	}
	if r := get(t, st, "sbx-full").LastResume; r != nil {
		t.Errorf("cleared resume report reads %+v", r)
	}
}

// testSandboxErrors: ErrExists for a taken id (the stored record unchanged),
// ErrNotFound for get, update and delete of a missing record.
func testSandboxErrors(t *testing.T, st metadata.Store) {
	s := minimalSandbox("sbx-a", at(1))
	create(t, st, s)
	dup := minimalSandbox("sbx-a", at(2))
	dup.Image = "other"
	if err := st.CreateSandbox(ctx, dup); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("create of a taken id: %v, want ErrExists", err)
	}
	if got := get(t, st, "sbx-a"); got.Image != "base" {
		t.Errorf("a refused create changed the record: image %q", got.Image)
	}
	if _, err := st.GetSandbox(ctx, "sbx-none"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get of a missing id: %v", err)
	}
	missing := minimalSandbox("sbx-none", at(1))
	missing.Version = 1
	if err := st.UpdateSandbox(ctx, missing); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("update of a missing id: %v", err)
	}
	if _, err := st.GetSandbox(ctx, "sbx-none"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("an update of a missing id made it: %v", err)
	}
	if err := st.DeleteSandbox(ctx, "sbx-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetSandbox(ctx, "sbx-a"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if err := st.DeleteSandbox(ctx, "sbx-a"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	if all, err := st.ListSandboxes(ctx); err != nil || len(all) != 0 {
		t.Errorf("list after delete: %d records, %v", len(all), err)
	}
	// A deleted id can be created again.
	create(t, st, minimalSandbox("sbx-a", at(3)))
}

// testSandboxOrder: ListSandboxes is oldest first by CreatedAt (sub-second
// differences count), then by id, whatever the order of creation.
func testSandboxOrder(t *testing.T, st metadata.Store) {
	times := map[string]time.Time{
		"sbx-d": at(3),
		"sbx-b": at(1).Add(500 * time.Millisecond),
		"sbx-c": at(1),
		"sbx-a": at(2),
		"sbx-e": at(1).Add(500 * time.Millisecond),
		"sbx-f": at(1).Add(5 * time.Millisecond),
	}
	for _, id := range []string{"sbx-d", "sbx-b", "sbx-c", "sbx-a", "sbx-e", "sbx-f"} {
		create(t, st, minimalSandbox(id, times[id]))
	}
	all, err := st.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range all {
		ids = append(ids, s.ID)
	}
	if want := []string{"sbx-c", "sbx-f", "sbx-b", "sbx-e", "sbx-a", "sbx-d"}; !reflect.DeepEqual(ids, want) {
		t.Errorf("list order %v, want %v", ids, want)
	}
}

// testStaleUpdate: of two writers that read the same version, the second
// update fails with ErrStale and the record keeps the first one's values.
func testStaleUpdate(t *testing.T, st metadata.Store) {
	create(t, st, minimalSandbox("sbx-a", at(1)))
	first, second := get(t, st, "sbx-a"), get(t, st, "sbx-a")
	first.Error = "first writer"
	if err := st.UpdateSandbox(ctx, first); err != nil {
		t.Fatal(err)
	}
	second.Error = "second writer"
	second.State = sandbox.StateError
	if err := st.UpdateSandbox(ctx, second); !errors.Is(err, metadata.ErrStale) {
		t.Fatalf("second writer's update: %v, want ErrStale", err)
	}
	if second.Version != 1 {
		t.Errorf("a refused update advanced the caller's version to %d", second.Version)
	}
	got := get(t, st, "sbx-a")
	if got.Error != "first writer" || got.State != sandbox.StateCreating || got.Version != 2 {
		t.Errorf("after the refused update: error %q state %s version %d", got.Error, got.State, got.Version)
	}
	// Having read again, the second writer succeeds.
	got.Error = "second writer"
	if err := st.UpdateSandbox(ctx, got); err != nil || got.Version != 3 {
		t.Errorf("update after a new read: %v, version %d", err, got.Version)
	}
}

// testStaleTransactions: BeginRestore and CommitHibernate check the version
// too and, refused, write nothing: no generation taken, no snapshot record.
func testStaleTransactions(t *testing.T, st metadata.Store) {
	create(t, st, minimalSandbox("sbx-a", at(1)))
	stale := get(t, st, "sbx-a")
	fresh := get(t, st, "sbx-a")
	if err := st.UpdateSandbox(ctx, fresh); err != nil {
		t.Fatal(err)
	}
	before, err := st.NextGeneration(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stale.State = sandbox.StateResuming
	if _, err := st.BeginRestore(ctx, stale); !errors.Is(err, metadata.ErrStale) {
		t.Fatalf("stale begin restore: %v", err)
	}
	if g, _ := st.NextGeneration(ctx); g != before+1 {
		t.Errorf("a refused begin restore took a generation: next is %d, want %d", g, before+1)
	}
	snap := &metadata.Snapshot{ID: "snap-1", SandboxID: "sbx-a", Bytes: 1, Engine: "e", CreatedAt: at(2)}
	stale.SnapshotID = "snap-1"
	if err := st.CommitHibernate(ctx, snap, stale); !errors.Is(err, metadata.ErrStale) {
		t.Fatalf("stale commit hibernate: %v", err)
	}
	if _, err := st.GetSnapshot(ctx, "snap-1"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("a refused commit hibernate left its snapshot record: %v", err)
	}
	if got := get(t, st, "sbx-a"); got.State != sandbox.StateCreating || got.SnapshotID != "" || got.Version != 2 {
		t.Errorf("record after refused transactions: %+v", got)
	}
	// A missing sandbox: ErrNotFound, and again nothing written.
	ghost := minimalSandbox("sbx-ghost", at(1))
	ghost.Version = 1
	if err := st.CommitHibernate(ctx, snap, ghost); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("commit hibernate of a missing sandbox: %v", err)
	}
	if _, err := st.GetSnapshot(ctx, "snap-1"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("commit hibernate of a missing sandbox left its snapshot: %v", err)
	}
}

// testGeneration: the counter starts at 1, BeginRestore takes the next value
// and writes the record in the same call, and concurrent calls never get the
// same value.
func testGeneration(t *testing.T, st metadata.Store) {
	g, err := st.NextGeneration(ctx)
	if err != nil || g != 1 {
		t.Fatalf("first generation %d %v, want 1", g, err)
	}
	s := minimalSandbox("sbx-a", at(1))
	create(t, st, s)
	s.State, s.Instance = sandbox.StateResuming, "sbx-a-00000002"
	rg, err := st.BeginRestore(ctx, s)
	if err != nil || rg != 2 || s.Version != 2 {
		t.Fatalf("begin restore: generation %d version %d %v, want 2 and 2", rg, s.Version, err)
	}
	if got := get(t, st, "sbx-a"); got.State != sandbox.StateResuming || got.Instance != "sbx-a-00000002" || got.Version != 2 {
		t.Errorf("record after begin restore: %+v", got)
	}
	const n = 40
	seen := make(chan int64, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := st.NextGeneration(ctx)
			if err != nil {
				t.Error(err)
			}
			seen <- g
		}()
	}
	wg.Wait()
	close(seen)
	got := map[int64]bool{}
	for g := range seen {
		if got[g] || g < 3 || g > 2+n {
			t.Errorf("generation %d: repeated or out of 3..%d", g, 2+n)
		}
		got[g] = true
	}
}

// testSnapshots: CommitHibernate makes the record and updates the sandbox;
// list order, sizes, users, unreferenced records, delete and errors.
func testSnapshots(t *testing.T, st metadata.Store) {
	a, b := minimalSandbox("sbx-a", at(1)), minimalSandbox("sbx-b", at(1))
	create(t, st, a)
	create(t, st, b)
	snaps := []*metadata.Snapshot{
		{ID: "snap-2", SandboxID: "sbx-a", Bytes: 100, HibernateMS: 5, Engine: "gvisor 1", CreatedAt: at(2).Add(500 * time.Millisecond),
			LogicalBytes: 100, StoredBytes: 40, NewBytes: 10},
		{ID: "snap-1", SandboxID: "sbx-a", Parent: "snap-0", Bytes: 200, Engine: "gvisor 1", CreatedAt: at(2)},
		{ID: "snap-3", SandboxID: "sbx-b", Bytes: 300, Engine: "gvisor 1", CreatedAt: at(2).Add(500 * time.Millisecond),
			OutboxNode: "node-a"},
	}
	for _, snap := range snaps {
		s := a
		if snap.SandboxID == "sbx-b" {
			s = b
		}
		s.SnapshotID, s.State = snap.ID, sandbox.StateHibernated
		if err := st.CommitHibernate(ctx, snap, s); err != nil {
			t.Fatalf("commit %s: %v", snap.ID, err)
		}
	}
	if a.Version != 3 || b.Version != 2 {
		t.Errorf("versions after commits: %d %d, want 3 2", a.Version, b.Version)
	}
	if got := get(t, st, "sbx-a"); got.SnapshotID != "snap-1" || got.State != sandbox.StateHibernated {
		t.Errorf("sandbox after commit: %+v", got)
	}
	for _, want := range snaps {
		got, err := st.GetSnapshot(ctx, want.ID)
		if err != nil || !equal(got, want) {
			t.Errorf("snapshot %s read back as %+v %v, want %+v", want.ID, got, err, want)
		}
	}
	all, err := st.ListSnapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range all {
		ids = append(ids, s.ID)
	}
	if want := []string{"snap-1", "snap-2", "snap-3"}; !reflect.DeepEqual(ids, want) {
		t.Errorf("snapshot order %v, want %v", ids, want)
	}
	dup := *snaps[0]
	a.State = sandbox.StateError
	if err := st.CommitHibernate(ctx, &dup, a); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("commit of a taken snapshot id: %v", err)
	}
	if got := get(t, st, "sbx-a"); got.State != sandbox.StateHibernated || got.Version != 3 {
		t.Errorf("a refused commit changed the sandbox: %+v", got)
	}
	a.State = sandbox.StateHibernated

	if err := st.SetSnapshotSizes(ctx, "snap-1", 200, 80, 20); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetSnapshot(ctx, "snap-1"); got.LogicalBytes != 200 || got.StoredBytes != 80 || got.NewBytes != 20 {
		t.Errorf("sizes: %+v", got)
	}
	if err := st.SetSnapshotSizes(ctx, "snap-none", 1, 1, 1); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("sizes of a missing snapshot: %v", err)
	}
	if err := st.SetSnapshotUploaded(ctx, "snap-3"); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetSnapshot(ctx, "snap-3"); got.OutboxNode != "" {
		t.Errorf("an uploaded snapshot still names its outbox's node: %+v", got)
	}
	if err := st.SetSnapshotUploaded(ctx, "snap-none"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("upload of a missing snapshot: %v", err)
	}

	// Users: resuming from it or writing it; snap-2 is used by nobody.
	b.PendingSnapshot = "snap-1"
	if err := st.UpdateSandbox(ctx, b); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string][]string{"snap-1": {"sbx-a", "sbx-b"}, "snap-3": {"sbx-b"}, "snap-2": nil, "snap-none": nil} {
		got, err := st.SnapshotUsers(ctx, id)
		if err != nil || len(got) != len(want) || (len(want) > 0 && !reflect.DeepEqual(got, want)) {
			t.Errorf("users of %s: %v %v, want %v", id, got, err, want)
		}
	}
	if got, err := st.UnreferencedSnapshots(ctx); err != nil || !reflect.DeepEqual(got, []string{"snap-2"}) {
		t.Errorf("unreferenced: %v %v, want [snap-2]", got, err)
	}
	if err := st.DeleteSandbox(ctx, "sbx-b"); err != nil {
		t.Fatal(err)
	}
	if got, err := st.UnreferencedSnapshots(ctx); err != nil || !reflect.DeepEqual(got, []string{"snap-2", "snap-3"}) {
		t.Errorf("unreferenced after the delete of sbx-b: %v %v", got, err)
	}
	if err := st.DeleteSnapshot(ctx, "snap-2"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetSnapshot(ctx, "snap-2"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if err := st.DeleteSnapshot(ctx, "snap-2"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
}

// testKeptSnapshots: a kept snapshot is never unreferenced, its name is
// unique and finds it, and unkeeping it clears the name and makes it
// collectable again.
func testKeptSnapshots(t *testing.T, st metadata.Store) {
	a := minimalSandbox("sbx-a", at(1))
	if err := st.CreateSandbox(ctx, a); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"snap-1", "snap-2"} {
		a.SnapshotID = id
		if err := st.CommitHibernate(ctx, &metadata.Snapshot{ID: id, SandboxID: "sbx-a", Bytes: 1, Engine: "e", CreatedAt: at(2 + i)}, a); err != nil {
			t.Fatal(err)
		}
	}
	if got, _ := st.UnreferencedSnapshots(ctx); !reflect.DeepEqual(got, []string{"snap-1"}) {
		t.Fatalf("unreferenced %v, want [snap-1]", got)
	}
	if err := st.SetSnapshotKept(ctx, "snap-1", true, "saved"); err != nil {
		t.Fatal(err)
	}
	if got, err := st.UnreferencedSnapshots(ctx); err != nil || len(got) != 0 {
		t.Errorf("unreferenced with snap-1 kept: %v %v, want none", got, err)
	}
	if got, err := st.GetSnapshot(ctx, "snap-1"); err != nil || !got.Kept || got.Name != "saved" {
		t.Errorf("kept record: %+v %v", got, err)
	}
	if got, err := st.SnapshotByName(ctx, "saved"); err != nil || got.ID != "snap-1" {
		t.Errorf("by name: %+v %v", got, err)
	}
	if err := st.SetSnapshotKept(ctx, "snap-2", true, "saved"); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("a second snapshot named saved: %v, want ErrExists", err)
	}
	if got, _ := st.GetSnapshot(ctx, "snap-2"); got.Kept || got.Name != "" {
		t.Errorf("a refused keep changed the record: %+v", got)
	}
	if err := st.SetSnapshotKept(ctx, "snap-2", true, ""); err != nil {
		t.Errorf("keep without a name: %v", err)
	}
	if err := st.SetSnapshotKept(ctx, "snap-none", true, ""); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("keep of a missing snapshot: %v", err)
	}
	if _, err := st.SnapshotByName(ctx, "nothing"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("unknown name: %v", err)
	}
	if err := st.SetSnapshotKept(ctx, "snap-1", false, "ignored"); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetSnapshot(ctx, "snap-1"); got.Kept || got.Name != "" {
		t.Errorf("unkept record: %+v", got)
	}
	if _, err := st.SnapshotByName(ctx, "saved"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("name of an unkept snapshot still finds it: %v", err)
	}
	if got, _ := st.UnreferencedSnapshots(ctx); !reflect.DeepEqual(got, []string{"snap-1"}) {
		t.Errorf("unreferenced after unkeep %v, want [snap-1]", got)
	}
}

// testVolumes: create, ErrExists, get, list by name, delete, not found.
func testVolumes(t *testing.T, st metadata.Store) {
	for _, v := range []metadata.Volume{{Name: "data", CreatedAt: at(1)}, {Name: "cache-x", CreatedAt: at(2).Add(time.Millisecond), CopiedFrom: "cache", Node: "node-b"},
		{Name: "b", CreatedAt: at(3)}} {
		if err := st.CreateVolume(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.CreateVolume(ctx, metadata.Volume{Name: "data", CreatedAt: at(9)}); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("create of a taken name: %v", err)
	}
	v, err := st.GetVolume(ctx, "cache-x")
	if err != nil || !equal(v, metadata.Volume{Name: "cache-x", CreatedAt: at(2).Add(time.Millisecond), CopiedFrom: "cache", Node: "node-b"}) {
		t.Errorf("get: %+v %v", v, err)
	}
	if v, _ := st.GetVolume(ctx, "data"); !v.CreatedAt.Equal(at(1)) {
		t.Errorf("a refused create changed the volume: %+v", v)
	}
	all, err := st.ListVolumes(ctx)
	if err != nil || len(all) != 3 || all[0].Name != "b" || all[1].Name != "cache-x" || all[1].Node != "node-b" || all[2].Name != "data" || all[2].Node != "" {
		t.Errorf("list: %+v %v", all, err)
	}
	if err := st.DeleteVolume(ctx, "data"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetVolume(ctx, "data"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if err := st.DeleteVolume(ctx, "data"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
}

// testImages: names point at digests; a put replaces; by digest finds the
// first name; list by name; not found.
func testImages(t *testing.T, st metadata.Store) {
	base := sandbox.Image{Name: "base", Digest: "sha256:aa", Bytes: 4096, Source: "mmdebstrap:", CreatedAt: at(1)}
	py := sandbox.Image{Name: "py", Digest: "sha256:bb", Bytes: 8192, Source: "mmdebstrap:python3", CreatedAt: at(2)}
	alias := sandbox.Image{Name: "alpha", Digest: "sha256:bb", Bytes: 8192, Source: "import:x.tar", CreatedAt: at(3)}
	for _, img := range []sandbox.Image{py, base, alias} {
		if err := st.PutImage(ctx, img); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := st.GetImage(ctx, "base"); err != nil || !equal(got, base) {
		t.Errorf("get: %+v %v", got, err)
	}
	if got, err := st.ImageByDigest(ctx, "sha256:bb"); err != nil || got.Name != "alpha" {
		t.Errorf("by digest: %+v %v, want the name alpha", got, err)
	}
	newBase := sandbox.Image{Name: "base", Digest: "sha256:cc", Bytes: 1, Source: "import:y.tar", CreatedAt: at(4)}
	if err := st.PutImage(ctx, newBase); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetImage(ctx, "base"); !equal(got, newBase) {
		t.Errorf("after replace: %+v", got)
	}
	if _, err := st.ImageByDigest(ctx, "sha256:aa"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("by a digest no name points at: %v", err)
	}
	if _, err := st.GetImage(ctx, "none"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get of a missing name: %v", err)
	}
	all, err := st.ListImages(ctx)
	if err != nil || len(all) != 3 || all[0].Name != "alpha" || all[1].Name != "base" || all[2].Name != "py" {
		t.Errorf("list: %+v %v", all, err)
	}
}

// hash32 is a 32-byte hash whose bytes are all b.
func hash32(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// testAPIKeys: create, get by id and by hash (only the exact 32 bytes
// match), ErrExists for a taken id or hash (the stored record unchanged),
// list oldest first, touch, delete, not found.
func testAPIKeys(t *testing.T, st metadata.Store) {
	keys := []metadata.APIKey{
		{ID: "key_bbbbbbbbbbbb", Name: "ci", Prefix: "e2b_22222222", Hash: hash32(2), CreatedAt: at(2).Add(500 * time.Millisecond)},
		{ID: "key_aaaaaaaaaaaa", Name: "", Prefix: "e2b_11111111", Hash: hash32(1), CreatedAt: at(2)},
		{ID: "key_cccccccccccc", Name: "laptop", Prefix: "e2b_33333333", Hash: hash32(3), CreatedAt: at(2).Add(500 * time.Millisecond),
			LastUsedAt: tp(at(5))},
	}
	for _, k := range keys {
		if err := st.CreateAPIKey(ctx, k); err != nil {
			t.Fatalf("create %s: %v", k.ID, err)
		}
	}
	for _, want := range keys {
		if got, err := st.GetAPIKey(ctx, want.ID); err != nil || !equal(got, want) {
			t.Errorf("get %s: %+v %v, want %+v", want.ID, got, err, want)
		}
		if got, err := st.APIKeyByHash(ctx, want.Hash); err != nil || !equal(got, want) {
			t.Errorf("by hash of %s: %+v %v", want.ID, got, err)
		}
	}
	for _, h := range [][]byte{hash32(9), hash32(1)[:31], append(hash32(1), 0), nil} {
		if k, err := st.APIKeyByHash(ctx, h); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("by hash %x: %+v %v, want ErrNotFound", h, k, err)
		}
	}
	for _, dup := range []metadata.APIKey{
		{ID: keys[0].ID, Name: "other", Prefix: "e2b_44444444", Hash: hash32(4), CreatedAt: at(9)},         // id taken
		{ID: "key_dddddddddddd", Name: "other", Prefix: "e2b_11111111", Hash: hash32(1), CreatedAt: at(9)}, // hash taken
	} {
		if err := st.CreateAPIKey(ctx, dup); !errors.Is(err, metadata.ErrExists) {
			t.Errorf("create %+v: %v, want ErrExists", dup, err)
		}
	}
	if got, _ := st.GetAPIKey(ctx, keys[0].ID); got.Name != "ci" || !bytes.Equal(got.Hash, hash32(2)) {
		t.Errorf("a refused create changed the record: %+v", got)
	}
	if _, err := st.GetAPIKey(ctx, "key_dddddddddddd"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("a refused create (hash taken) made its record: %v", err)
	}
	if _, err := st.APIKeyByHash(ctx, hash32(4)); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("a refused create (id taken) stored its hash: %v", err)
	}
	all, err := st.ListAPIKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, k := range all {
		ids = append(ids, k.ID)
	}
	if want := []string{"key_aaaaaaaaaaaa", "key_bbbbbbbbbbbb", "key_cccccccccccc"}; !reflect.DeepEqual(ids, want) {
		t.Errorf("list order %v, want %v", ids, want)
	}

	used := at(7).Add(250 * time.Millisecond)
	if err := st.TouchAPIKey(ctx, keys[1].ID, used); err != nil {
		t.Fatal(err)
	}
	got, _ := st.GetAPIKey(ctx, keys[1].ID)
	if got.LastUsedAt == nil || !got.LastUsedAt.Equal(used) || got.Name != "" || !bytes.Equal(got.Hash, hash32(1)) {
		t.Errorf("after touch: %+v", got)
	}
	if got, _ := st.GetAPIKey(ctx, keys[2].ID); !got.LastUsedAt.Equal(at(5)) {
		t.Errorf("a touch of another key changed %s: %+v", keys[2].ID, got)
	}
	if err := st.TouchAPIKey(ctx, "key_none", used); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("touch of a missing id: %v", err)
	}

	if err := st.DeleteAPIKey(ctx, keys[1].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := st.APIKeyByHash(ctx, hash32(1)); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("by hash after delete: %v", err)
	}
	if _, err := st.GetAPIKey(ctx, keys[1].ID); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if err := st.DeleteAPIKey(ctx, keys[1].ID); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	if all, err := st.ListAPIKeys(ctx); err != nil || len(all) != 2 {
		t.Errorf("list after delete: %d records, %v", len(all), err)
	}
	// The hash of a deleted key is free again.
	if err := st.CreateAPIKey(ctx, metadata.APIKey{ID: "key_eeeeeeeeeeee", Prefix: "e2b_11111111", Hash: hash32(1), CreatedAt: at(8)}); err != nil {
		t.Errorf("create with a deleted key's hash: %v", err)
	}
}

// testNodes: a put makes a record (its overcommit ratio with it, 1 when it
// gives none), a heartbeat sets its load and time, a second put (the node
// starting again) replaces it but keeps Draining; list by name; not found
// for heartbeat, drain and delete of a missing name.
func testNodes(t *testing.T, st metadata.Store) {
	b := metadata.Node{Name: "node-b", Advertise: "http://10.0.0.2:7070",
		Capacity: metadata.NodeResources{MemoryMiB: 64000, CPUs: 16, Sandboxes: 120}, MemoryOvercommit: 1.75,
		StartedAt: at(1), HeartbeatAt: at(1).Add(250 * time.Millisecond)}
	a := metadata.Node{Name: "node-a", Advertise: "http://10.0.0.1:7070",
		Capacity: metadata.NodeResources{MemoryMiB: 2048, CPUs: 2.5, Sandboxes: 4}, StartedAt: at(2), HeartbeatAt: at(2)}
	for _, n := range []metadata.Node{b, a} {
		if err := st.PutNode(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := st.GetNode(ctx, "node-b"); err != nil || !equal(got, b) {
		t.Errorf("get: %+v %v, want %+v", got, err, b)
	}
	load := metadata.NodeResources{MemoryMiB: 768, CPUs: 1.5, Sandboxes: 3}
	if err := st.HeartbeatNode(ctx, "node-a", load, at(3).Add(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	got, _ := st.GetNode(ctx, "node-a")
	if got.Load != load || !got.HeartbeatAt.Equal(at(3).Add(time.Millisecond)) || !got.StartedAt.Equal(at(2)) || got.Capacity != a.Capacity ||
		got.MemoryOvercommit != 1 {
		t.Errorf("after heartbeat: %+v (overcommit want 1: none given)", got)
	}
	if err := st.SetNodeDraining(ctx, "node-a", true); err != nil {
		t.Fatal(err)
	}
	again := a
	again.Advertise, again.StartedAt, again.HeartbeatAt, again.MemoryOvercommit = "http://10.0.0.9:7070", at(9), at(9), 0.5
	if err := st.PutNode(ctx, again); err != nil {
		t.Fatal(err)
	}
	got, _ = st.GetNode(ctx, "node-a")
	if want := again; true {
		want.Draining = true
		if !equal(got, want) {
			t.Errorf("after a second put: %+v, want %+v (draining kept)", got, want)
		}
	}
	all, err := st.ListNodes(ctx)
	if err != nil || len(all) != 2 || all[0].Name != "node-a" || all[1].Name != "node-b" || !all[0].Draining || all[1].Draining {
		t.Errorf("list: %+v %v", all, err)
	}
	if err := st.SetNodeDraining(ctx, "node-a", false); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetNode(ctx, "node-a"); got.Draining {
		t.Errorf("undrained node: %+v", got)
	}
	for name, err := range map[string]error{
		"heartbeat": st.HeartbeatNode(ctx, "node-none", load, at(4)),
		"drain":     st.SetNodeDraining(ctx, "node-none", true),
		"delete":    st.DeleteNode(ctx, "node-none"),
	} {
		if !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("%s of a missing node: %v", name, err)
		}
	}
	if _, err := st.GetNode(ctx, "node-none"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get of a missing node: %v", err)
	}
	if err := st.DeleteNode(ctx, "node-b"); err != nil {
		t.Fatal(err)
	}
	if all, err := st.ListNodes(ctx); err != nil || len(all) != 1 {
		t.Errorf("list after delete: %+v %v", all, err)
	}
}

// testIdempotencyKeys: a claim stores its record once; a second claim of
// the key gets the stored record unchanged, also with other ids and hash;
// of concurrent claims exactly one creates; finish sets the status; delete
// frees the key; records made before a time expire, the others stay.
func testIdempotencyKeys(t *testing.T, st metadata.Store) {
	first := metadata.IdempotencyKey{Key: "k-1", RequestHash: hash32(1), SandboxIDs: []string{"sbx-a", "sbx-b"},
		CreatedAt: at(10).Add(500 * time.Millisecond), Holder: "node-a@1"}
	got, created, err := st.ClaimIdempotencyKey(ctx, first)
	if err != nil || !created || !equal(got, first) {
		t.Fatalf("first claim: %+v created %v %v, want %+v created", got, created, err, first)
	}
	again := metadata.IdempotencyKey{Key: "k-1", RequestHash: hash32(2), SandboxIDs: []string{"sbx-c"}, CreatedAt: at(20)}
	if got, created, err := st.ClaimIdempotencyKey(ctx, again); err != nil || created || !equal(got, first) {
		t.Errorf("second claim: %+v created %v %v, want the first record, not created", got, created, err)
	}
	// A take from another holder than the record's changes nothing; of
	// concurrent takes from its holder exactly one succeeds.
	if ok, err := st.TakeIdempotencyKey(ctx, "k-1", "node-b@1", "node-c@2"); ok || err != nil {
		t.Errorf("take from a holder the record does not name: %v %v, want false", ok, err)
	}
	var takes sync.WaitGroup
	took := make(chan string, 4)
	for i := range 4 {
		takes.Add(1)
		go func() {
			defer takes.Done()
			to := fmt.Sprintf("node-%d@9", i)
			ok, err := st.TakeIdempotencyKey(ctx, "k-1", "node-a@1", to)
			if err != nil {
				t.Errorf("take %d: %v", i, err)
			}
			if ok {
				took <- to
			}
		}()
	}
	takes.Wait()
	close(took)
	var takers []string
	for to := range took {
		takers = append(takers, to)
	}
	if len(takers) != 1 {
		t.Fatalf("concurrent takes of one record: %d succeeded (%v), want exactly 1", len(takers), takers)
	}
	first.Holder = takers[0]
	if got, created, err := st.ClaimIdempotencyKey(ctx, again); err != nil || created || !equal(got, first) {
		t.Errorf("claim after a take: %+v created %v %v, want %+v", got, created, err, first)
	}
	if _, err := st.TakeIdempotencyKey(ctx, "k-none", "", "x"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("take of a missing key: %v, want ErrNotFound", err)
	}
	// Only the holder finishes: the server whose call was taken over
	// changes nothing.
	if err := st.FinishIdempotencyKey(ctx, "k-1", "node-a@1", 500); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("finish by a holder that lost the record: %v, want ErrNotFound", err)
	}
	if err := st.DeleteIdempotencyKey(ctx, "k-1", "node-a@1"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("delete by a holder that lost the record: %v, want ErrNotFound", err)
	}
	if err := st.FinishIdempotencyKey(ctx, "k-1", first.Holder, 201); err != nil {
		t.Fatal(err)
	}
	if ok, err := st.TakeIdempotencyKey(ctx, "k-1", first.Holder, "node-z@1"); ok || err != nil {
		t.Errorf("take of a finished record: %v %v, want false", ok, err)
	}
	want := first
	want.Status = 201
	if got, _, err := st.ClaimIdempotencyKey(ctx, again); err != nil || !equal(got, want) {
		t.Errorf("claim after finish: %+v %v, want %+v", got, err, want)
	}
	if err := st.FinishIdempotencyKey(ctx, "k-none", "", 201); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("finish of a missing key: %v, want ErrNotFound", err)
	}

	const racers = 8
	var wg sync.WaitGroup
	wins := make(chan string, racers)
	for i := range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := metadata.IdempotencyKey{Key: "k-race", RequestHash: hash32(byte(i)), SandboxIDs: []string{fmt.Sprintf("sbx-%d", i)}, CreatedAt: at(30)}
			got, created, err := st.ClaimIdempotencyKey(ctx, r)
			if err != nil {
				t.Errorf("racer %d: %v", i, err)
				return
			}
			if created {
				wins <- got.SandboxIDs[0]
			}
		}()
	}
	wg.Wait()
	close(wins)
	var winners []string
	for w := range wins {
		winners = append(winners, w)
	}
	if len(winners) != 1 {
		t.Errorf("concurrent claims of one key: %d created (%v), want exactly 1", len(winners), winners)
	} else if got, _, _ := st.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "k-race", RequestHash: hash32(0xee), CreatedAt: at(31)}); len(got.SandboxIDs) != 1 || got.SandboxIDs[0] != winners[0] {
		t.Errorf("k-race holds %+v, want the winner's %s", got, winners[0])
	}

	if err := st.DeleteIdempotencyKey(ctx, "k-race", ""); err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteIdempotencyKey(ctx, "k-race", ""); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v, want ErrNotFound", err)
	}
	fresh := metadata.IdempotencyKey{Key: "k-race", RequestHash: hash32(9), SandboxIDs: []string{"sbx-new"}, CreatedAt: at(40)}
	if got, created, err := st.ClaimIdempotencyKey(ctx, fresh); err != nil || !created || !equal(got, fresh) {
		t.Errorf("claim of a deleted key: %+v created %v %v", got, created, err)
	}

	// Expiry: k-1 (made at 10.5 s) goes, k-race (40 s) stays.
	n, err := st.DeleteIdempotencyKeysBefore(ctx, at(11))
	if err != nil || n != 1 {
		t.Errorf("expire before 11 s: %d removed %v, want 1", n, err)
	}
	if got, created, _ := st.ClaimIdempotencyKey(ctx, again); !created || !equal(got, again) {
		t.Errorf("k-1 after its expiry: %+v created %v, want a new record", got, created)
	}
	if got, created, _ := st.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "k-race", RequestHash: hash32(0xee), CreatedAt: at(50)}); created || !equal(got, fresh) {
		t.Errorf("k-race after the expiry of older keys: %+v created %v, want it kept", got, created)
	}
}

// testConcurrentUpdates: writers updating different records at once all
// succeed, and each record ends with all of its writer's updates.
func testConcurrentUpdates(t *testing.T, st metadata.Store) {
	const writers, updates = 8, 25
	for i := 0; i < writers; i++ {
		create(t, st, minimalSandbox(fmt.Sprintf("sbx-%02d", i), at(i)))
	}
	var wg sync.WaitGroup
	for i := 0; i < writers; i++ {
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			s, err := st.GetSandbox(ctx, id)
			if err != nil {
				t.Error(err)
				return
			}
			for j := 0; j < updates; j++ {
				s.Seq++
				if err := st.UpdateSandbox(ctx, s); err != nil {
					t.Errorf("%s update %d: %v", id, j, err)
					return
				}
			}
		}(fmt.Sprintf("sbx-%02d", i))
	}
	wg.Wait()
	all, err := st.ListSandboxes(ctx)
	if err != nil || len(all) != writers {
		t.Fatalf("list: %d %v", len(all), err)
	}
	for _, s := range all {
		if s.Seq != 1+updates || s.Version != 1+updates {
			t.Errorf("%s: seq %d version %d, want %d", s.ID, s.Seq, s.Version, 1+updates)
		}
	}
}

// testReopen: records of every kind survive closing and opening the store
// again, twice (the second and third opens find the schema in place), and
// the counter continues.
func testReopen(t *testing.T, open func() (metadata.Store, error)) {
	st, err := open()
	if err != nil {
		t.Fatal(err)
	}
	full := fullSandbox("sbx-full")
	if err := st.CreateSandbox(ctx, full); err != nil {
		t.Fatal(err)
	}
	snap := &metadata.Snapshot{ID: "snap-sbx-full", SandboxID: "sbx-full", Bytes: 5, Engine: "e", CreatedAt: at(2)}
	if err := st.CommitHibernate(ctx, snap, full); err != nil {
		t.Fatal(err)
	}
	if err := st.CreateVolume(ctx, metadata.Volume{Name: "data", CreatedAt: at(1)}); err != nil {
		t.Fatal(err)
	}
	img := sandbox.Image{Name: "base", Digest: "sha256:aa", CreatedAt: at(1)}
	if err := st.PutImage(ctx, img); err != nil {
		t.Fatal(err)
	}
	key := metadata.APIKey{ID: "key_aaaaaaaaaaaa", Name: "ci", Prefix: "e2b_11111111", Hash: hash32(1), CreatedAt: at(1), LastUsedAt: tp(at(2))}
	if err := st.CreateAPIKey(ctx, key); err != nil {
		t.Fatal(err)
	}
	if _, err := st.NextGeneration(ctx); err != nil {
		t.Fatal(err)
	}
	idem := metadata.IdempotencyKey{Key: "k", RequestHash: hash32(5), SandboxIDs: []string{"sbx-full"}, Status: 201, CreatedAt: at(3)}
	if _, _, err := st.ClaimIdempotencyKey(ctx, idem); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	for round := 1; round <= 2; round++ {
		st := openStore(t, open)
		got, err := st.GetSandbox(ctx, "sbx-full")
		if err != nil || !equal(got, full) {
			t.Fatalf("reopen %d: sandbox %+v %v", round, got, err)
		}
		if s, err := st.GetSnapshot(ctx, snap.ID); err != nil || !equal(s, snap) {
			t.Errorf("reopen %d: snapshot %+v %v", round, s, err)
		}
		if _, err := st.GetVolume(ctx, "data"); err != nil {
			t.Errorf("reopen %d: volume: %v", round, err)
		}
		if i, err := st.GetImage(ctx, "base"); err != nil || !equal(i, img) {
			t.Errorf("reopen %d: image %+v %v", round, i, err)
		}
		if k, err := st.APIKeyByHash(ctx, key.Hash); err != nil || !equal(k, key) {
			t.Errorf("reopen %d: api key %+v %v", round, k, err)
		}
		if k, created, err := st.ClaimIdempotencyKey(ctx, metadata.IdempotencyKey{Key: "k", RequestHash: hash32(0xee), CreatedAt: at(9)}); err != nil || created || !equal(k, idem) {
			t.Errorf("reopen %d: idempotency key %+v created %v %v", round, k, created, err)
		}
		if g, err := st.NextGeneration(ctx); err != nil || g != int64(1+round) {
			t.Errorf("reopen %d: next generation %d %v, want %d", round, g, err, 1+round)
		}
		st.Close()
	}
}

// testLeases: a claim starts a new lease (owner, token one more), every
// other write with the old token is refused with ErrFenced and writes
// nothing, and a released sandbox (owner "") keeps its token, so the next
// claim's token is still higher than every earlier one.
func testLeases(t *testing.T, st metadata.Store) {
	s := minimalSandbox("sbx-l", at(1))
	create(t, st, s)
	if s.LeaseToken != 0 || get(t, st, "sbx-l").Owner != "" {
		t.Fatalf("a record created without owner: token %d", s.LeaseToken)
	}
	a := get(t, st, "sbx-l")
	a.Owner = "node-a"
	if err := st.ClaimSandbox(ctx, a); err != nil {
		t.Fatal(err)
	}
	if a.LeaseToken != 1 || a.Version != 2 {
		t.Fatalf("after the first claim: token %d version %d, want 1 2", a.LeaseToken, a.Version)
	}
	a.State = sandbox.StateRunning
	if err := st.UpdateSandbox(ctx, a); err != nil {
		t.Fatalf("owner's update: %v", err)
	}
	// Node b takes it (node a lost): node a's record, even at the current
	// version, is fenced out.
	b := get(t, st, "sbx-l")
	stale := *a
	b.Owner, b.State, b.Error = "node-b", sandbox.StateError, "node node-a lost"
	if err := st.ClaimSandbox(ctx, b); err != nil || b.LeaseToken != 2 {
		t.Fatalf("second claim: %v, token %d", err, b.LeaseToken)
	}
	stale.Version = b.Version // the version alone would pass
	stale.State = sandbox.StateHibernated
	if err := st.UpdateSandbox(ctx, &stale); !errors.Is(err, metadata.ErrFenced) {
		t.Fatalf("update with the old lease token: %v, want ErrFenced", err)
	}
	if _, err := st.BeginRestore(ctx, &stale); !errors.Is(err, metadata.ErrFenced) {
		t.Fatalf("begin restore with the old lease token: %v, want ErrFenced", err)
	}
	snap := &metadata.Snapshot{ID: "snap-fenced", SandboxID: "sbx-l", Bytes: 1, Engine: "e", CreatedAt: at(2)}
	if err := st.CommitHibernate(ctx, snap, &stale); !errors.Is(err, metadata.ErrFenced) {
		t.Fatalf("commit hibernate with the old lease token: %v, want ErrFenced", err)
	}
	if _, err := st.GetSnapshot(ctx, "snap-fenced"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("a fenced commit hibernate left its snapshot: %v", err)
	}
	got := get(t, st, "sbx-l")
	if got.Owner != "node-b" || got.LeaseToken != 2 || got.State != sandbox.StateError {
		t.Fatalf("after fenced writes: owner %q token %d state %s", got.Owner, got.LeaseToken, got.State)
	}
	// A stale version with the right token is ErrStale, not ErrFenced.
	old := *got
	if err := st.UpdateSandbox(ctx, got); err != nil {
		t.Fatal(err)
	}
	if err := st.UpdateSandbox(ctx, &old); !errors.Is(err, metadata.ErrStale) {
		t.Errorf("stale version, current token: %v, want ErrStale", err)
	}
	// Released (hibernated: no owner), the token stays; a claim of a stale
	// version is refused.
	got.Owner, got.State = "", sandbox.StateHibernated
	if err := st.UpdateSandbox(ctx, got); err != nil {
		t.Fatal(err)
	}
	if r := get(t, st, "sbx-l"); r.Owner != "" || r.LeaseToken != 2 {
		t.Errorf("released: owner %q token %d", r.Owner, r.LeaseToken)
	}
	staleClaim := old
	staleClaim.Owner = "node-c"
	if err := st.ClaimSandbox(ctx, &staleClaim); !errors.Is(err, metadata.ErrStale) {
		t.Errorf("claim of a stale version: %v, want ErrStale", err)
	}
	c := get(t, st, "sbx-l")
	c.Owner = "node-c"
	if err := st.ClaimSandbox(ctx, c); err != nil || c.LeaseToken != 3 {
		t.Errorf("claim after release: %v, token %d, want 3", err, c.LeaseToken)
	}
	ghost := minimalSandbox("sbx-ghost", at(1))
	ghost.Version = 1
	if err := st.ClaimSandbox(ctx, ghost); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("claim of a missing sandbox: %v", err)
	}
}

// testConcurrentClaims: of nodes claiming one record they all read,
// exactly one succeeds; the others get ErrStale.
func testConcurrentClaims(t *testing.T, st metadata.Store) {
	create(t, st, minimalSandbox("sbx-c", at(1)))
	const nodes = 6
	var wins, stale atomic.Int32
	var wg sync.WaitGroup
	recs := make([]*metadata.Sandbox, nodes)
	for i := range recs {
		recs[i] = get(t, st, "sbx-c")
		recs[i].Owner = fmt.Sprintf("node-%d", i)
	}
	for i := range recs {
		wg.Add(1)
		go func(s *metadata.Sandbox) {
			defer wg.Done()
			switch err := st.ClaimSandbox(ctx, s); {
			case err == nil:
				wins.Add(1)
			case errors.Is(err, metadata.ErrStale):
				stale.Add(1)
			default:
				t.Errorf("claim by %s: %v", s.Owner, err)
			}
		}(recs[i])
	}
	wg.Wait()
	if wins.Load() != 1 || stale.Load() != nodes-1 {
		t.Fatalf("%d claims succeeded, %d stale; want 1 and %d", wins.Load(), stale.Load(), nodes-1)
	}
	if got := get(t, st, "sbx-c"); got.LeaseToken != 1 || got.Owner == "" {
		t.Errorf("after concurrent claims: owner %q token %d", got.Owner, got.LeaseToken)
	}
}

func testPools(t *testing.T, st metadata.Store) {
	if _, err := st.GetPool(ctx, metadata.PoolImage, "base"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get of no pool: %v, want ErrNotFound", err)
	}
	snapPool := metadata.Pool{Kind: metadata.PoolSnapshot, Name: "snap-t", Size: 3, SnapshotID: "snap-t", UpdatedAt: at(1)}
	imgPool := metadata.Pool{Kind: metadata.PoolImage, Name: "base", Size: 2, UpdatedAt: at(2)}
	for _, p := range []metadata.Pool{snapPool, imgPool} {
		if err := st.SetPool(ctx, p, nil); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := st.GetPool(ctx, metadata.PoolSnapshot, "snap-t"); err != nil || !equal(got, snapPool) {
		t.Errorf("get: %+v %v, want %+v", got, err, snapPool)
	}
	// The image's template snapshot is recorded with its pool, no sandbox
	// resumes from it, and it is not collected while the pool names it.
	tmpl := &metadata.Snapshot{ID: "snap-img", Bytes: 10, Engine: "gvisor 1", CreatedAt: at(3), LogicalBytes: 10, StoredBytes: 10, NewBytes: 10}
	imgPool.SnapshotID, imgPool.ImageDigest, imgPool.Size, imgPool.UpdatedAt = "snap-img", "sha256:ab", 4, at(4)
	if err := st.SetPool(ctx, imgPool, tmpl); err != nil {
		t.Fatal(err)
	}
	if got, err := st.GetSnapshot(ctx, "snap-img"); err != nil || !equal(got, tmpl) {
		t.Errorf("template snapshot: %+v %v, want %+v", got, err, tmpl)
	}
	if err := st.SetPool(ctx, metadata.Pool{Kind: metadata.PoolImage, Name: "other", Size: 1, UpdatedAt: at(5)}, tmpl); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("a second record of snapshot snap-img: %v, want ErrExists", err)
	}
	if _, err := st.GetPool(ctx, metadata.PoolImage, "other"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("a refused SetPool wrote its pool: %v", err)
	}
	all, err := st.ListPools(ctx)
	if err != nil || len(all) != 2 || !equal(all[0], imgPool) || !equal(all[1], snapPool) {
		t.Errorf("list: %+v %v, want %+v then %+v", all, err, imgPool, snapPool)
	}
	if got, err := st.UnreferencedSnapshots(ctx); err != nil || len(got) != 0 {
		t.Errorf("unreferenced with a pool naming snap-img: %v %v, want none", got, err)
	}
	if err := st.DeletePool(ctx, metadata.PoolImage, "base"); err != nil {
		t.Fatal(err)
	}
	if err := st.DeletePool(ctx, metadata.PoolImage, "base"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("second delete: %v, want ErrNotFound", err)
	}
	if got, err := st.UnreferencedSnapshots(ctx); err != nil || !reflect.DeepEqual(got, []string{"snap-img"}) {
		t.Errorf("unreferenced after the pool's deletion: %v %v, want [snap-img]", got, err)
	}
	if all, _ := st.ListPools(ctx); len(all) != 1 || all[0].Name != "snap-t" {
		t.Errorf("list after delete: %+v", all)
	}
}

// testSecrets: the first value stored under a name is the one every later and
// every concurrent EnsureSecret returns; an empty name or value is refused and
// stores nothing; names are independent.
func testSecrets(t *testing.T, st metadata.Store) {
	ctx := context.Background()
	if _, err := st.EnsureSecret(ctx, "s", nil); err == nil {
		t.Fatal("EnsureSecret of an empty value: no error")
	}
	if _, err := st.EnsureSecret(ctx, "", []byte("x")); err == nil {
		t.Fatal("EnsureSecret of an empty name: no error")
	}
	if v, err := st.EnsureSecret(ctx, "s", []byte("first")); err != nil || string(v) != "first" {
		t.Fatalf("EnsureSecret after the refused calls: %q, %v", v, err)
	}
	const racers = 8
	got := make([][]byte, racers)
	errs := make([]error, racers)
	var wg sync.WaitGroup
	for i := range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = st.EnsureSecret(ctx, "e2b", []byte{byte(i + 1), 0xff, 0})
		}()
	}
	wg.Wait()
	for i := range racers {
		if errs[i] != nil {
			t.Fatalf("racer %d: %v", i, errs[i])
		}
		if !bytes.Equal(got[i], got[0]) {
			t.Fatalf("racers got different secrets: %x and %x", got[0], got[i])
		}
	}
	if len(got[0]) != 3 || got[0][1] != 0xff || got[0][2] != 0 {
		t.Fatalf("secret %x: not one of the values stored", got[0])
	}
	again, err := st.EnsureSecret(ctx, "e2b", []byte("other"))
	if err != nil || !bytes.Equal(again, got[0]) {
		t.Fatalf("a later EnsureSecret: %x, %v; want the first value %x", again, err, got[0])
	}
	other, err := st.EnsureSecret(ctx, "other", []byte("v2"))
	if err != nil || string(other) != "v2" {
		t.Fatalf("a second name: %q, %v", other, err)
	}
}
