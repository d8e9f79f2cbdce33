// Package workload is torpor's reference workload: a Python HTTP server inside a
// sandbox that holds a request counter and a block of random data in memory. The
// quickstart, the resume benchmark and the end-to-end tests all run it, so they
// measure and check the same thing: a long-running process that continues where
// it stopped after hibernate and resume.
package workload

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
)

//go:embed server.py
var script []byte

// Port is the port the server listens on inside the sandbox.
const Port = 8080

// ScriptPath is where Start writes the server inside the sandbox.
const ScriptPath = "/opt/torpor-workload/server.py"

// State is what the server answers: its counter, pid and (for /checksum) the
// sha256 of its data.
type State struct {
	Count  int64  `json:"count"`
	Pid    int    `json:"pid"`
	SHA256 string `json:"sha256,omitempty"`
	Bytes  int64  `json:"bytes,omitempty"`
}

// Start writes the server into sandbox id, starts it in the background holding
// mib MiB of random data, and waits (up to 60 s) until it answers through the
// port proxy, or until ctx ends.
func Start(ctx context.Context, c *client.Client, id string, mib int) error {
	if err := c.WriteFile(ctx, id, ScriptPath, bytes.NewReader(script)); err != nil {
		return fmt.Errorf("workload: write script: %w", err)
	}
	_, err := c.ExecBackground(ctx, id, apiv1.ExecRequest{
		Cmd: []string{"python3", ScriptPath, fmt.Sprint(Port), fmt.Sprint(mib)},
	})
	if err != nil {
		return fmt.Errorf("workload: start: %w", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := Get(ctx, c, id, "/count"); err == nil {
			return nil
		} else if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("workload: server in %s did not answer: %w", id, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Get sends GET path to the server through the port proxy (which resumes a
// hibernated sandbox) and decodes its answer.
func Get(ctx context.Context, c *client.Client, id, path string) (State, error) {
	var st State
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.PortURL(id, Port, path), nil)
	if err != nil {
		return st, err
	}
	c.Authorize(req)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("workload: GET %s: HTTP %d: %s", path, resp.StatusCode, bytes.TrimSpace(b))
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("workload: GET %s: %w", path, err)
	}
	return st, nil
}

// Script returns the server's source, as Start writes it to ScriptPath.
func Script() []byte { return bytes.Clone(script) }
