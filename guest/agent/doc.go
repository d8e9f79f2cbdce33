// Package agent is torpor's guest agent: a small static binary that runs as the first
// process (PID 1) inside every sandbox and answers the host over plain HTTP/1.1 on TCP
// port 49983 (Port). The host reaches it by dialling the sandbox's IP from inside the
// sandbox's network namespace; connections are kept alive and reused. The protocol,
// its types and its versions are package guest/proto; this agent speaks
// proto.Version.
//
// Endpoints (every error answer is a proto.ErrorBody,
// {"error":{"code":"not_found"|"invalid_argument"|"internal","message":"…"}}):
//
//	GET  /health
//	     200 proto.Health {"ok":true,"pid":<agent pid>,"started_at":"<RFC3339Nano>",
//	         "protocol_version":3,"agent":"torpor-agent <version> vcs.revision=…"}
//	     (protocol_version and agent since protocol version 2)
//
//	POST /exec            body: proto.ExecRequest
//	     200 application/x-ndjson, one proto.ExecEvent per line, flushed per line:
//	       {"stream":"stdout"|"stderr","data":"<base64>"}   output, as it arrives
//	       {"exit_code":N}                                  last line
//	     The command's exit code is N; 128+sig when killed by signal sig; 124 when
//	     TimeoutS ran out (the whole process group is killed with SIGKILL and a final
//	     stderr chunk "torpor: timeout after <TimeoutS>s\n" is sent first). TimeoutS
//	     counts from the request's arrival, the wait to fork included (a command
//	     that had not started by then never does; the chunk then adds "(the
//	     command had not started: …)"), and the answer does not wait for the
//	     killed process's exit status more than 500 ms.
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
//	POST /resume          body: proto.ResumeRequest
//	     {"generation":N,"forked":bool,"snapshot_id":"…","host_time":"RFC3339Nano",
//	      "hook_deadline_s":10,"ack_deadline_s":5[,"start":true]}
//	     The host calls it after every start, resume and fork, before it forwards any
//	     user request. The agent runs the resume contract's steps in this fixed order,
//	     each timed, and answers 200 with a proto.ResumeReport:
//	       1 generation  /run/torpor/generation ("N\n") and /run/torpor/resume.json
//	                     (the event below) are replaced atomically (temp + rename)
//	                     before any event is sent;
//	       2 reseed      the agent's own user-space PRNG is reseeded from getrandom and
//	                     /dev/urandom is read (gVisor's getrandom differs per clone);
//	       3 clock       skew = the sandbox's time.Now() at arrival - host_time. gVisor
//	                     refuses clock_settime (EPERM), so when |skew| > 50 ms the
//	                     correction -skew is written to /run/torpor/clock_offset_ns
//	                     (nanoseconds, decimal; SDK time helpers add it) and reported
//	                     as "offset-file"; otherwise 0 is written ("none");
//	       4 notify      the event is sent to every client of the events socket; the
//	                     step waits until each subscribed client acked it or
//	                     ack_deadline_s (default 5) passed, and names the laggards;
//	       5 hooks       every executable regular file of /etc/torpor/resume.d/, in
//	                     lexical order, in its own process group, with stdin
//	                     /dev/null, the sandbox env plus TORPOR_GENERATION,
//	                     TORPOR_FORKED=0|1 and TORPOR_SNAPSHOT_ID; one that outlives
//	                     hook_deadline_s (default 10) has its group killed (exit_code
//	                     124, timed_out). Output (stdout+stderr) is kept up to 64 KiB.
//	     ok is false when a step failed, a subscriber timed out or a hook failed or
//	     overran; the answer is 200 in every case. With "start" (first boot) the
//	     event is named "start", nobody is waited for and no hook runs.
//
// E2B's envd (protocol version 3; guest/proto's envd.go has the paths and the
// host's rewrite rule, api/e2b/envd/proto the services):
//
//	/process.Process/*         Start, Connect, List, SendInput, StreamInput,
//	                           CloseStdin, SendSignal, Update
//	/filesystem.Filesystem/*   Stat, ListDir, MakeDir, Move, Remove, WatchDir,
//	                           CreateWatcher, GetWatcherEvents, RemoveWatcher
//	GET  /envd/health          204
//	GET  /envd/files?path=&username=   the file's bytes (gzip if accepted);
//	                           404/400 {"code":<status>,"message":"…"}
//	POST /envd/files?path=&username=   octet-stream or multipart ("file"
//	                           parts, each at ?path= or its file name; gzip
//	                           bodies too): [{"path","name","type":"file"}]
//	GET  /envd/envs            the sandbox env as a JSON object
//
// The user of a call is "Authorization: Basic base64(<user>:)" (for /files,
// ?username= first), else "user"; a user missing from the sandbox's
// /etc/passwd is invalid_argument. Commands run as that user (uid, gid,
// supplementary groups) with the environment PATH/HOME/LANG defaults < the
// sandbox env < HOME, USER, LOGNAME of the user < the request's envs, in the
// user's home unless cwd is given; relative paths are taken from the home and
// "~" is the home. Files and directories are changed with the agent's rights
// (as E2B's envd does) and what a call creates is owned by its user.
//
// A process started with Start stays in the agent's process table until it
// exits, whether or not a stream follows it: closing the Start stream detaches,
// Connect (by pid or tag) re-attaches to its output from then on, and the
// output produced while nobody follows it is not kept (as E2B's envd). Each
// process leads its own process group (its own session, with the terminal as
// controlling terminal, with a pty); SendSignal signals the group. stdin: true
// or absent keeps a pipe open for SendInput/StreamInput until CloseStdin;
// false gives /dev/null. The Start call's timeout (Connect-Timeout-Ms, gRPC's
// grpc-timeout) kills the process when it passes, as E2B's envd does; no
// timeout, no kill. Quiet streams get a keepalive event every
// Keepalive-Ping-Interval seconds (default DefaultKeepalive). The end event
// reads like Go's os.ProcessState: exited with exit_code and status "exit
// status N", or exited false, exit_code -1 and status "signal: killed"; error
// is the status unless the process exited 0.
//
// The process table lives in sandbox memory, so a memory hibernate keeps it:
// after the resume List shows the processes and Connect re-attaches. The
// streams open at the checkpoint are cut: the host closes its ends when the
// sandbox exits, and the agent ends every envd stream opened before a resume
// when POST /resume announces it (their goroutines do not wait for a write to
// fail); no envd request reaches the agent before the resume contract ran,
// since the host forwards requests only after its resume returned.
//
// Events socket /run/torpor/events (unix stream, mode 0666): one JSON object per
// line. On connect the agent sends {"event":"hello","generation":N}; on every
// resume, fork or unpause {"event":"resume","kind":"restored"|"unpaused",
// "generation":N,"forked":bool,"host_time":"RFC3339Nano","snapshot_id":"…","seq":K}
// (kind "unpaused": continued from the paused tier, the same generation, the
// clocks jumped). A client that wants the
// host to wait for it writes {"subscribe":true,"name":"<free text>"} (answer
// {"event":"subscribed"}) and then answers each resume event with {"ack":K} once
// its own hooks ran. The socket and its connections live in sandbox memory, so
// they survive hibernation: a subscriber stays subscribed across resumes.
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
