package sqlstore

// A sandbox record's structured fields are each JSON in one column (text in
// SQLite, jsonb in PostgreSQL), with the same field names in every
// database, so that a record moved from one database to another reads back
// the same.

import (
	"encoding/json"
	"net/netip"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// jsonColumns are a sandbox record's JSON columns. env is always set (JSON
// null for a nil map); the others are "" for none.
type jsonColumns struct {
	env        string // map of strings
	lastResume string // the guest agent's report (resumeJSON)
	onResume   string // the command, a list of strings
	volumes    string // [{"name", "path"}, …]
	metadata   string // map of strings
	network    string // the egress policy (networkJSON)
}

// encodeJSON returns s's JSON columns.
func encodeJSON(s *metadata.Sandbox) jsonColumns {
	var c jsonColumns
	env, _ := json.Marshal(s.Env)
	c.env = string(env)
	if s.LastResume != nil {
		b, _ := json.Marshal(toResumeJSON(s.LastResume))
		c.lastResume = string(b)
	}
	if len(s.OnResume) > 0 {
		b, _ := json.Marshal(s.OnResume)
		c.onResume = string(b)
	}
	if len(s.Volumes) > 0 {
		b, _ := json.Marshal(volumesJSON(s.Volumes))
		c.volumes = string(b)
	}
	if len(s.Metadata) > 0 {
		b, _ := json.Marshal(s.Metadata)
		c.metadata = string(b)
	}
	if n := s.Network; n.InternetAccess || len(n.AllowOut) > 0 || len(n.DenyOut) > 0 || n.PrivateTraffic {
		b, _ := json.Marshal(networkJSON{InternetAccess: n.InternetAccess, AllowOut: n.AllowOut, DenyOut: n.DenyOut, PrivateTraffic: n.PrivateTraffic})
		c.network = string(b)
	}
	return c
}

// decode sets s's fields from c. A column that does not parse leaves its
// field empty: a record stays readable.
func (c jsonColumns) decode(s *metadata.Sandbox) {
	_ = json.Unmarshal([]byte(c.env), &s.Env)
	if c.lastResume != "" {
		var rep resumeJSON
		if json.Unmarshal([]byte(c.lastResume), &rep) == nil {
			s.LastResume = rep.report()
		}
	}
	if c.onResume != "" {
		_ = json.Unmarshal([]byte(c.onResume), &s.OnResume)
	}
	if c.volumes != "" {
		var vs []volumeMountJSON
		if json.Unmarshal([]byte(c.volumes), &vs) == nil {
			for _, v := range vs {
				s.Volumes = append(s.Volumes, sandbox.VolumeMount(v))
			}
		}
	}
	if c.metadata != "" {
		_ = json.Unmarshal([]byte(c.metadata), &s.Metadata)
	}
	if c.network != "" {
		var n networkJSON
		if json.Unmarshal([]byte(c.network), &n) == nil {
			s.Network = sandbox.Network{InternetAccess: n.InternetAccess, AllowOut: n.AllowOut, DenyOut: n.DenyOut, PrivateTraffic: n.PrivateTraffic}
		}
	}
}

// networkJSON is how a sandbox.Network is stored (column network; none = the
// zero Network). private_traffic is left out when false: a record written
// before it existed reads as public traffic, the default.
type networkJSON struct {
	InternetAccess bool           `json:"internet_access"`
	AllowOut       []netip.Prefix `json:"allow_out,omitempty"`
	DenyOut        []netip.Prefix `json:"deny_out,omitempty"`
	PrivateTraffic bool           `json:"private_traffic,omitempty"`
}

// storedPolicy returns the hibernation mode and timeout action a record is
// stored with: the policy's, or the defaults (memory, hibernate) for "".
func storedPolicy(p sandbox.Policy) (mode, onTimeout string) {
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
