-- A sandbox's metadata: the caller's key-value pairs (a JSON object, NULL for
-- none), and whether a request that uses a hibernated sandbox resumes it
-- (true, every sandbox before this migration) or is refused until an
-- explicit resume (false).
ALTER TABLE sandboxes ADD COLUMN metadata jsonb;
ALTER TABLE sandboxes ADD COLUMN resume_on_request boolean NOT NULL DEFAULT true;
