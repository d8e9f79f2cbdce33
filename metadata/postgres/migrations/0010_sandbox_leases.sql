-- Ownership: a sandbox with an instance (running, paused, or on its way)
-- is owned by one node, its lease; lease_token is the lease's fencing
-- token, one more on every new lease of the sandbox, and every write of
-- the record names the token it holds (metadata.ErrFenced otherwise).
-- snapshot_node is the node that committed the sandbox's snapshot (it may
-- keep a local copy of it). Records from before: no owner, token 0.
ALTER TABLE sandboxes ADD COLUMN owner text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN snapshot_node text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN lease_token bigint NOT NULL DEFAULT 0;
CREATE INDEX sandboxes_owner ON sandboxes (owner);
