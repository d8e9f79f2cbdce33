package sandbox

// ExecRequest is a command to run in a sandbox.
type ExecRequest struct {
	Cmd []string
	Env map[string]string
	// Cwd is the working directory (absolute; "" = the agent's default).
	Cwd string
	// Stdin is given to the process's stdin, then EOF.
	Stdin string
	// TimeoutS bounds the call from the guest agent's receipt of it, the wait
	// to start included, and then kills the process (and its process group);
	// seconds; 0 = none.
	TimeoutS float64
	// Background starts the process detached: the call returns at once with
	// its pid and the process outlives the call; its output goes to
	// /tmp/torpor-bg-<pid>.log in the sandbox.
	Background bool
}

// ExecEvent is one event of an exec's stream: output chunks carry Stream
// ("stdout" or "stderr") and Data; the last event carries ExitCode (and Pid
// for a background start), or Error if the process could not be started.
type ExecEvent struct {
	Stream   string
	Data     []byte
	ExitCode *int
	Pid      int
	Error    string
}
