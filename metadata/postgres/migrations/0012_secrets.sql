-- Server-wide secrets that every server sharing this database agrees on (the
-- key of the E2B surface's tokens), each written once.
CREATE TABLE secrets (
	name text COLLATE "C" NOT NULL PRIMARY KEY,
	value bytea NOT NULL,
	created_at timestamptz NOT NULL
);
