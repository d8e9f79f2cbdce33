package resume

import (
	"bufio"
	"context"
	"encoding/json"
	mrand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeAgent speaks the agent's side of the events protocol on a unix socket in a
// temporary contract directory.
type fakeAgent struct {
	t   *testing.T
	dir string
	ln  net.Listener
	gen int64

	mu     sync.Mutex
	conns  []*fakeConn
	connCh chan *fakeConn
}

type fakeConn struct {
	c    net.Conn
	r    *bufio.Reader
	name string
}

func newFakeAgent(t *testing.T, gen int64) *fakeAgent {
	t.Helper()
	dir, err := os.MkdirTemp("", "rs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	a := &fakeAgent{t: t, dir: dir, gen: gen, connCh: make(chan *fakeConn, 4)}
	a.writeGen(gen)
	ln, err := net.Listen("unix", filepath.Join(dir, EventsSocket))
	if err != nil {
		t.Fatal(err)
	}
	a.ln = ln
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fc := &fakeConn{c: c, r: bufio.NewReader(c)}
			t.Cleanup(func() { c.Close() })
			a.send(fc, map[string]any{"event": "hello", "generation": a.gen})
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			line, err := fc.r.ReadBytes('\n')
			if err != nil {
				continue
			}
			var sub struct {
				Subscribe bool   `json:"subscribe"`
				Name      string `json:"name"`
			}
			if json.Unmarshal(line, &sub) != nil || !sub.Subscribe {
				t.Errorf("first message %q is not a subscribe", line)
				continue
			}
			fc.name = sub.Name
			a.send(fc, map[string]any{"event": "subscribed"})
			a.connCh <- fc
		}
	}()
	return a
}

func (a *fakeAgent) writeGen(g int64) {
	if err := os.WriteFile(filepath.Join(a.dir, GenerationFile), []byte(strconv.FormatInt(g, 10)+"\n"), 0o644); err != nil {
		a.t.Fatal(err)
	}
}

func (a *fakeAgent) send(fc *fakeConn, msg any) {
	b, _ := json.Marshal(msg)
	if _, err := fc.c.Write(append(b, '\n')); err != nil {
		a.t.Errorf("fake agent send: %v", err)
	}
}

// resume sends a resume event and waits for its ack.
func (a *fakeAgent) resume(fc *fakeConn, gen, seq int64, forked bool) {
	a.t.Helper()
	a.gen = gen
	a.writeGen(gen)
	a.send(fc, map[string]any{"event": "resume", "generation": gen, "forked": forked,
		"host_time": time.Now().UTC().Format(time.RFC3339Nano), "snapshot_id": "snap-x", "seq": seq})
	fc.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := fc.r.ReadBytes('\n')
	if err != nil {
		a.t.Fatalf("no ack for seq %d: %v", seq, err)
	}
	var ack struct {
		Ack *int64 `json:"ack"`
	}
	if err := json.Unmarshal(line, &ack); err != nil || ack.Ack == nil || *ack.Ack != seq {
		a.t.Fatalf("got %q, want {\"ack\":%d}", line, seq)
	}
}

func startRuntime(t *testing.T, a *fakeAgent, reg *Registry) (*Runtime, *fakeConn) {
	t.Helper()
	rt, err := Start(context.Background(), Options{Name: "unit test", Dir: a.dir, Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close() })
	select {
	case fc := <-a.connCh:
		if fc.name != "unit test" {
			t.Errorf("subscribe name %q", fc.name)
		}
		return rt, fc
	case <-time.After(5 * time.Second):
		t.Fatal("runtime did not connect and subscribe")
	}
	return nil, nil
}

func TestRuntimeHooksInOrderThenAck(t *testing.T) {
	a := newFakeAgent(t, 7)
	reg := NewRegistry()
	var mu sync.Mutex
	var calls []string
	rec := func(s string) Hook {
		return func(ctx context.Context, ev Event) error {
			mu.Lock()
			calls = append(calls, s)
			mu.Unlock()
			return nil
		}
	}
	reg.OnResume(10, rec("c"))
	reg.OnResume(0, rec("a"))
	reg.OnResume(0, rec("b"))
	reg.OnResume(-1000, rec("before-builtins"))
	var seedCalledFirst bool
	_ = reg.RegisterRand(func(seed [32]byte) {
		mu.Lock()
		seedCalledFirst = len(calls) == 1 && calls[0] == "before-builtins"
		mu.Unlock()
	})
	rt, fc := startRuntime(t, a, reg)
	for i := 0; i < 100 && !rt.Subscribed(); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if !rt.Subscribed() {
		t.Error("not subscribed")
	}
	if g := rt.Generation(); g != 7 {
		t.Errorf("generation after hello = %d, want 7", g)
	}
	watch := rt.Watch(context.Background())
	a.resume(fc, 8, 1, false)
	mu.Lock()
	got := calls
	mu.Unlock()
	want := []string{"before-builtins", "a", "b", "c"}
	if len(got) != len(want) {
		t.Fatalf("hooks ran %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("hooks ran %v, want %v", got, want)
		}
	}
	if !seedCalledFirst {
		t.Error("reseed did not run before the user hooks of order >= 0")
	}
	select {
	case ev := <-watch:
		if ev.Generation != 8 || ev.Seq != 1 || ev.SnapshotID != "snap-x" || ev.HostTime.IsZero() {
			t.Errorf("watched event %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no event on Watch")
	}
	if g := rt.Generation(); g != 8 {
		t.Errorf("runtime generation %d, want 8", g)
	}
	SetDir(a.dir)
	defer SetDir(DefaultDir)
	if g, err := Generation(); err != nil || g != 8 {
		t.Errorf("Generation() = %d, %v; want 8", g, err)
	}
	// A failing hook is reported, the others still run and the event is acked.
	reg.OnResume(5, func(ctx context.Context, ev Event) error { return os.ErrPermission })
	reg.OnResume(6, func(ctx context.Context, ev Event) error { panic("boom") })
	mu.Lock()
	calls = nil
	mu.Unlock()
	a.resume(fc, 9, 2, false)
	if ev, err := rt.WaitGeneration(context.Background(), 8); err != nil || ev.Generation != 9 {
		t.Fatalf("WaitGeneration: %+v %v", ev, err)
	}
	mu.Lock()
	n := len(calls)
	mu.Unlock()
	if n != 4 {
		t.Errorf("after a failing hook, %d of 4 recording hooks ran", n)
	}
}

func TestReseedChangesStream(t *testing.T) {
	a := newFakeAgent(t, 1)
	reg := NewRegistry()
	seed := [32]byte{1, 2, 3}
	c8 := mrand.NewChaCha8(seed)
	pcg := mrand.NewPCG(1, 2)
	if err := reg.RegisterRand(c8); err != nil {
		t.Fatal(err)
	}
	if err := reg.RegisterRand(pcg); err != nil {
		t.Fatal(err)
	}
	if err := reg.RegisterRand(42); err == nil {
		t.Error("RegisterRand(int) accepted")
	}
	// What an unnotified clone would draw next: the same stream as a twin.
	twinC8 := mrand.NewChaCha8(seed)
	twinPCG := mrand.NewPCG(1, 2)
	c8.Uint64()
	twinC8.Uint64()
	pcg.Uint64()
	twinPCG.Uint64()
	_, fc := startRuntime(t, a, reg)
	a.resume(fc, 2, 1, true)
	if c8.Uint64() == twinC8.Uint64() {
		t.Error("ChaCha8 stream unchanged by the resume")
	}
	if pcg.Uint64() == twinPCG.Uint64() {
		t.Error("PCG stream unchanged by the resume")
	}
}

func TestForkWipesSecretsAndMovesIntentsAside(t *testing.T) {
	a := newFakeAgent(t, 3)
	reg := NewRegistry()
	secret := []byte("hunter2")
	token := "tok"
	called := false
	for name, s := range map[string]any{"bytes": &secret, "string": &token, "func": func() { called = true }} {
		if err := reg.RegisterSecret(name, s); err != nil {
			t.Fatal(err)
		}
	}
	kept := secret
	jpath := filepath.Join(t.TempDir(), "intents.jsonl")
	j, err := reg.OpenJournal(jpath)
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	unsafe, _ := j.Begin("create_pr", map[string]string{"title": "x"})
	safe, _ := j.Begin("read_issue", 3, ForkSafe())
	done, _ := j.Begin("comment", "hi")
	if err := j.Complete(done.Key, "ok"); err != nil {
		t.Fatal(err)
	}
	_, fc := startRuntime(t, a, reg)

	// A plain resume keeps everything.
	a.resume(fc, 4, 1, false)
	if string(secret) != "hunter2" || token != "tok" || called || len(j.Pending()) != 2 {
		t.Fatalf("a non-fork resume wiped state: %q %q %v %d", secret, token, called, len(j.Pending()))
	}

	// A fork wipes and moves aside.
	a.resume(fc, 9, 2, true)
	if secret != nil || token != "" || !called {
		t.Errorf("secrets not wiped in the clone: %q %q %v", secret, token, called)
	}
	for _, b := range kept {
		if b != 0 {
			t.Errorf("secret bytes not zeroed: %q", kept)
			break
		}
	}
	p := j.Pending()
	if len(p) != 1 || p[0].Key != safe.Key {
		t.Errorf("pending in the clone = %+v, want only the fork-safe %s", p, safe.Key)
	}
	aside, err := os.ReadFile(jpath + ".forked-9")
	if err != nil {
		t.Fatalf("moved-aside file: %v", err)
	}
	var rec record
	if err := json.Unmarshal(aside, &rec); err != nil || rec.Key != unsafe.Key || rec.Tool != "create_pr" {
		t.Errorf("moved-aside file %q", aside)
	}
	// The rewritten journal holds the rest, and reopening agrees.
	j2, err := openJournal(jpath, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer j2.Close()
	if p := j2.Pending(); len(p) != 1 || p[0].Key != safe.Key {
		t.Errorf("reopened pending %+v", p)
	}
	if in, ok := j2.Get(done.Key); !ok || !in.Done() || string(in.Outcome) != `"ok"` {
		t.Errorf("completed intent after the rewrite: %+v %v", in, ok)
	}
	// The journal still takes appends after the rewrite.
	if _, err := j.Begin("after", nil); err != nil {
		t.Fatal(err)
	}
}

func TestNoSocketIsIdle(t *testing.T) {
	dir := t.TempDir()
	rt, err := Start(context.Background(), Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	if rt.Connected() || rt.Generation() != 0 {
		t.Errorf("idle runtime: connected %v generation %d", rt.Connected(), rt.Generation())
	}
	SetDir(dir)
	defer SetDir(DefaultDir)
	if g, err := Generation(); g != 0 || err != nil {
		t.Errorf("Generation() outside torpor = %d, %v", g, err)
	}
	if d := ClockOffset(); d != 0 {
		t.Errorf("offset %v", d)
	}
}

func TestRuntimeReconnects(t *testing.T) {
	a := newFakeAgent(t, 1)
	reg := NewRegistry()
	var n atomic.Int32
	reg.OnResume(0, func(ctx context.Context, ev Event) error { n.Add(1); return nil })
	rt, fc := startRuntime(t, a, reg)
	fc.c.Close() // the agent restarted
	var fc2 *fakeConn
	select {
	case fc2 = <-a.connCh:
	case <-time.After(10 * time.Second):
		t.Fatal("no reconnect")
	}
	a.resume(fc2, 2, 1, false)
	if n.Load() != 1 || rt.Generation() != 2 {
		t.Errorf("after reconnect: hooks %d, generation %d", n.Load(), rt.Generation())
	}
}
