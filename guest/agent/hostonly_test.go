package agent

import (
	"net"
	"testing"
)

// TestFromInside: loopback and this host's own interface addresses are
// inside; an address no interface has is the host's side.
func TestFromInside(t *testing.T) {
	inside := []net.Addr{&net.TCPAddr{IP: net.ParseIP("127.0.0.1")}, &net.TCPAddr{IP: net.ParseIP("::1")},
		&net.TCPAddr{IP: net.IPv4zero}, &net.UnixAddr{Name: "x"}}
	if own, err := net.InterfaceAddrs(); err == nil {
		for _, a := range own {
			if n, ok := a.(*net.IPNet); ok {
				inside = append(inside, &net.TCPAddr{IP: n.IP})
			}
		}
	}
	for _, a := range inside {
		if !fromInside(a) {
			t.Errorf("%v counted as from the host", a)
		}
	}
	// TEST-NET-3: documentation addresses, on no interface here.
	if fromInside(&net.TCPAddr{IP: net.ParseIP("203.0.113.7")}) {
		t.Error("an address of no interface counted as inside")
	}
}

// TestHostOnlyRefusesLoopback: a connection to the wrapped listener from
// loopback is closed unanswered, and Accept goes on to the next one.
func TestHostOnlyRefusesLoopback(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	h := hostOnly{Listener: ln}
	got := make(chan net.Conn, 1)
	go func() {
		c, err := h.Accept()
		if err == nil {
			got <- c
		}
		close(got)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 1)
	if n, err := c.Read(buf); err == nil {
		t.Fatalf("a loopback connection was answered (%d bytes)", n)
	}
	ln.Close()
	if c, ok := <-got; ok {
		c.Close()
		t.Fatal("Accept returned a loopback connection")
	}
}
