-- Nodes: the hosts whose servers use this database, with their capacity and
-- their load as of their last heartbeat (package node).
CREATE TABLE nodes (
	name text COLLATE "C" PRIMARY KEY,
	advertise text NOT NULL,
	memory_mib bigint NOT NULL,
	cpus double precision NOT NULL,
	sandboxes integer NOT NULL,
	load_memory_mib bigint NOT NULL DEFAULT 0,
	load_cpus double precision NOT NULL DEFAULT 0,
	load_sandboxes integer NOT NULL DEFAULT 0,
	draining boolean NOT NULL DEFAULT false,
	started_at timestamptz NOT NULL,
	heartbeat_at timestamptz NOT NULL
);
