package engine_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
)

// picky is an engine with its own compatibility rule: it restores checkpoints
// of "fake 1" and "fake 2" only.
type picky struct{ *fake.Engine }

func (picky) CanRestore(version string) error {
	if version == "fake 1" || version == "fake 2" {
		return nil
	}
	return errors.New("only fake 1 and fake 2 checkpoints")
}

func newFake(t *testing.T, name, version string) *fake.Engine {
	e, err := fake.New(fake.Config{Dir: t.TempDir(), Name: name, Version: version})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestRegistry(t *testing.T) {
	a, b := newFake(t, "alpha", "alpha 1"), newFake(t, "beta", "beta 7")
	if _, err := engine.NewRegistry("gamma", a, b); err == nil {
		t.Fatal("a default that is not registered was accepted")
	}
	if _, err := engine.NewRegistry("alpha", a, newFake(t, "alpha", "alpha 2")); err == nil {
		t.Fatal("two engines with one name were accepted")
	}
	r, err := engine.NewRegistry("beta", a, b)
	if err != nil {
		t.Fatal(err)
	}
	if r.Default() != engine.Engine(b) || strings.Join(r.Names(), ",") != "alpha,beta" {
		t.Fatalf("default %s, names %v", r.Default().Name(), r.Names())
	}
	if e, ok := r.Get("alpha"); !ok || e != engine.Engine(a) {
		t.Fatal("Get(alpha)")
	}
}

// TestCheckRestore: without a CompatibilityChecker only the exact version
// restores; with one, the engine decides; an unknown engine name is refused.
// Every refusal is an *IncompatibleError naming both versions.
func TestCheckRestore(t *testing.T) {
	plain := newFake(t, "fake", "fake 2")
	r, _ := engine.NewRegistry("fake", plain)
	if e, err := r.CheckRestore("fake", "fake 2"); err != nil || e != engine.Engine(plain) {
		t.Fatalf("same version: %v", err)
	}
	_, err := r.CheckRestore("fake", "fake 1")
	var ie *engine.IncompatibleError
	if !errors.As(err, &ie) || !errors.Is(err, engine.ErrIncompatible) || err.Error() != "taken by fake 1, this host runs fake 2" {
		t.Fatalf("older version: %v", err)
	}
	if _, err := r.CheckRestore("qemu", "qemu 9"); !errors.Is(err, engine.ErrIncompatible) || !strings.Contains(err.Error(), "engine qemu") {
		t.Fatalf("unknown engine: %v", err)
	}

	rp, _ := engine.NewRegistry("fake", picky{newFake(t, "fake", "fake 3")})
	if _, err := rp.CheckRestore("fake", "fake 1"); err != nil {
		t.Fatalf("a version the engine accepts: %v", err)
	}
	_, err = rp.CheckRestore("fake", "fake 0")
	if !errors.As(err, &ie) || ie.HostVersion != "fake 3" || !strings.Contains(err.Error(), "only fake 1 and fake 2") {
		t.Fatalf("a version the engine refuses: %v", err)
	}
}
