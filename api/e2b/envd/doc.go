// Package envd is the in-sandbox half of torpor's E2B-compatible API: the services of
// E2B's sandbox daemon (envd) that E2B's SDKs call on port 49983 (api/e2b.EnvdPort)
// with the Connect protocol.
//
//   - proto/process/process.proto: process.Process (Start, Connect, List, SendInput,
//     StreamInput, SendSignal, CloseStdin, Update).
//   - proto/filesystem/filesystem.proto: filesystem.Filesystem (Stat, MakeDir, Move,
//     ListDir, Remove, WatchDir, CreateWatcher, GetWatcherEvents, RemoveWatcher).
//   - gen/: the Go code protoc-gen-go and protoc-gen-connect-go generate from them
//     (`make proto`); a connect-go handler built from gen/*connect serves the Connect
//     protocol with the JSON codec (what the SDKs use), the binary codec, gRPC and
//     gRPC-Web from one http.Handler.
//
// Names and field numbers are E2B's, so that the SDKs' JSON and binary messages
// decode into these types; the tests check them against the descriptors the npm SDK
// embeds and against the SDK itself. torpor's guest agent serves them (package
// guest/agent, protocol version 3); docs/e2b.md describes how.
package envd
