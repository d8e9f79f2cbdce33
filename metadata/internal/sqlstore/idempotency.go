package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/torpor/torpor/metadata"
)

// ClaimIdempotencyKey implements metadata.IdempotencyKeys: an insert that
// does nothing on a taken key, then a read of what the key holds, in one
// transaction.
func (st *Store) ClaimIdempotencyKey(ctx context.Context, r metadata.IdempotencyKey) (metadata.IdempotencyKey, bool, error) {
	ids, err := json.Marshal(r.SandboxIDs)
	if err != nil {
		return metadata.IdempotencyKey{}, false, err
	}
	tx, err := st.db.BeginTx(ctx, nil)
	if err != nil {
		return metadata.IdempotencyKey{}, false, fmt.Errorf("metadata: idempotency key: %w", err)
	}
	defer tx.Rollback()
	res, err := st.exec(ctx, tx, `INSERT INTO idempotency_keys (key, request_hash, sandbox_ids, status, created_ns, holder)
		VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO NOTHING`, r.Key, r.RequestHash, string(ids), r.Status, r.CreatedAt.UnixNano(), r.Holder)
	if err != nil {
		return metadata.IdempotencyKey{}, false, fmt.Errorf("metadata: claim idempotency key: %w", err)
	}
	n, _ := res.RowsAffected()
	var (
		got     metadata.IdempotencyKey
		idsJSON string
		created int64
	)
	err = st.row(ctx, tx, `SELECT key, request_hash, sandbox_ids, status, created_ns, holder FROM idempotency_keys WHERE key = ?`, r.Key).
		Scan(&got.Key, &got.RequestHash, &idsJSON, &got.Status, &created, &got.Holder)
	if err != nil {
		return metadata.IdempotencyKey{}, false, fmt.Errorf("metadata: read idempotency key: %w", err)
	}
	if err := json.Unmarshal([]byte(idsJSON), &got.SandboxIDs); err != nil {
		return metadata.IdempotencyKey{}, false, fmt.Errorf("metadata: idempotency key's sandbox ids %q: %w", idsJSON, err)
	}
	got.CreatedAt = time.Unix(0, created).UTC()
	if err := tx.Commit(); err != nil {
		return metadata.IdempotencyKey{}, false, fmt.Errorf("metadata: claim idempotency key: %w", err)
	}
	return got, n == 1, nil
}

// FinishIdempotencyKey implements metadata.IdempotencyKeys.
func (st *Store) FinishIdempotencyKey(ctx context.Context, key, holder string, status int) error {
	res, err := st.exec(ctx, st.db, `UPDATE idempotency_keys SET status = ? WHERE key = ? AND holder = ?`, status, key, holder)
	return updated(res, err, "idempotency key", key)
}

// TakeIdempotencyKey implements metadata.IdempotencyKeys: one conditional
// update.
func (st *Store) TakeIdempotencyKey(ctx context.Context, key, from, to string) (bool, error) {
	res, err := st.exec(ctx, st.db, `UPDATE idempotency_keys SET holder = ? WHERE key = ? AND holder = ? AND status = 0`, to, key, from)
	if err != nil {
		return false, fmt.Errorf("metadata: take idempotency key %q: %w", key, err)
	}
	if n, _ := res.RowsAffected(); n == 1 {
		return true, nil
	}
	var one int
	switch err := st.row(ctx, st.db, `SELECT 1 FROM idempotency_keys WHERE key = ?`, key).Scan(&one); {
	case errors.Is(err, sql.ErrNoRows):
		return false, fmt.Errorf("idempotency key %q: %w", key, metadata.ErrNotFound)
	case err != nil:
		return false, fmt.Errorf("metadata: take idempotency key %q: %w", key, err)
	}
	return false, nil
}

// DeleteIdempotencyKey implements metadata.IdempotencyKeys.
func (st *Store) DeleteIdempotencyKey(ctx context.Context, key, holder string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM idempotency_keys WHERE key = ? AND holder = ?`, key, holder)
	return deleted(res, err, "idempotency key", key)
}

// DeleteIdempotencyKeysBefore implements metadata.IdempotencyKeys.
func (st *Store) DeleteIdempotencyKeysBefore(ctx context.Context, t time.Time) (int, error) {
	res, err := st.exec(ctx, st.db, `DELETE FROM idempotency_keys WHERE created_ns < ?`, t.UnixNano())
	if err != nil {
		return 0, fmt.Errorf("metadata: expire idempotency keys: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return 0, err
	}
	return int(n), nil
}
