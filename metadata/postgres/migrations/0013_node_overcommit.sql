-- Nodes register the overcommit ratio of their admission control, which
-- placement applies to their memory (node.HasRoom); records from before
-- admit their memory (1).
ALTER TABLE nodes ADD COLUMN memory_overcommit double precision NOT NULL DEFAULT 1;
