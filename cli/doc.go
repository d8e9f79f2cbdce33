// Package cli is the torpor command line: `torpor serve` runs the server, and the
// other commands (create, ls, inspect, exec, cp, hibernate, resume, fork, rm, image
// …) talk to a server through package client, at --url or $TORPOR_URL
// (default http://127.0.0.1:7070).
//
// Execute runs the command line of the process and returns its exit code: 0 on
// success, 1 on an error (printed as "torpor: <message>" on stderr), 2 on a usage
// error, and for `torpor exec` the exit code of the process run in the sandbox.
//
// serve, quickstart and bench resume call packages server, quickstart and bench
// (serve.go, quickstart.go, bench.go); the hidden serve-watchdog, which a
// server on a shared database starts to watch itself, calls package watchdog
// (servecmd.go); the snapshot commands' offline mode
// (--data-dir) opens a data directory's store through package server.
package cli
