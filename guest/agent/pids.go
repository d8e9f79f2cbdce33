package agent

import (
	"log"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The sandbox's pids limit is RLIMIT_NPROC, which gVisor counts per real uid
// (threads included) and checks at every clone against the caller's soft
// limit, unless the caller has CAP_SYS_RESOURCE. The agent is uid 0, like a
// root user's processes: when they hold the whole limit (a root fork bomb),
// an agent without the capability can neither start a command nor make the
// OS thread its Go runtime asks for, and a runtime that cannot make one
// exits ("runtime: failed to create new OS thread", errno EAGAIN), which
// ends the sandbox with it.
//
// So the host starts the agent with CAP_SYS_RESOURCE (engine.Spec
// AgentPidsExempt), and the agent keeps it in its effective set but takes it
// out of its bounding set before it starts anything: every command is then
// bound, as a root execve gets the bounding set (and the empty inheritable
// one) and a non-root one gets nothing. Its children hold the capability
// only between their fork and their execve, which runs no user code.

// capSysResourceBit is CAP_SYS_RESOURCE in a capability set's low word.
const capSysResourceBit = 1 << unix.CAP_SYS_RESOURCE

// keepPidsExemption takes CAP_SYS_RESOURCE out of the bounding set of every
// thread of the agent when it is there and effective, so that the agent
// stays exempt from the pids limit and no command it starts is. If that
// fails, it gives the capability up on every thread (the agent is bound
// like its commands). It reports what it did: "exempt", "not exempt"
// (the agent never had it), "gave it up" or an error text.
func keepPidsExemption(lg *log.Logger) string {
	logf := func(format string, args ...any) {
		if lg != nil {
			lg.Printf(format, args...)
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		logf("pids limit: capget: %v", err)
		return "capget: " + err.Error()
	}
	inBounding, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, unix.CAP_SYS_RESOURCE, 0, 0, 0)
	if err != nil {
		logf("pids limit: reading the bounding set: %v", err)
	}
	if data[0].Effective&capSysResourceBit == 0 {
		if inBounding == 1 {
			// Not ours to use, and a command could still gain it: drop it.
			_, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_RESOURCE, 0)
			if errno != 0 {
				logf("pids limit: dropping CAP_SYS_RESOURCE from the bounding set: %v", errno)
			}
		}
		return "not exempt"
	}
	if inBounding != 1 {
		logf("pids limit: exempt (CAP_SYS_RESOURCE effective, not in the bounding set)")
		return "exempt"
	}
	_, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_RESOURCE, 0)
	if errno == 0 {
		logf("pids limit: exempt (CAP_SYS_RESOURCE effective, dropped from the bounding set)")
		return "exempt"
	}
	logf("pids limit: dropping CAP_SYS_RESOURCE from the bounding set: %v; giving it up", errno)
	data[0].Effective &^= capSysResourceBit
	data[0].Permitted &^= capSysResourceBit
	data[0].Inheritable &^= capSysResourceBit
	_, _, errno = syscall.AllThreadsSyscall(syscall.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0)
	if errno != 0 {
		logf("pids limit: giving CAP_SYS_RESOURCE up: %v", errno)
		return "capset: " + errno.Error()
	}
	return "gave it up"
}
