-- A sandbox's metadata: the caller's key-value pairs (a JSON object, '' for
-- none), and whether a request that uses a hibernated sandbox resumes it
-- (1, every sandbox before this migration) or is refused until an explicit
-- resume (0).
ALTER TABLE sandboxes ADD COLUMN metadata TEXT NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN resume_on_request INTEGER NOT NULL DEFAULT 1;
