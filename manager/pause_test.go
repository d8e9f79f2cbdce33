package manager_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

func intp(v int) *int { return &v }

// pause pauses sandbox id and checks the record: paused, on the same
// instance, with a committed snapshot taken of the paused state.
func (h *host) pause(id string) {
	h.t.Helper()
	before := h.record(id)
	if _, _, err := h.m.Pause(context.Background(), id); err != nil {
		h.t.Fatalf("pause %s: %v", id, err)
	}
	rec := h.record(id)
	if rec.State != sandbox.StatePaused || rec.Instance != before.Instance || rec.Generation != before.Generation {
		h.t.Fatalf("after pause: state %s instance %s generation %d; want paused on %s, generation %d",
			rec.State, rec.Instance, rec.Generation, before.Instance, before.Generation)
	}
	if rec.SnapshotID == "" || rec.SnapshotID == before.SnapshotID || rec.PendingSnapshot != "" {
		h.t.Fatalf("after pause: snapshot %q (pending %q), before %q: want a new committed snapshot", rec.SnapshotID, rec.PendingSnapshot, before.SnapshotID)
	}
	if !h.eng.Paused(rec.Instance) {
		h.t.Fatalf("after pause: the engine's instance %s is not paused", rec.Instance)
	}
}

// TestPauseUnpause: a request to a paused sandbox unpauses it first (same
// instance and generation, no restore) and the guest is told by a resume event
// of kind unpaused.
func TestPauseUnpause(t *testing.T) {
	h := newHost(t, hostOpts{})
	sb := h.create()
	h.writeFile(sb.ID, "/kept", "yes")
	rec := h.record(sb.ID)
	h.pause(sb.ID)
	restores := h.eng.Calls("restore")
	if got := h.readFile(sb.ID, "/kept"); got != "yes" {
		t.Fatalf("read after pause: %q", got)
	}
	after := h.record(sb.ID)
	if after.State != sandbox.StateRunning || after.Instance != rec.Instance || after.Generation != rec.Generation {
		t.Fatalf("after the request: state %s instance %s generation %d; want running on %s, generation %d",
			after.State, after.Instance, after.Generation, rec.Instance, rec.Generation)
	}
	if n := h.eng.Calls("restore"); n != restores {
		t.Fatalf("the unpause restored (%d restores, %d before)", n, restores)
	}
	if h.eng.Paused(after.Instance) {
		t.Fatal("the instance is still paused after the request")
	}
	if after.LastResume == nil || after.LastResume.Event != "unpaused" || after.LastResume.Generation != rec.Generation || !after.LastResume.OK {
		t.Fatalf("last resume %+v; want an ok unpaused report at generation %d", after.LastResume, rec.Generation)
	}
	var ev struct {
		Event, Kind string
		Generation  int64
	}
	if err := json.Unmarshal([]byte(h.readFile(sb.ID, "/run/torpor/resume.json")), &ev); err != nil {
		t.Fatal(err)
	}
	if ev.Event != "resume" || ev.Kind != "unpaused" || ev.Generation != rec.Generation {
		t.Fatalf("the guest's last event %+v; want resume of kind unpaused at generation %d", ev, rec.Generation)
	}
	// A pause without a Pauser-capable mode is refused.
	fs := "filesystem"
	if _, err := h.m.Update(context.Background(), sb.ID, sandbox.PolicyUpdate{HibernationMode: &fs}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.m.Pause(context.Background(), sb.ID); err == nil {
		t.Fatal("pause of a filesystem-mode sandbox succeeded")
	}
}

// TestPausePolicy: an idle sandbox is paused after pause_after_s and
// hibernated, on its pause's snapshot and without another checkpoint, at
// idle_timeout_s; the default pause_after_s applies only below the idle timeout.
func TestPausePolicy(t *testing.T) {
	h := newHost(t, hostOpts{lifecycle: manager.LifecycleConfig{CheckInterval: 50 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.m.RunLifecycle(ctx) }()
	defer func() { cancel(); <-done }()

	def, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	if def.PauseAfterS != manager.DefaultPauseAfterS || def.IdleTimeoutS != manager.DefaultIdleTimeoutS {
		t.Fatalf("defaults: pause_after_s %d idle_timeout_s %d", def.PauseAfterS, def.IdleTimeoutS)
	}
	short, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, IdleTimeoutS: intp(3)})
	if err != nil {
		t.Fatal(err)
	}
	if short.PauseAfterS != 0 {
		t.Fatalf("idle_timeout_s 3: default pause_after_s %d, want 0", short.PauseAfterS)
	}
	h.m.Delete(ctx, def.ID)
	h.m.Delete(ctx, short.ID)

	sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, IdleTimeoutS: intp(2), PauseAfterS: intp(1)})
	if err != nil {
		t.Fatal(err)
	}
	h.writeFile(sb.ID, "/kept", "yes")
	start := time.Now()
	h.waitState(sb.ID, sandbox.StatePaused)
	if d := time.Since(start); d < 900*time.Millisecond {
		t.Fatalf("paused %v after the last call; want after pause_after_s 1", d)
	}
	for h.record(sb.ID).SnapshotID == "" || h.record(sb.ID).PendingSnapshot != "" {
		time.Sleep(5 * time.Millisecond) // the pause's snapshot is being taken
	}
	snap := h.record(sb.ID).SnapshotID
	checkpoints := h.eng.Calls("checkpoint")
	h.waitState(sb.ID, sandbox.StateHibernated)
	if d := time.Since(start); d < 1900*time.Millisecond {
		t.Fatalf("hibernated %v after the last call; want after idle_timeout_s 2", d)
	}
	rec := h.record(sb.ID)
	if rec.SnapshotID != snap || h.eng.Calls("checkpoint") != checkpoints || rec.Instance != "" {
		t.Fatalf("demotion: snapshot %s (pause's %s), %d checkpoints (%d before), instance %q: want the pause's snapshot, no checkpoint, no instance",
			rec.SnapshotID, snap, h.eng.Calls("checkpoint"), checkpoints, rec.Instance)
	}
	if infos, _ := h.eng.List(ctx); len(infos) != 0 {
		t.Fatalf("demoted sandbox left instances: %+v", infos)
	}
	if got := h.readFile(sb.ID, "/kept"); got != "yes" {
		t.Fatalf("after demotion: /kept = %q", got)
	}
}

// TestStandbyBudget: paused sandboxes beyond the standby memory budget are
// hibernated, those paused longest first.
func TestStandbyBudget(t *testing.T) {
	h := newHost(t, hostOpts{lifecycle: manager.LifecycleConfig{CheckInterval: 50 * time.Millisecond, StandbyMemoryMiB: 150}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.m.RunLifecycle(ctx) }()
	defer func() { cancel(); <-done }()
	var ids []string
	for i := 0; i < 4; i++ {
		sb, err := h.m.Create(ctx, sandbox.Spec{Image: "tiny", MemoryMiB: 64, IdleTimeoutS: intp(0)})
		if err != nil {
			t.Fatal(err)
		}
		h.writeFile(sb.ID, "/kept", sb.ID)
		ids = append(ids, sb.ID)
	}
	for _, id := range ids {
		h.pause(id)
		time.Sleep(5 * time.Millisecond)
	}
	h.waitState(ids[0], sandbox.StateHibernated)
	h.waitState(ids[1], sandbox.StateHibernated)
	time.Sleep(300 * time.Millisecond) // several checks: no more demotions
	for _, id := range ids[2:] {
		if st := h.record(id).State; st != sandbox.StatePaused {
			t.Fatalf("%s (paused last) is %s; the two most recent fit the 150 MiB budget", id, st)
		}
	}
	for _, id := range ids {
		if got := h.readFile(id, "/kept"); got != id {
			t.Fatalf("%s: /kept = %q", id, got)
		}
	}
}

// TestPausedCrash: a server that crashes with a paused sandbox finds it, on
// restart, paused on its live instance (server crash) or hibernated on its
// pause's snapshot (the instance gone too: a host crash); either way the next
// request answers with what it had. An instance that dies while paused is
// hibernated on its pause's snapshot, not reported error.
func TestPausedCrash(t *testing.T) {
	h := newHost(t, hostOpts{})
	a, b := h.create(), h.create()
	for _, sb := range []sandbox.Sandbox{a, b} {
		h.writeFile(sb.ID, "/kept", sb.ID)
		h.pause(sb.ID)
	}
	instB := h.record(b.ID).Instance
	h.crash()
	h.eng.Kill(instB) // b's process is gone with the host
	h2 := newHost(t, hostOpts{dir: h.dir, eng: h.eng})
	if rec := h2.record(a.ID); rec.State != sandbox.StatePaused || !h2.eng.Paused(rec.Instance) {
		t.Fatalf("after a server crash: %s is %s (instance paused %v); want paused", a.ID, rec.State, h2.eng.Paused(rec.Instance))
	}
	if rec := h2.record(b.ID); rec.State != sandbox.StateHibernated || rec.Instance != "" {
		t.Fatalf("after a host crash: %s is %s on %q; want hibernated", b.ID, rec.State, rec.Instance)
	}
	for _, sb := range []sandbox.Sandbox{a, b} {
		if got := h2.readFile(sb.ID, "/kept"); got != sb.ID {
			t.Fatalf("%s after restart: /kept = %q", sb.ID, got)
		}
	}
	infos, _ := h2.eng.List(context.Background())
	if len(infos) != 2 {
		t.Fatalf("instances after restart and two requests: %+v; want one per sandbox", infos)
	}
	// Killed while paused: hibernated on the pause's snapshot.
	h2.pause(a.ID)
	h2.eng.Kill(h2.record(a.ID).Instance)
	h2.waitState(a.ID, sandbox.StateHibernated)
	if got := h2.readFile(a.ID, "/kept"); got != a.ID {
		t.Fatalf("after the paused instance died: /kept = %q", got)
	}
}
