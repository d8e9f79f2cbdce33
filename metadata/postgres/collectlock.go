package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"
)

// collectLockKey is the first key of the snapshot store's collection lock
// ("tgc0" in ASCII); the second is the hash of the store id.
const collectLockKey = 0x74676330

// CollectLock is the snapshot store's garbage-collection lock in the
// database (snapshot/chunked.CollectLock): a session advisory lock on
// (collectLockKey, hashtext(store id)), taken shared by commits and
// exclusively, never waiting, by a collection. Each hold is a dedicated
// connection from the pool, returned (or discarded, if the unlock failed)
// on release.
type CollectLock struct {
	db      *sql.DB
	storeID string
}

// CollectLock returns the collection lock of the snapshot store storeID
// (the data directories' store-id, the same on every node of one bucket
// prefix).
func (d *DB) CollectLock(storeID string) *CollectLock {
	return &CollectLock{db: d.sql, storeID: storeID}
}

// Shared takes the lock shared (pg_advisory_lock_shared), waiting while a
// collection holds it exclusively or until ctx ends. Errors: no connection,
// or the query failed (the lock is then not held).
func (l *CollectLock) Shared(ctx context.Context) (release func(), held func(context.Context) error, err error) {
	conn, err := l.db.Conn(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("metadata: collection lock: %w", err)
	}
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock_shared($1, hashtext($2))`, int32(collectLockKey), l.storeID); err != nil {
		discard(conn) // a cancelled wait may still be granted on that session
		return nil, nil, fmt.Errorf("metadata: collection lock: %w", err)
	}
	return l.releaser(conn, `SELECT pg_advisory_unlock_shared($1, hashtext($2))`), l.checker(conn, "ShareLock"), nil
}

// TryExclusive takes the lock exclusively if nobody holds it
// (pg_try_advisory_lock): ok is false at once when a commit holds it shared.
func (l *CollectLock) TryExclusive(ctx context.Context) (release func(), held func(context.Context) error, ok bool, err error) {
	conn, err := l.db.Conn(ctx)
	if err != nil {
		return nil, nil, false, fmt.Errorf("metadata: collection lock: %w", err)
	}
	if err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock($1, hashtext($2))`, int32(collectLockKey), l.storeID).Scan(&ok); err != nil {
		discard(conn)
		return nil, nil, false, fmt.Errorf("metadata: collection lock: %w", err)
	}
	if !ok {
		conn.Close()
		return nil, nil, false, nil
	}
	return l.releaser(conn, `SELECT pg_advisory_unlock($1, hashtext($2))`), l.checker(conn, "ExclusiveLock"), true, nil
}

// releaser unlocks on conn and returns it to the pool; a connection whose
// unlock failed is discarded (closing the session releases its locks).
func (l *CollectLock) releaser(conn *sql.Conn, unlock string) func() {
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := conn.ExecContext(ctx, unlock, int32(collectLockKey), l.storeID); err != nil {
			discard(conn)
			return
		}
		conn.Close()
	}
}

// checker returns a check that conn's session still holds the lock in mode.
func (l *CollectLock) checker(conn *sql.Conn, mode string) func(context.Context) error {
	return func(ctx context.Context) error {
		var ok bool
		err := conn.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks
			WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND classid = $1 AND objid = hashtext($2)::oid
				AND objsubid = 2 AND mode = $3 AND granted)`, int64(collectLockKey), l.storeID, mode).Scan(&ok)
		if err != nil {
			return fmt.Errorf("metadata: collection lock: %w", err)
		}
		if !ok {
			return errors.New("metadata: collection lock: no longer held by its session")
		}
		return nil
	}
}

// discard closes conn's session instead of returning it to the pool.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	conn.Close()
}
