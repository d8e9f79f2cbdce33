// Package columns is how the SQL metadata stores (metadata/sqlite,
// metadata/postgres) keep a sandbox record's structured fields: each one as
// JSON text in one column, with the same field names in every store, so that
// a record moved from one database to another reads back the same.
package columns

import (
	"encoding/json"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// SandboxNames are the columns of the sandboxes table in the order the
// stores write and read them: id first, version last.
var SandboxNames = []string{"id", "state", "image", "image_digest", "guest_digest", "memory_mib", "cpus", "env", "generation",
	"forked_from", "snapshot_id", "pending_snapshot", "instance", "seq", "error", "deleting", "created_at",
	"state_changed_at", "last_hibernate_at", "last_resume_at", "resume_ms", "last_resume",
	"idle_timeout_s", "timeout_s", "on_timeout", "hibernation_mode", "on_resume", "volumes",
	"running_ms", "timeout_base_ms", "snapshot_byte_s", "usage_at", "expires_at", "metadata", "resume_on_request", "version"}

// Sandbox are a sandbox record's JSON columns. Env is always set (JSON null
// for a nil map); the others are "" for none.
type Sandbox struct {
	Env        string // map of strings
	LastResume string // the guest agent's report (resumeJSON)
	OnResume   string // the command, a list of strings
	Volumes    string // [{"name", "path"}, …]
	Metadata   string // map of strings
}

// Encode returns s's JSON columns.
func Encode(s *metadata.Sandbox) Sandbox {
	var c Sandbox
	env, _ := json.Marshal(s.Env)
	c.Env = string(env)
	if s.LastResume != nil {
		b, _ := json.Marshal(toResumeJSON(s.LastResume))
		c.LastResume = string(b)
	}
	if len(s.OnResume) > 0 {
		b, _ := json.Marshal(s.OnResume)
		c.OnResume = string(b)
	}
	if len(s.Volumes) > 0 {
		b, _ := json.Marshal(volumesJSON(s.Volumes))
		c.Volumes = string(b)
	}
	if len(s.Metadata) > 0 {
		b, _ := json.Marshal(s.Metadata)
		c.Metadata = string(b)
	}
	return c
}

// Decode sets s's fields from c. A column that does not parse leaves its
// field empty: a record stays readable.
func (c Sandbox) Decode(s *metadata.Sandbox) {
	_ = json.Unmarshal([]byte(c.Env), &s.Env)
	if c.LastResume != "" {
		var rep resumeJSON
		if json.Unmarshal([]byte(c.LastResume), &rep) == nil {
			s.LastResume = rep.report()
		}
	}
	if c.OnResume != "" {
		_ = json.Unmarshal([]byte(c.OnResume), &s.OnResume)
	}
	if c.Volumes != "" {
		var vs []volumeMountJSON
		if json.Unmarshal([]byte(c.Volumes), &vs) == nil {
			for _, v := range vs {
				s.Volumes = append(s.Volumes, sandbox.VolumeMount(v))
			}
		}
	}
	if c.Metadata != "" {
		_ = json.Unmarshal([]byte(c.Metadata), &s.Metadata)
	}
}

// Policy returns the hibernation mode and timeout action a record is stored
// with: the policy's, or the defaults (memory, hibernate) for "".
func Policy(p sandbox.Policy) (mode, onTimeout string) {
	mode, onTimeout = p.HibernationMode, p.OnTimeout
	if mode == "" {
		mode = sandbox.ModeMemory
	}
	if onTimeout == "" {
		onTimeout = sandbox.OnTimeoutHibernate
	}
	return mode, onTimeout
}

// volumeMountJSON is how a sandbox.VolumeMount is stored (column volumes).
type volumeMountJSON struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

func volumesJSON(vs []sandbox.VolumeMount) []volumeMountJSON {
	out := make([]volumeMountJSON, len(vs))
	for i, v := range vs {
		out[i] = volumeMountJSON(v)
	}
	return out
}
