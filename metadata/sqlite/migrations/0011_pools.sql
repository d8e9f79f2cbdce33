-- Warm pools: how many restored-and-paused clones each template (an image,
-- or a snapshot marked as a template) keeps ready, and the snapshot they are
-- restored from.
CREATE TABLE pools (
	kind TEXT NOT NULL,
	name TEXT NOT NULL,
	size INTEGER NOT NULL,
	snapshot_id TEXT NOT NULL DEFAULT '',
	image_digest TEXT NOT NULL DEFAULT '',
	updated_at TEXT NOT NULL,
	PRIMARY KEY (kind, name)
);
