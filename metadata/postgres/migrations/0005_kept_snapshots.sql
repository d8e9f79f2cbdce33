-- Kept snapshots: taken to be kept (new sandboxes start from them) and never
-- collected as unreferenced; an optional name, unique among kept snapshots.
ALTER TABLE snapshots ADD COLUMN kept boolean NOT NULL DEFAULT false;
ALTER TABLE snapshots ADD COLUMN name text NOT NULL DEFAULT '';
CREATE UNIQUE INDEX snapshots_name ON snapshots (name) WHERE name <> '';
