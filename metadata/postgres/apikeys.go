package postgres

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/torpor/torpor/metadata"
)

const apiKeyCols = `id, name, prefix, hash, created_at, last_used_at`

func scanAPIKey(r pgx.Row) (metadata.APIKey, error) {
	var k metadata.APIKey
	if err := r.Scan(&k.ID, &k.Name, &k.Prefix, &k.Hash, &k.CreatedAt, &k.LastUsedAt); err != nil {
		return metadata.APIKey{}, err
	}
	k.CreatedAt, k.LastUsedAt = utc(k.CreatedAt), utcp(k.LastUsedAt)
	return k, nil
}

// CreateAPIKey implements metadata.Keys.
func (d *DB) CreateAPIKey(ctx context.Context, k metadata.APIKey) error {
	// DO NOTHING without a target covers the id and the hash's UNIQUE.
	tag, err := d.pool.Exec(ctx, `INSERT INTO api_keys (`+apiKeyCols+`) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING`,
		k.ID, k.Name, k.Prefix, k.Hash, k.CreatedAt, k.LastUsedAt)
	if err != nil {
		return fmt.Errorf("metadata: create api key %s: %w", k.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("api key %s: %w", k.ID, metadata.ErrExists)
	}
	return nil
}

// GetAPIKey implements metadata.Keys.
func (d *DB) GetAPIKey(ctx context.Context, id string) (metadata.APIKey, error) {
	k, err := scanAPIKey(d.pool.QueryRow(ctx, `SELECT `+apiKeyCols+` FROM api_keys WHERE id = $1`, id))
	if err != nil {
		return metadata.APIKey{}, notFound(err, "api key", id)
	}
	return k, nil
}

// APIKeyByHash implements metadata.Keys. The hash is looked up in the
// table's unique index.
func (d *DB) APIKeyByHash(ctx context.Context, hash []byte) (metadata.APIKey, error) {
	if hash == nil {
		hash = []byte{} // bytea = NULL would be no row too, but say what is meant
	}
	k, err := scanAPIKey(d.pool.QueryRow(ctx, `SELECT `+apiKeyCols+` FROM api_keys WHERE hash = $1`, hash))
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
func (d *DB) ListAPIKeys(ctx context.Context) ([]metadata.APIKey, error) {
	return queryList(ctx, d, "list api keys", `SELECT `+apiKeyCols+` FROM api_keys ORDER BY created_at, id`, scanAPIKey)
}

// TouchAPIKey implements metadata.Keys.
func (d *DB) TouchAPIKey(ctx context.Context, id string, at time.Time) error {
	tag, err := d.pool.Exec(ctx, `UPDATE api_keys SET last_used_at = $1 WHERE id = $2`, at, id)
	return updated(tag, err, "api key", id)
}

// DeleteAPIKey implements metadata.Keys.
func (d *DB) DeleteAPIKey(ctx context.Context, id string) error {
	tag, err := d.pool.Exec(ctx, `DELETE FROM api_keys WHERE id = $1`, id)
	return deleted(tag, err, "api key", id)
}
