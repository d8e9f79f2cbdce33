// Package agent is torpor's guest agent: a small static binary that runs as the first
// process (PID 1) inside every sandbox and answers the host over plain HTTP/1.1 on TCP
// port 49983 (Port). The host reaches it by dialling the sandbox's IP from inside the
// sandbox's network namespace; connections are kept alive and reused.
//
// Endpoints (every error answer is an apiv1.ErrorBody,
// {"error":{"code":"not_found"|"invalid_argument"|"internal","message":"…"}}):
//
//	GET  /health
//	     200 {"ok":true,"pid":<agent pid>,"started_at":"<RFC3339Nano>"}
//
//	POST /exec            body: apiv1.ExecRequest
//	     200 application/x-ndjson, one apiv1.ExecEvent per line, flushed per line:
//	       {"stream":"stdout"|"stderr","data":"<base64>"}   output, as it arrives
//	       {"exit_code":N}                                  last line
//	     The command's exit code is N; 128+sig when killed by signal sig; 124 when
//	     TimeoutS ran out (the whole process group is killed with SIGKILL and a final
//	     stderr chunk "torpor: timeout after <TimeoutS>s\n" is sent first).
//	     A command that cannot be started (not found, bad cwd, …) gives 200 and the
//	     single line {"error":"…","exit_code":127}. Background:true starts the command
//	     in its own session with stdin /dev/null and stdout+stderr appended to
//	     /tmp/torpor-bg-<pid>.log, and answers the single line {"pid":N} at once.
//	     An empty cmd is 400 invalid_argument.
//	     The call ends when the command's main process has exited: output still in the
//	     pipes is drained for at most 50 ms, so processes the command left running in
//	     the background (which may hold the pipes open) neither hang the call nor are
//	     killed by it. If the client goes away before the command exits, the command's
//	     process group is killed.
//
//	GET  /files?path=/abs/path
//	     200 application/octet-stream with Content-Length, the file's bytes;
//	     404 not_found if missing; 400 if the path is relative or a directory.
//
//	PUT  /files?path=/abs/path[&mode=0644]
//	     The body replaces the file atomically (temporary file in the same directory,
//	     fsync, rename, fsync of the directory); missing parent directories are created
//	     with mode 0755; mode is octal, default 0644. 204 on success; 400 for a relative
//	     path or a directory.
//
// Commands run with cmd[0] looked up in the command's PATH, in their own process group,
// with cwd "/" unless Cwd is given. Their environment is, from lowest to highest
// precedence: PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin,
// HOME=/root, LANG=C.UTF-8; then the sandbox env (Options.Env, by default the agent's
// own process environment, which is how the host passes the sandbox's env: it sets it
// as the agent process's environment in the OCI spec); then the request's Env.
//
// As PID 1 the agent reaps every orphaned zombie of the sandbox. A single reaper
// goroutine does all waiting (on SIGCHLD, and once a second as a safety net); processes
// the agent starts are registered with it under the same lock that is held while they
// are forked, so their exit status always reaches the exec that started them. When the
// agent is not PID 1 (unit tests) and Options.ReapAll is false, the reaper waits only
// for the processes the agent started.
//
// The agent never writes to its stdout or stderr (the host gives it /dev/null); Run logs
// to /tmp/torpor-agent.log.
package agent
