package manager

import (
	"os"
	"syscall"
)

// FaultEnv names the environment variable that makes the server kill itself
// (SIGKILL) at one named point, for crash tests (e2e): never set otherwise.
// The points: "create-recorded" (a create's record written, its instance not
// started), "fork-clone-restored" (a fork of a running sandbox: a clone's
// instance restored from the checkpoint, the snapshot not yet committed, no
// clone record written), "fork-clones-recorded" (a fork's clone records
// written, none restored), "resume-restoring" (a resume's snapshot opened and its state
// resuming recorded, its restore not begun), "hibernate-checkpointed" (a
// hibernate's checkpoint written to staging, not committed),
// "hibernate-recorded" (a hibernate's snapshot committed and recorded, the
// answer not sent: a deferred first commit's chunks not stored yet), and the server's
// "idempotency-claimed" and "idempotency-recorded" (server/idempotency.go).
const FaultEnv = "TORPOR_TEST_KILL_AT"

// FaultPoint kills the process when FaultEnv names point.
func FaultPoint(point string) {
	if os.Getenv(FaultEnv) == point {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// faultAt says whether FaultEnv names point (to reach it first: a point past
// work that runs in the background).
func faultAt(point string) bool { return os.Getenv(FaultEnv) == point }
