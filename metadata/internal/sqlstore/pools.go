package sqlstore

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/torpor/torpor/metadata"
)

const poolCols = `kind, name, size, snapshot_id, image_digest, updated_at`

func scanPool(r scanner) (metadata.Pool, error) {
	var p metadata.Pool
	var kind, updated string
	if err := r.Scan(&kind, &p.Name, &p.Size, &p.SnapshotID, &p.ImageDigest, &updated); err != nil {
		return metadata.Pool{}, err
	}
	p.Kind, p.UpdatedAt = metadata.PoolKind(kind), parseTS(updated)
	return p, nil
}

// SetPool implements metadata.Pools.
func (st *Store) SetPool(ctx context.Context, p metadata.Pool, snap *metadata.Snapshot) error {
	return st.inTx(ctx, "set pool "+string(p.Kind)+" "+p.Name, func(tx *sql.Tx) error {
		if snap != nil {
			res, err := st.exec(ctx, tx, `INSERT INTO snapshots (`+snapshotCols+`) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO NOTHING`,
				snap.ID, snap.SandboxID, snap.Parent, snap.Bytes, snap.HibernateMS, snap.Engine, st.ts(snap.CreatedAt),
				snap.LogicalBytes, snap.StoredBytes, snap.NewBytes, snap.Kept, snapName(snap), snap.OutboxNode)
			if err != nil {
				return fmt.Errorf("metadata: put snapshot %s: %w", snap.ID, err)
			}
			if n, _ := res.RowsAffected(); n == 0 {
				return fmt.Errorf("snapshot %s: %w", snap.ID, metadata.ErrExists)
			}
		}
		_, err := st.exec(ctx, tx, `INSERT INTO pools (`+poolCols+`) VALUES (?, ?, ?, ?, ?, ?)
			ON CONFLICT(kind, name) DO UPDATE SET size = excluded.size, snapshot_id = excluded.snapshot_id,
			image_digest = excluded.image_digest, updated_at = excluded.updated_at`,
			string(p.Kind), p.Name, p.Size, p.SnapshotID, p.ImageDigest, st.ts(p.UpdatedAt))
		if err != nil {
			return fmt.Errorf("metadata: set pool %s %s: %w", p.Kind, p.Name, err)
		}
		return nil
	})
}

// GetPool implements metadata.Pools.
func (st *Store) GetPool(ctx context.Context, kind metadata.PoolKind, name string) (metadata.Pool, error) {
	p, err := scanPool(st.row(ctx, st.db, `SELECT `+poolCols+` FROM pools WHERE kind = ? AND name = ?`, string(kind), name))
	if err != nil {
		return metadata.Pool{}, notFound(err, "pool", string(kind)+" "+name)
	}
	return p, nil
}

// ListPools implements metadata.Pools.
func (st *Store) ListPools(ctx context.Context) ([]metadata.Pool, error) {
	return queryList(ctx, st, "list pools", `SELECT `+poolCols+` FROM pools ORDER BY kind, name`, scanPool)
}

// DeletePool implements metadata.Pools.
func (st *Store) DeletePool(ctx context.Context, kind metadata.PoolKind, name string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM pools WHERE kind = ? AND name = ?`, string(kind), name)
	return deleted(res, err, "pool", string(kind)+" "+name)
}
