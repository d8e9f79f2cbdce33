package agent

import (
	"log"
	"net"
)

// hostOnly is the agent's listener in a sandbox: it accepts connections from
// the host only. The agent runs commands as any user, root included, and
// writes the generation and the resume events, so a process inside the
// sandbox that reached it would run as root and could fake a restore. A
// connection from inside arrives from an address of the sandbox's own: a
// loopback address, or one of its interfaces' (the host dials the guest's
// address from the host side of the veth pair, a different address); such a
// connection is closed unanswered and logged. A process cannot take an
// address the sandbox does not have without CAP_NET_ADMIN, and a handshake
// from an address it does not own never completes (the answer leaves by eth0).
type hostOnly struct {
	net.Listener
	log *log.Logger
}

// Accept returns the next connection from outside the sandbox.
func (l hostOnly) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if !fromInside(c.RemoteAddr()) {
			return c, nil
		}
		if l.log != nil {
			l.log.Printf("refused a connection from inside the sandbox (%s)", c.RemoteAddr())
		}
		c.Close()
	}
}

// fromInside reports whether addr is one of the sandbox's own addresses:
// loopback, or any address of its interfaces. An address it cannot parse
// counts as inside.
func fromInside(addr net.Addr) bool {
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return true
	}
	if ta.IP.IsLoopback() || ta.IP.IsUnspecified() {
		return true
	}
	own, err := net.InterfaceAddrs()
	if err != nil {
		return true
	}
	for _, a := range own {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ta.IP) {
			return true
		}
	}
	return false
}
