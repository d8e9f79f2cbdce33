// Package quickstart is `torpor quickstart`: a short, printed walk through
// torpor's core promise against a real server. It creates a sandbox from the
// "base" image, starts the reference workload (package workload: a Python server
// holding a counter and 64 MiB of random data), hibernates the sandbox, and wakes
// it again simply by sending the next request through the port proxy — then shows
// that the counter continued and the data's checksum is unchanged.
//
// If no server answers at the URL, Run starts one itself (`torpor serve` with the
// default data directory, its log in that directory) and stops it, by its pid,
// when it is done.
package quickstart
