package sqlstore

import "github.com/torpor/torpor/sandbox"

// resumeJSON is how a sandbox.ResumeReport is stored (column last_resume):
// the field names rows written by earlier versions have.
type resumeJSON struct {
	Event      string     `json:"event"`
	Generation int64      `json:"generation"`
	Forked     bool       `json:"forked"`
	SnapshotID string     `json:"snapshot_id,omitempty"`
	Steps      []stepJSON `json:"steps"`
	Clock      struct {
		SkewMS    float64 `json:"skew_ms"`
		Corrected string  `json:"corrected"`
	} `json:"clock"`
	Subscribers struct {
		Total    int      `json:"total"`
		Acked    int      `json:"acked"`
		TimedOut []string `json:"timed_out"`
	} `json:"subscribers"`
	Hooks    []hookJSON `json:"hooks"`
	OK       bool       `json:"ok"`
	WindowMS float64    `json:"window_ms,omitempty"`
	AgentMS  float64    `json:"agent_ms,omitempty"`
	Error    string     `json:"error,omitempty"`
}

type stepJSON struct {
	Name   string  `json:"name"`
	MS     float64 `json:"ms"`
	OK     bool    `json:"ok"`
	Detail string  `json:"detail,omitempty"`
}

type hookJSON struct {
	Name     string  `json:"name"`
	ExitCode int     `json:"exit_code"`
	MS       float64 `json:"ms"`
	TimedOut bool    `json:"timed_out"`
	Output   string  `json:"output"`
}

func toResumeJSON(r *sandbox.ResumeReport) resumeJSON {
	j := resumeJSON{Event: r.Event, Generation: r.Generation, Forked: r.Forked, SnapshotID: r.SnapshotID,
		OK: r.OK, WindowMS: r.WindowMS, AgentMS: r.AgentMS, Error: r.Error}
	j.Clock.SkewMS, j.Clock.Corrected = r.Clock.SkewMS, r.Clock.Corrected
	j.Subscribers.Total, j.Subscribers.Acked, j.Subscribers.TimedOut = r.Subscribers.Total, r.Subscribers.Acked, r.Subscribers.TimedOut
	if r.Steps != nil { // nil and empty stay apart: the API shows null or []
		j.Steps = make([]stepJSON, len(r.Steps))
		for i, s := range r.Steps {
			j.Steps[i] = stepJSON(s)
		}
	}
	if r.Hooks != nil {
		j.Hooks = make([]hookJSON, len(r.Hooks))
		for i, h := range r.Hooks {
			j.Hooks[i] = hookJSON(h)
		}
	}
	return j
}

func (j resumeJSON) report() *sandbox.ResumeReport {
	r := &sandbox.ResumeReport{Event: j.Event, Generation: j.Generation, Forked: j.Forked, SnapshotID: j.SnapshotID,
		OK: j.OK, WindowMS: j.WindowMS, AgentMS: j.AgentMS, Error: j.Error,
		Clock:       sandbox.ResumeClock{SkewMS: j.Clock.SkewMS, Corrected: j.Clock.Corrected},
		Subscribers: sandbox.ResumeSubscribers{Total: j.Subscribers.Total, Acked: j.Subscribers.Acked, TimedOut: j.Subscribers.TimedOut}}
	if j.Steps != nil {
		r.Steps = make([]sandbox.ResumeStep, len(j.Steps))
		for i, s := range j.Steps {
			r.Steps[i] = sandbox.ResumeStep(s)
		}
	}
	if j.Hooks != nil {
		r.Hooks = make([]sandbox.ResumeHook, len(j.Hooks))
		for i, h := range j.Hooks {
			r.Hooks[i] = sandbox.ResumeHook(h)
		}
	}
	return r
}
