// Package proto is the protocol between torpor's host and the guest agent inside
// every sandbox (package guest/agent serves it, package guest/agentclient speaks
// it): the endpoints, the JSON shapes exchanged on them and the protocol version.
//
// # Why it is versioned
//
// The agent is the first process of a sandbox, so a hibernated sandbox keeps the
// agent it was started with inside its snapshot: resuming a snapshot brings back
// that agent, not the one the host now installs. Snapshots are kept for as long as
// their users want (perpetual standby), and the manager keeps every agent binary
// it ever installed, so a host must go on speaking to every agent version it ever
// shipped.
//
// # Versions
//
//   - Version 1: the protocol of the first agents. GET /health answers
//     {"ok","pid","started_at"}; POST /exec (ExecRequest, ndjson ExecEvent
//     lines), GET and PUT /files, POST /resume (ResumeRequest, ResumeReport), and
//     every error answer an ErrorBody. A version 1 agent reports no version: an
//     absent protocol_version means 1 (VersionOf).
//   - Version 2: the agent reports its protocol version and its build in the
//     health answer (Health.ProtocolVersion, Health.Agent), so the host learns
//     them once, when it waits for the agent to be ready, and exec keeps its
//     single round trip. Nothing else changed: every version 1 call is served
//     unchanged, with the same paths and field names.
//   - Version 3: the agent also serves E2B's envd (envd.go): the Connect
//     services process.Process and filesystem.Filesystem at their own paths
//     ("/process.Process/Start", …; Connect JSON and binary over HTTP/1.1, gRPC
//     over cleartext HTTP/2 too) and envd's plain routes under EnvdPrefix
//     (/envd/health, /envd/files, /envd/envs). A host forwarding envd requests
//     rewrites their paths with EnvdPath and must not forward them to an agent
//     below EnvdMinVersion (agentclient.Client.Envd names the error). Every
//     version 2 call is served unchanged.
//   - Version 4: POST /hibernate/prepare (PathPrepareHibernate,
//     PrepareHibernateReport): before a hibernate drains the requests in
//     flight, the host asks the agent to end its open envd streams (a
//     background command's output, a PTY, a watch), which never end on their
//     own. An older agent is not asked; its streams are drained and then cut
//     as before. envd's POST /files also keeps file metadata (X-Metadata-*
//     headers as user.e2b.* extended attributes, envd 0.6.2), which EntryInfo
//     reports; a version 3 agent ignores those headers. Every version 3 call
//     is served unchanged.
//
// # Rules
//
//   - A new version only adds: new endpoints, new optional fields. A field or
//     endpoint of an older version keeps its name, path and meaning, so a new
//     host talks to an old agent with the same requests, and an old agent ignores
//     what it does not know.
//   - A version is never removed (MinVersion is never raised) while snapshots
//     taken with an agent of that version may exist: the only way to resume one
//     is to speak its agent's version (a resumed sandbox, and every snapshot
//     taken of it later, runs the agent it was started with). Raising MinVersion
//     needs every snapshot made with an older agent to be gone.
//   - The host refuses an agent whose version is below MinVersion or above
//     Version (agentclient.ErrUnsupportedVersion) rather than guess; a call a
//     version does not serve takes that version's path or fails with an error
//     that names the call and the versions.
//   - Each version's additions are listed above. The e2e suite
//     (e2e/oldagent_test.go) builds the oldest supported agent from the
//     repository's history, hibernates a sandbox running it and resumes that
//     snapshot on a host with the current agent; a new version must keep it
//     passing.
package proto
