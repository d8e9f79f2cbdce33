-- Kept snapshots: taken to be kept (new sandboxes start from them) and never
-- collected as unreferenced; an optional name, unique among kept snapshots.
ALTER TABLE snapshots ADD COLUMN kept INTEGER NOT NULL DEFAULT 0;
ALTER TABLE snapshots ADD COLUMN name TEXT NOT NULL DEFAULT '';
CREATE UNIQUE INDEX snapshots_name ON snapshots (name) WHERE name != '';
