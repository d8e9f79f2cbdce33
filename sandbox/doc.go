// Package sandbox is torpor's domain model: the sandboxes, snapshots, volumes,
// images, policies and resume reports that the sandbox manager (package
// manager), the metadata store (package metadata) and every API surface share,
// and the typed error (Error) the manager returns.
//
// Nothing here knows about a wire format. The REST API v1 (package apiv1 and
// package server) maps these types to its JSON bodies and Error's Kind to HTTP
// statuses; another surface maps them its own way. Type and constant names
// follow apiv1's where the two correspond (Sandbox, StateRunning, ModeMemory,
// ResumeReport, ExecRequest …), so code moves between them by changing the
// package qualifier.
//
// Units are in the field names: …MiB (mebibytes), …S (seconds), …MS
// (milliseconds), …Bytes. Times are UTC.
package sandbox
