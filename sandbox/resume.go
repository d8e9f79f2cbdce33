package sandbox

// ResumeReport is the result of the resume contract run by the guest agent on
// a start, resume or fork, plus what the host measured. OK is false if any step
// failed, a subscribed process did not acknowledge in time, a hook failed or
// overran, or the agent could not be reached (Error); the resume completes in
// every case.
type ResumeReport struct {
	// Event is "start" (first boot), "resume" (resume or fork) or
	// "unpaused" (continued from the paused tier: the same instance and
	// generation, the clocks jumped).
	Event      string
	Generation int64
	Forked     bool
	// SnapshotID is the snapshot restored ("" at start).
	SnapshotID string
	// Steps are the built-in steps in the order run: generation, reseed,
	// clock, notify, hooks.
	Steps       []ResumeStep
	Clock       ResumeClock
	Subscribers ResumeSubscribers
	Hooks       []ResumeHook
	OK          bool
	// WindowMS (host-measured) is the time user processes ran un-notified:
	// from the engine's start or restore returning until the agent's notify
	// step completed.
	WindowMS float64
	// AgentMS (host-measured) is the duration of the host's call to the agent.
	AgentMS float64
	// Error says why the agent could not run the contract (then Steps is empty).
	Error string
}

// ResumeStep is one timed built-in step of the resume contract.
type ResumeStep struct {
	Name   string
	MS     float64
	OK     bool
	Detail string
}

// ResumeClock is the clock step's result: SkewMS is the sandbox's wall clock
// minus the host's; Corrected is "none" or "offset-file".
type ResumeClock struct {
	SkewMS    float64
	Corrected string
}

// ResumeSubscribers counts the processes subscribed to resume events and names
// those that did not acknowledge before the deadline.
type ResumeSubscribers struct {
	Total    int
	Acked    int
	TimedOut []string
}

// ResumeHook is the result of one user hook (/etc/torpor/resume.d/ in the
// sandbox).
type ResumeHook struct {
	Name     string
	ExitCode int
	MS       float64
	TimedOut bool
	// Output is the hook's combined stdout and stderr, truncated at 64 KiB.
	Output string
}
