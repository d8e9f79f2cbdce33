-- API keys: a key's SHA-256, never the key itself (package apikey).
CREATE TABLE api_keys (
	id text COLLATE "C" PRIMARY KEY,
	name text NOT NULL DEFAULT '',
	prefix text NOT NULL,
	hash bytea NOT NULL UNIQUE,
	created_at timestamptz NOT NULL,
	last_used_at timestamptz
);
