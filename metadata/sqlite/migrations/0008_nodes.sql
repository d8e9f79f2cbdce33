-- Nodes: the hosts whose servers use this database, with their capacity and
-- their load as of their last heartbeat (package node).
CREATE TABLE nodes (
	name TEXT PRIMARY KEY,
	advertise TEXT NOT NULL,
	memory_mib INTEGER NOT NULL,
	cpus REAL NOT NULL,
	sandboxes INTEGER NOT NULL,
	load_memory_mib INTEGER NOT NULL DEFAULT 0,
	load_cpus REAL NOT NULL DEFAULT 0,
	load_sandboxes INTEGER NOT NULL DEFAULT 0,
	draining INTEGER NOT NULL DEFAULT 0,
	started_at TEXT NOT NULL,
	heartbeat_at TEXT NOT NULL
);
