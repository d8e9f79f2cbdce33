package sandboxnet_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"net"
	"os"
	"testing"

	"github.com/torpor/torpor/sandboxnet"
)

// scope is a prefix no other test or server uses.
func scope(t testing.TB) string {
	var b [3]byte
	rand.Read(b[:])
	return "tsn" + hex.EncodeToString(b[:])
}

func exists(name string) bool {
	_, err := os.Stat("/run/netns/" + name)
	return err == nil
}

// TestRename: a renamed pair keeps its veth, addresses and routes: a
// listener in the guest namespace is reached through the new names, the old
// names are gone, and a rename onto taken names fails leaving both pairs.
func TestRename(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ctx := context.Background()
	sc := scope(t)
	a, b, c := sandboxnet.For(sc, "a"), sandboxnet.For(sc, "b"), sandboxnet.For(sc, "c")
	for _, p := range []sandboxnet.Pair{a, b, c} {
		t.Cleanup(func() { sandboxnet.Delete(ctx, p) })
	}
	if err := sandboxnet.Create(ctx, a); err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	if err := sandboxnet.RunInNetns(a.Guest, func() (err error) {
		ln, err = net.Listen("tcp4", sandboxnet.GuestIP+":8080")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("hi"))
			c.Close()
		}
	}()
	if err := sandboxnet.Rename(a, b); err != nil {
		t.Fatal(err)
	}
	if exists(a.Guest) || exists(a.Host) {
		t.Errorf("the old names are still there after the rename")
	}
	if !exists(b.Guest) || !exists(b.Host) {
		t.Fatalf("the new names are missing after the rename")
	}
	conn, err := b.Dial(ctx, 8080)
	if err != nil {
		t.Fatalf("dial through the renamed pair: %v", err)
	}
	buf := make([]byte, 2)
	if _, err := conn.Read(buf); err != nil || string(buf) != "hi" {
		t.Errorf("read %q, %v through the renamed pair", buf, err)
	}
	conn.Close()
	if names, _ := sandboxnet.List(sc); len(names) != 2 {
		t.Errorf("List after the rename: %v, want b's two names", names)
	}

	if err := sandboxnet.Create(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := sandboxnet.Rename(c, b); !errors.Is(err, fs.ErrExist) {
		t.Errorf("rename onto taken names: %v, want fs.ErrExist", err)
	}
	for _, n := range []string{b.Guest, b.Host, c.Guest, c.Host} {
		if !exists(n) {
			t.Errorf("%s gone after a failed rename", n)
		}
	}
	if err := sandboxnet.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	if exists(b.Guest) || exists(b.Host) {
		t.Errorf("Delete left the renamed pair")
	}
}

// BenchmarkMakePair compares a pair made for an instance (Create) with a
// spare one renamed to the instance's names (Rename); ns/op is per pair.
func BenchmarkMakePair(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	ctx := context.Background()
	sc := scope(b)
	b.Run("create", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			p := sandboxnet.For(sc, "x")
			if err := sandboxnet.Create(ctx, p); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			sandboxnet.Delete(ctx, p)
			b.StartTimer()
		}
	})
	b.Run("rename", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			b.StopTimer()
			spare, p := sandboxnet.For(sc, "spare"), sandboxnet.For(sc, "y")
			if err := sandboxnet.Create(ctx, spare); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			if err := sandboxnet.Rename(spare, p); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			sandboxnet.Delete(ctx, p)
			b.StartTimer()
		}
	})
}
