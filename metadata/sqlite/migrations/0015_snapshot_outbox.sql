-- A snapshot committed to its node's upload outbox (asynchronously, or a
-- synchronous commit that fell back to it) records that node until its
-- manifest is in the durable tier: another node can then tell a snapshot
-- still on its way to the bucket from one that is gone. '' = durable (and
-- every record from before).
ALTER TABLE snapshots ADD COLUMN outbox_node TEXT NOT NULL DEFAULT '';
