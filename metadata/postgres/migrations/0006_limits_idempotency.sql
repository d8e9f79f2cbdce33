-- A sandbox's pids limit (the tasks each user may have in it); 0 for the
-- sandboxes made before limits, which have none.
ALTER TABLE sandboxes ADD COLUMN pids_limit integer NOT NULL DEFAULT 0;
-- Calls made with an Idempotency-Key: the sandbox ids they make (a JSON
-- array), chosen before they make any, and the status they answered (0 while
-- running or cut by a crash); created_ns is the time made, Unix nanoseconds.
CREATE TABLE idempotency_keys (
	key          text COLLATE "C" PRIMARY KEY,
	request_hash bytea NOT NULL,
	sandbox_ids  jsonb NOT NULL,
	status       integer NOT NULL DEFAULT 0,
	created_ns   bigint NOT NULL
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_ns);
