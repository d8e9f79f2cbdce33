package manager_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// A sandbox's starting point for the state table.
const (
	fromRunning      = "running"
	fromHibernated   = "hibernated"
	fromPaused       = "paused"
	fromErrorSnap    = "error with a snapshot" // its instance died after a hibernate and resume
	fromErrorNoSnaps = "error without a snapshot"
)

// prepare makes a sandbox in state from, with /kept written before any hibernate.
func (h *host) prepare(from string) string {
	h.t.Helper()
	ctx := context.Background()
	sb := h.create()
	h.writeFile(sb.ID, "/kept", "yes")
	switch from {
	case fromHibernated:
		if _, err := h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
			h.t.Fatal(err)
		}
	case fromPaused:
		if _, _, err := h.m.Pause(ctx, sb.ID); err != nil {
			h.t.Fatal(err)
		}
	case fromErrorSnap, fromErrorNoSnaps:
		if from == fromErrorSnap {
			if _, err := h.m.Hibernate(ctx, sb.ID, manager.HibernateOptions{}); err != nil {
				h.t.Fatal(err)
			}
			if _, err := h.m.Resume(ctx, sb.ID); err != nil {
				h.t.Fatal(err)
			}
		}
		h.eng.Kill(h.record(sb.ID).Instance)
		h.waitState(sb.ID, sandbox.StateError)
	}
	return sb.ID
}

func (h *host) waitState(id string, want sandbox.State) {
	h.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for h.record(id).State != want {
		if time.Now().After(deadline) {
			h.t.Fatalf("sandbox %s is %s, want %s", id, h.record(id).State, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestStateCalls: every API call in every settled state, with the answer and
// the state persisted afterwards ("gone" for a deleted record).
func TestStateCalls(t *testing.T) {
	ctx := context.Background()
	calls := map[string]func(m *manager.Manager, id string) error{
		"hibernate": func(m *manager.Manager, id string) error {
			_, err := m.Hibernate(ctx, id, manager.HibernateOptions{})
			return err
		},
		"resume": func(m *manager.Manager, id string) error { _, err := m.Resume(ctx, id); return err },
		"fork":   func(m *manager.Manager, id string) error { _, err := m.Fork(ctx, id, 1); return err },
		"delete": func(m *manager.Manager, id string) error { return m.Delete(ctx, id) },
		"pause":  func(m *manager.Manager, id string) error { _, _, err := m.Pause(ctx, id); return err },
		"exec":   func(m *manager.Manager, id string) error { return execTrue(ctx, m, id) },
		"read": func(m *manager.Manager, id string) error {
			r, _, err := m.ReadFile(ctx, id, "/kept")
			if err != nil {
				return err
			}
			defer r.Close()
			b, err := io.ReadAll(r)
			if err == nil && string(b) != "yes" {
				err = errors.New("/kept = " + string(b))
			}
			return err
		},
		"write": func(m *manager.Manager, id string) error {
			return m.WriteFile(ctx, id, "/new", strings.NewReader("x"), 1)
		},
		// No server listens on the port: the call wakes the sandbox and is refused.
		"proxy": func(m *manager.Manager, id string) error {
			c, err := m.DialPort(ctx, id, 8080)
			if err == nil {
				c.Close()
				return errors.New("dialled a port nothing listens on")
			}
			if strings.Contains(err.Error(), "connection refused") {
				return nil
			}
			return err
		},
	}
	conflict := sandbox.ErrConflict
	type want struct {
		err   error // nil, or the kind the error wraps
		state string
	}
	table := map[string]map[string]want{
		fromRunning: {
			"hibernate": {nil, "hibernated"}, "resume": {nil, "running"}, "fork": {nil, "running"},
			"delete": {nil, "gone"}, "exec": {nil, "running"}, "read": {nil, "running"},
			"write": {nil, "running"}, "proxy": {nil, "running"}, "pause": {nil, "paused"},
		},
		fromHibernated: {
			"hibernate": {nil, "hibernated"}, "resume": {nil, "running"}, "fork": {nil, "hibernated"},
			"delete": {nil, "gone"}, "exec": {nil, "running"}, "read": {nil, "running"},
			"write": {nil, "running"}, "proxy": {nil, "running"}, "pause": {conflict, "hibernated"},
		},
		fromPaused: {
			"hibernate": {nil, "hibernated"}, "resume": {nil, "running"}, "fork": {nil, "paused"},
			"delete": {nil, "gone"}, "exec": {nil, "running"}, "read": {nil, "running"},
			"write": {nil, "running"}, "proxy": {nil, "running"}, "pause": {nil, "paused"},
		},
		fromErrorSnap: {
			"hibernate": {conflict, "error"}, "resume": {nil, "running"}, "fork": {conflict, "error"},
			"delete": {nil, "gone"}, "exec": {conflict, "error"}, "read": {conflict, "error"},
			"write": {conflict, "error"}, "proxy": {conflict, "error"}, "pause": {conflict, "error"},
		},
		fromErrorNoSnaps: {
			"hibernate": {conflict, "error"}, "resume": {conflict, "error"}, "fork": {conflict, "error"},
			"delete": {nil, "gone"}, "exec": {conflict, "error"}, "read": {conflict, "error"},
			"write": {conflict, "error"}, "proxy": {conflict, "error"}, "pause": {conflict, "error"},
		},
	}
	for from, row := range table {
		h := newHost(t, hostOpts{})
		for call, w := range row {
			t.Run(from+"/"+call, func(t *testing.T) {
				h.t = t
				id := h.prepare(from)
				err := calls[call](h.m, id)
				switch {
				case w.err == nil && err != nil:
					t.Fatalf("%s on a %s sandbox: %v, want success", call, from, err)
				case w.err != nil && !errors.Is(err, w.err):
					t.Fatalf("%s on a %s sandbox: %v, want %v", call, from, err, w.err)
				}
				got := "gone"
				if rec, err := h.db.GetSandbox(ctx, id); err == nil {
					got = string(rec.State)
				}
				if got != w.state {
					t.Fatalf("%s on a %s sandbox: state %s afterwards, want %s", call, from, got, w.state)
				}
				if got == "running" {
					if v := h.readFile(id, "/kept"); v != "yes" {
						t.Fatalf("%s on a %s sandbox: /kept = %q afterwards", call, from, v)
					}
				}
			})
		}
	}
}

// TestDeleteRacingResume: a delete sent while a resume waits in the engine
// waits for the resume and then removes the sandbox; nothing of it is left in
// the engine.
func TestDeleteRacingResume(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	id := h.prepare(fromHibernated)
	b := h.eng.Block(fake.Restore, "")
	var wg sync.WaitGroup
	var resumeErr, deleteErr error
	wg.Add(2)
	go func() { defer wg.Done(); _, resumeErr = h.m.Resume(ctx, id) }()
	<-b.Reached()
	if rec := h.record(id); rec.State != sandbox.StateResuming {
		t.Fatalf("state %s while the engine restores, want resuming", rec.State)
	}
	go func() { defer wg.Done(); deleteErr = h.m.Delete(ctx, id) }()
	time.Sleep(50 * time.Millisecond) // the delete waits on the sandbox's lock
	b.Release()
	wg.Wait()
	if resumeErr != nil || deleteErr != nil {
		t.Fatalf("resume: %v; delete: %v", resumeErr, deleteErr)
	}
	if _, err := h.m.Get(ctx, id); !errors.Is(err, sandbox.ErrNotFound) {
		t.Fatalf("after the delete: %v, want ErrNotFound", err)
	}
	h.m.Wait()
	if infos, _ := h.eng.List(ctx); len(infos) != 0 {
		t.Fatalf("instances left: %+v", infos)
	}
}

// TestRequestDuringHibernate: a file read sent while the sandbox's checkpoint
// is under way waits for the hibernate, then wakes the sandbox and answers.
func TestRequestDuringHibernate(t *testing.T) {
	ctx := context.Background()
	h := newHost(t, hostOpts{})
	id := h.prepare(fromRunning)
	gen := h.record(id).Generation
	b := h.eng.Block(fake.Checkpoint, "")
	var wg sync.WaitGroup
	var hibErr error
	wg.Add(1)
	go func() { defer wg.Done(); _, hibErr = h.m.Hibernate(ctx, id, manager.HibernateOptions{}) }()
	<-b.Reached()
	if rec := h.record(id); rec.State != sandbox.StateHibernating {
		t.Fatalf("state %s during the checkpoint, want hibernating", rec.State)
	}
	got := make(chan string, 1)
	go func() {
		r, _, err := h.m.ReadFile(ctx, id, "/kept")
		if err != nil {
			got <- err.Error()
			return
		}
		defer r.Close()
		b, _ := io.ReadAll(r)
		got <- string(b)
	}()
	select {
	case v := <-got:
		t.Fatalf("the read answered during the checkpoint: %q", v)
	case <-time.After(50 * time.Millisecond):
	}
	b.Release()
	wg.Wait()
	if hibErr != nil {
		t.Fatal(hibErr)
	}
	if v := <-got; v != "yes" {
		t.Fatalf("read after the hibernate: %q", v)
	}
	if rec := h.record(id); rec.State != sandbox.StateRunning || rec.Generation <= gen {
		t.Fatalf("after the read: state %s generation %d, want running on a generation after %d (resumed)", rec.State, rec.Generation, gen)
	}
}
