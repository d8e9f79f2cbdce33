-- The schema as the last release before numbered migrations left it. A
-- database of that era has these tables already (Open first adds the columns
-- an older one may lack), so every statement here leaves an existing table
-- as it is.
CREATE TABLE IF NOT EXISTS sandboxes (
	id TEXT PRIMARY KEY,
	state TEXT NOT NULL,
	image TEXT NOT NULL,
	image_digest TEXT NOT NULL,
	guest_digest TEXT NOT NULL,
	memory_mib INTEGER NOT NULL,
	cpus REAL NOT NULL,
	env TEXT NOT NULL,
	generation INTEGER NOT NULL,
	forked_from TEXT NOT NULL DEFAULT '',
	snapshot_id TEXT NOT NULL DEFAULT '',
	pending_snapshot TEXT NOT NULL DEFAULT '',
	instance TEXT NOT NULL DEFAULT '',
	seq INTEGER NOT NULL DEFAULT 0,
	error TEXT NOT NULL DEFAULT '',
	deleting INTEGER NOT NULL DEFAULT 0,
	created_at TEXT NOT NULL,
	state_changed_at TEXT NOT NULL,
	last_hibernate_at TEXT,
	last_resume_at TEXT,
	resume_ms INTEGER NOT NULL DEFAULT 0,
	last_resume TEXT NOT NULL DEFAULT '',
	idle_timeout_s INTEGER NOT NULL DEFAULT 15,
	timeout_s INTEGER NOT NULL DEFAULT 0,
	on_timeout TEXT NOT NULL DEFAULT 'hibernate',
	hibernation_mode TEXT NOT NULL DEFAULT 'memory',
	on_resume TEXT NOT NULL DEFAULT '',
	volumes TEXT NOT NULL DEFAULT '',
	running_ms INTEGER NOT NULL DEFAULT 0,
	timeout_base_ms INTEGER NOT NULL DEFAULT 0,
	snapshot_byte_s REAL NOT NULL DEFAULT 0,
	usage_at TEXT NOT NULL DEFAULT '',
	expires_at TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (name, value) VALUES ('generation', 0);
CREATE TABLE IF NOT EXISTS snapshots (
	id TEXT PRIMARY KEY,
	sandbox_id TEXT NOT NULL,
	parent TEXT NOT NULL DEFAULT '',
	bytes INTEGER NOT NULL,
	hibernate_ms INTEGER NOT NULL,
	engine TEXT NOT NULL,
	created_at TEXT NOT NULL,
	logical_bytes INTEGER NOT NULL DEFAULT 0,
	stored_bytes INTEGER NOT NULL DEFAULT 0,
	new_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS volumes (
	name TEXT PRIMARY KEY,
	created_at TEXT NOT NULL,
	copied_from TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS images (
	name TEXT PRIMARY KEY,
	digest TEXT NOT NULL,
	bytes INTEGER,
	source TEXT,
	created_at TEXT
);
