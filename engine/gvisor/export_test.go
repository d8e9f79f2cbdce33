package gvisor

// RunscCheckpoints returns how many checkpoints e made by starting runsc
// checkpoint instead of calling the sandbox directly.
func RunscCheckpoints(e *Engine) int64 { return e.runscCheckpoints.Load() }
