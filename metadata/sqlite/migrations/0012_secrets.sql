-- Server-wide secrets that every server sharing this database agrees on (the
-- key of the E2B surface's tokens), each written once.
CREATE TABLE secrets (
	name TEXT NOT NULL PRIMARY KEY,
	value BLOB NOT NULL,
	created_at TEXT NOT NULL
);
