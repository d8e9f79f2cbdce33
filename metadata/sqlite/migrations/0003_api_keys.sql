-- API keys: a key's SHA-256, never the key itself (package apikey).
CREATE TABLE api_keys (
	id TEXT PRIMARY KEY,
	name TEXT NOT NULL DEFAULT '',
	prefix TEXT NOT NULL,
	hash BLOB NOT NULL UNIQUE,
	created_at TEXT NOT NULL,
	last_used_at TEXT
);
