// Package e2e holds torpor's end-to-end tests of the core promise: a sandbox is
// hibernated to a snapshot and resumed with its processes continuing. They run a
// real server (server/servertest) with real runsc (gVisor, systrap), real Python in
// the sandbox (package workload) and real HTTP; nothing is mocked. They need root and
// the pinned runsc (`make setup`) and are skipped otherwise.
//
// What they cover:
//
//   - cycles_test.go: a Python process's request counter and a 64 MiB checksummed
//     buffer survive five hibernate/resume cycles in a row (the proxied request
//     resumes the sandbox, the pid stays the same), and files written and changed
//     before each hibernate — through the files API and through exec — read back
//     with the same sha256 after every resume (files API and sha256sum in the
//     sandbox).
//   - fork_test.go: two clones of one snapshot run at once, each sees only its own
//     later writes, have their own generations and forked_from, their counters
//     continue independently from the snapshot's value, and the running source keeps
//     running.
//   - race_test.go: DELETE racing a resume (a test server whose engine restores after a delay), in both
//     orders and several timings: the sandbox ends 404 and no runsc process for it is
//     left (engine list and the host's process table).
//   - corrupt_test.go: one flipped byte in a snapshot's memory file (pages.img; in
//     the chunked store, in one stored chunk of it and in the local plain copy)
//     makes resume — and exec, files and proxied requests, which would resume —
//     answer 422 snapshot_corrupt naming the snapshot, the file (and the chunk); the
//     sandbox stays hibernated, other sandboxes keep working, and restoring the byte
//     makes resume work again. A damaged local copy alone is rebuilt from the chunks.
//   - restart_test.go: a server restart keeps a hibernated sandbox resumable and
//     reattaches a running one; a sandbox whose runsc process died while the server
//     was down is reported "error" and nothing of it is left on the host.
//   - crash_test.go: `torpor serve` killed with SIGKILL at random moments amid
//     creates, execs, file writes, hibernates, pauses, resumes, forks and deletes
//     on up to four sandboxes (TORPOR_CRASH_KILLS kills, default 5; `make soak`
//     50); after every restart each listed state is true on the host, nothing is
//     orphaned, acknowledged hibernates and pauses resume with their workload
//     continuing and acknowledged writes read back with their sha256.
//   - s3_faults_test.go: versitygw killed or frozen (SIGSTOP) in the middle of a
//     hibernate's upload: the hibernate answers within its bound, not durable; the
//     sandbox resumes from the local copy; the upload completes once S3 is back.
//   - diskfull_test.go: a data directory on a small tmpfs, filled: hibernate and
//     pause answer 507 insufficient_storage naming it and the sandbox runs on;
//     once space is freed they succeed.
//   - soak_test.go: the load soak (only with TORPOR_SOAK_DURATION; `make soak`):
//     many small sandboxes under a steady mix of calls, the server's resources
//     sampled for leak trends.
//   - oldagent_test.go: a snapshot taken with the oldest supported guest agent
//     (built from this repository's history; see guest/proto) resumes on a server
//     that installs the current agent: the process continues, exec, files and the
//     resume contract work through the old agent, which the host speaks at
//     protocol version 1, while a new sandbox speaks the current version.
//   - badinput_test.go: unknown ids give 404, malformed or out-of-range input gives
//     400 invalid_argument with a message, and none of it changes any state.
//   - exec_test.go: exec through the API: stdout, stderr, exit codes, stdin, env,
//     cwd, timeout (124) and a background process that outlives the call and a
//     hibernate/resume.
//   - isolation_test.go: a sandbox reaches neither another sandbox nor the host, and
//     a memory limit is enforced. With gVisor the host's memory cgroup kills the
//     whole sandbox (gVisor has no OOM killer of its own), so the sandbox must then
//     be reported "error" at once, with nothing of it left on the host.
//   - proxy_test.go: concurrent proxied requests to a hibernated sandbox all succeed
//     with a single resume, and requests sent during a hibernate are answered after
//     it.
//
// The tests above share one data directory (made in TestMain; see start), so the
// base image is prepared once per package run; each starts its own server on it,
// one at a time (none calls t.Parallel at the top level).
package e2e
