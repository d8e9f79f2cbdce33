-- Warm pools: how many restored-and-paused clones each template (an image,
-- or a snapshot marked as a template) keeps ready, and the snapshot they are
-- restored from.
CREATE TABLE pools (
	kind text COLLATE "C" NOT NULL,
	name text COLLATE "C" NOT NULL,
	size integer NOT NULL,
	snapshot_id text NOT NULL DEFAULT '',
	image_digest text NOT NULL DEFAULT '',
	updated_at timestamptz NOT NULL,
	PRIMARY KEY (kind, name)
);
