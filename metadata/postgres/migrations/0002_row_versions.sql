-- Every sandbox record carries a version; an update names the version it read
-- and fails if another writer changed the row since (metadata.ErrStale).
ALTER TABLE sandboxes ADD COLUMN version bigint NOT NULL DEFAULT 1;
