package sqlstore

import (
	"context"
	"fmt"
	"time"

	"github.com/torpor/torpor/metadata"
)

const nodeCols = `name, advertise, memory_mib, cpus, sandboxes, load_memory_mib, load_cpus, load_sandboxes, draining, started_at, heartbeat_at, memory_overcommit`

func scanNode(r scanner) (metadata.Node, error) {
	var n metadata.Node
	var started, beat string
	c, l := &n.Capacity, &n.Load
	if err := r.Scan(&n.Name, &n.Advertise, &c.MemoryMiB, &c.CPUs, &c.Sandboxes, &l.MemoryMiB, &l.CPUs, &l.Sandboxes,
		&n.Draining, &started, &beat, &n.MemoryOvercommit); err != nil {
		return metadata.Node{}, err
	}
	n.StartedAt, n.HeartbeatAt = parseTS(started), parseTS(beat)
	return n, nil
}

// PutNode implements metadata.Nodes.
func (st *Store) PutNode(ctx context.Context, n metadata.Node) error {
	c, l := n.Capacity, n.Load
	_, err := st.exec(ctx, st.db, `INSERT INTO nodes (`+nodeCols+`) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
		ON CONFLICT(name) DO UPDATE SET advertise = excluded.advertise, memory_mib = excluded.memory_mib, cpus = excluded.cpus,
		sandboxes = excluded.sandboxes, load_memory_mib = excluded.load_memory_mib, load_cpus = excluded.load_cpus,
		load_sandboxes = excluded.load_sandboxes, started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at,
		memory_overcommit = excluded.memory_overcommit`,
		n.Name, n.Advertise, c.MemoryMiB, c.CPUs, c.Sandboxes, l.MemoryMiB, l.CPUs, l.Sandboxes, false,
		st.ts(n.StartedAt), st.ts(n.HeartbeatAt), overcommitOf(n))
	if err != nil {
		return fmt.Errorf("metadata: put node %s: %w", n.Name, err)
	}
	return nil
}

// HeartbeatNode implements metadata.Nodes.
func (st *Store) HeartbeatNode(ctx context.Context, name string, load metadata.NodeResources, at time.Time) error {
	res, err := st.exec(ctx, st.db, `UPDATE nodes SET load_memory_mib = ?, load_cpus = ?, load_sandboxes = ?, heartbeat_at = ? WHERE name = ?`,
		load.MemoryMiB, load.CPUs, load.Sandboxes, st.ts(at), name)
	return updated(res, err, "node", name)
}

// GetNode implements metadata.Nodes.
func (st *Store) GetNode(ctx context.Context, name string) (metadata.Node, error) {
	n, err := scanNode(st.row(ctx, st.db, `SELECT `+nodeCols+` FROM nodes WHERE name = ?`, name))
	if err != nil {
		return metadata.Node{}, notFound(err, "node", name)
	}
	return n, nil
}

// ListNodes implements metadata.Nodes.
func (st *Store) ListNodes(ctx context.Context) ([]metadata.Node, error) {
	return queryList(ctx, st, "list nodes", `SELECT `+nodeCols+` FROM nodes ORDER BY name`, scanNode)
}

// SetNodeDraining implements metadata.Nodes.
func (st *Store) SetNodeDraining(ctx context.Context, name string, draining bool) error {
	res, err := st.exec(ctx, st.db, `UPDATE nodes SET draining = ? WHERE name = ?`, draining, name)
	return updated(res, err, "node", name)
}

// DeleteNode implements metadata.Nodes.
func (st *Store) DeleteNode(ctx context.Context, name string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM nodes WHERE name = ?`, name)
	return deleted(res, err, "node", name)
}

// overcommitOf is the ratio n's record stores (1 when n has none).
func overcommitOf(n metadata.Node) float64 {
	if n.MemoryOvercommit <= 0 {
		return 1
	}
	return n.MemoryOvercommit
}
