-- The records of schema version 1 (metadata/sqlite's 0001_baseline.sql):
-- sandboxes, the generation counter, snapshots, volumes, image names. Times
-- are timestamptz (microseconds), a JSON column is jsonb, "none" is NULL;
-- ids and names sort by bytes (COLLATE "C"), as in SQLite.
CREATE TABLE sandboxes (
	id text COLLATE "C" PRIMARY KEY,
	state text NOT NULL,
	image text NOT NULL,
	image_digest text NOT NULL,
	guest_digest text NOT NULL,
	memory_mib integer NOT NULL,
	cpus double precision NOT NULL,
	env jsonb NOT NULL,
	generation bigint NOT NULL,
	forked_from text NOT NULL DEFAULT '',
	snapshot_id text NOT NULL DEFAULT '',
	pending_snapshot text NOT NULL DEFAULT '',
	instance text NOT NULL DEFAULT '',
	seq bigint NOT NULL DEFAULT 0,
	error text NOT NULL DEFAULT '',
	deleting boolean NOT NULL DEFAULT false,
	created_at timestamptz NOT NULL,
	state_changed_at timestamptz NOT NULL,
	last_hibernate_at timestamptz,
	last_resume_at timestamptz,
	resume_ms bigint NOT NULL DEFAULT 0,
	last_resume jsonb,
	idle_timeout_s integer NOT NULL DEFAULT 15,
	timeout_s integer NOT NULL DEFAULT 0,
	on_timeout text NOT NULL DEFAULT 'hibernate',
	hibernation_mode text NOT NULL DEFAULT 'memory',
	on_resume jsonb,
	volumes jsonb,
	running_ms bigint NOT NULL DEFAULT 0,
	timeout_base_ms bigint NOT NULL DEFAULT 0,
	snapshot_byte_s double precision NOT NULL DEFAULT 0,
	usage_at timestamptz,
	expires_at timestamptz
);
CREATE INDEX sandboxes_snapshot_id ON sandboxes (snapshot_id);
CREATE INDEX sandboxes_pending_snapshot ON sandboxes (pending_snapshot);
CREATE TABLE counters (name text COLLATE "C" PRIMARY KEY, value bigint NOT NULL);
INSERT INTO counters (name, value) VALUES ('generation', 0);
CREATE TABLE snapshots (
	id text COLLATE "C" PRIMARY KEY,
	sandbox_id text NOT NULL,
	parent text NOT NULL DEFAULT '',
	bytes bigint NOT NULL,
	hibernate_ms bigint NOT NULL,
	engine text NOT NULL,
	created_at timestamptz NOT NULL,
	logical_bytes bigint NOT NULL DEFAULT 0,
	stored_bytes bigint NOT NULL DEFAULT 0,
	new_bytes bigint NOT NULL DEFAULT 0
);
CREATE TABLE volumes (
	name text COLLATE "C" PRIMARY KEY,
	created_at timestamptz NOT NULL,
	copied_from text NOT NULL DEFAULT ''
);
CREATE TABLE images (
	name text COLLATE "C" PRIMARY KEY,
	digest text COLLATE "C" NOT NULL,
	bytes bigint NOT NULL DEFAULT 0,
	source text NOT NULL DEFAULT '',
	created_at timestamptz
);
CREATE INDEX images_digest ON images (digest, name);
