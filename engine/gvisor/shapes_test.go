package gvisor

import (
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
)

// TestAdmitShapes: the pool remembers at most n shapes; a known shape moves
// to the most recent place; a new shape displaces the least recently used
// one only once that one is shapeHold old, and is turned away (counted)
// before that — so shapes in turn beyond n do not churn the pool.
func TestAdmitShapes(t *testing.T) {
	p := &preparedPool{shapes: map[string]engine.Spec{}, last: map[string]time.Time{}}
	t0 := time.Date(2026, 12, 4, 0, 0, 0, 0, time.UTC)
	use := func(key string, at time.Duration) (string, bool) {
		return p.admitLocked(key, engine.Spec{RootFS: "/" + key}, t0.Add(at), 2)
	}
	want := func(what string, evicted string, ok bool, wantEvicted string, wantOK bool, order ...string) {
		t.Helper()
		if evicted != wantEvicted || ok != wantOK {
			t.Errorf("%s: evicted %q ok %v, want %q %v", what, evicted, ok, wantEvicted, wantOK)
		}
		if len(p.used) != len(order) {
			t.Fatalf("%s: remembered %v, want %v", what, p.used, order)
		}
		for i := range order {
			if p.used[i] != order[i] {
				t.Fatalf("%s: remembered %v, want %v", what, p.used, order)
			}
			if _, ok := p.shapes[order[i]]; !ok {
				t.Fatalf("%s: shape %s in the order but not in the map", what, order[i])
			}
		}
		if len(p.shapes) != len(order) || len(p.last) != len(order) {
			t.Fatalf("%s: %d shapes and %d times for %d remembered", what, len(p.shapes), len(p.last), len(order))
		}
	}
	e, ok := use("a", 0)
	want("a joins", e, ok, "", true, "a")
	e, ok = use("b", time.Second)
	want("b joins", e, ok, "", true, "a", "b")
	e, ok = use("a", 2*time.Second)
	want("a again", e, ok, "", true, "b", "a")
	// c, d, c, d... within the hold: turned away, a and b kept.
	for i := 0; i < 4; i++ {
		key := []string{"c", "d"}[i%2]
		e, ok = use(key, time.Duration(3+i)*time.Second)
		want(key+" within the hold", e, ok, "", false, "b", "a")
	}
	if p.held != 4 {
		t.Errorf("held %d, want 4", p.held)
	}
	// A known shape is always admitted, even in a full pool within the hold.
	e, ok = use("b", 10*time.Second)
	want("b again", e, ok, "", true, "a", "b")
	// a was last used at 2 s: at 2 s + shapeHold it gives its place to c.
	e, ok = use("c", 2*time.Second+shapeHold-time.Millisecond)
	want("c just before a's hold ends", e, ok, "", false, "a", "b")
	e, ok = use("c", 2*time.Second+shapeHold)
	want("c once a's hold ended", e, ok, "a", true, "b", "c")
}
