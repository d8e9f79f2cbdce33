package sqlstore

import (
	"context"
	"database/sql"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/torpor/torpor/metadata"
)

const apiKeyCols = `id, name, prefix, hash, created_at, last_used_at`

func scanAPIKey(r scanner) (metadata.APIKey, error) {
	var (
		k        metadata.APIKey
		created  string
		lastUsed sql.NullString
	)
	if err := r.Scan(&k.ID, &k.Name, &k.Prefix, &k.Hash, &created, &lastUsed); err != nil {
		return metadata.APIKey{}, err
	}
	k.CreatedAt, k.LastUsedAt = parseTS(created), parseTSp(lastUsed)
	return k, nil
}

// CreateAPIKey implements metadata.Keys.
func (st *Store) CreateAPIKey(ctx context.Context, k metadata.APIKey) error {
	// DO NOTHING without a target covers the id and the hash's UNIQUE.
	res, err := st.exec(ctx, st.db, `INSERT INTO api_keys (`+apiKeyCols+`) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING`,
		k.ID, k.Name, k.Prefix, k.Hash, st.ts(k.CreatedAt), st.tsp(k.LastUsedAt))
	if err != nil {
		return fmt.Errorf("metadata: create api key %s: %w", k.ID, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("api key %s: %w", k.ID, metadata.ErrExists)
	}
	return nil
}

// GetAPIKey implements metadata.Keys.
func (st *Store) GetAPIKey(ctx context.Context, id string) (metadata.APIKey, error) {
	k, err := scanAPIKey(st.row(ctx, st.db, `SELECT `+apiKeyCols+` FROM api_keys WHERE id = ?`, id))
	if err != nil {
		return metadata.APIKey{}, notFound(err, "api key", id)
	}
	return k, nil
}

// APIKeyByHash implements metadata.Keys. The hash is looked up in the
// table's unique index.
func (st *Store) APIKeyByHash(ctx context.Context, hash []byte) (metadata.APIKey, error) {
	k, err := scanAPIKey(st.row(ctx, st.db, `SELECT `+apiKeyCols+` FROM api_keys WHERE hash = ?`, hash))
	if err != nil {
		// The error names the hash's first bytes only: enough to tell two
		// apart in a log, nothing a key can be found from.
		short := hex.EncodeToString(hash)
		if len(short) > 8 {
			short = short[:8]
		}
		return metadata.APIKey{}, notFound(err, "api key with hash", short+"…")
	}
	return k, nil
}

// ListAPIKeys implements metadata.Keys.
func (st *Store) ListAPIKeys(ctx context.Context) ([]metadata.APIKey, error) {
	out, err := queryList(ctx, st, "list api keys", `SELECT `+apiKeyCols+` FROM api_keys`, scanAPIKey)
	oldestFirst(out, func(k metadata.APIKey) (time.Time, string) { return k.CreatedAt, k.ID })
	return out, err
}

// TouchAPIKey implements metadata.Keys.
func (st *Store) TouchAPIKey(ctx context.Context, id string, at time.Time) error {
	res, err := st.exec(ctx, st.db, `UPDATE api_keys SET last_used_at = ? WHERE id = ?`, st.ts(at), id)
	if err != nil {
		return fmt.Errorf("metadata: touch api key %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("api key %s: %w", id, metadata.ErrNotFound)
	}
	return nil
}

// DeleteAPIKey implements metadata.Keys.
func (st *Store) DeleteAPIKey(ctx context.Context, id string) error {
	res, err := st.exec(ctx, st.db, `DELETE FROM api_keys WHERE id = ?`, id)
	return deleted(res, err, "api key", id)
}
