package sqlstore

import (
	"context"
	"fmt"
	"time"
)

// EnsureSecret implements metadata.Secrets: an INSERT that does nothing when
// the name is taken, then a read of what the table holds, so that racing
// servers all read the row that won.
func (st *Store) EnsureSecret(ctx context.Context, name string, value []byte) ([]byte, error) {
	if name == "" || len(value) == 0 {
		return nil, fmt.Errorf("secret %q: a name and a value are needed", name)
	}
	if _, err := st.exec(ctx, st.db, `INSERT INTO secrets (name, value, created_at) VALUES (?, ?, ?) ON CONFLICT(name) DO NOTHING`,
		name, value, st.ts(time.Now().UTC())); err != nil {
		return nil, fmt.Errorf("metadata: store secret %s: %w", name, err)
	}
	var got []byte
	if err := st.row(ctx, st.db, `SELECT value FROM secrets WHERE name = ?`, name).Scan(&got); err != nil {
		return nil, fmt.Errorf("metadata: read secret %s: %w", name, err)
	}
	return got, nil
}
