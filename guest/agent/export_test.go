package agent

// HoldReaper takes the process-wide reaper's lock, as a fork that is slow to
// return holds it (no command starts and no exit status is collected until
// the returned func releases it).
func HoldReaper() (release func()) {
	r := getReaper(false, nil)
	r.lock <- struct{}{}
	return func() { <-r.lock }
}
