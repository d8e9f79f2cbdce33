package sandbox

import "time"

// Snapshot describes one committed snapshot.
type Snapshot struct {
	ID string
	// SandboxID is the sandbox that was hibernated into it.
	SandboxID string
	// Bytes is the total size of the snapshot's files.
	Bytes int64
	// HibernateMS is how long the hibernate took.
	HibernateMS int64
	// Parent is the snapshot this one follows (its sandbox's previous one, or
	// the one a fork resumed from); nil for a sandbox's first. Lineage: the
	// parent may have been collected since.
	Parent    *string
	Engine    string
	CreatedAt time.Time
	// LogicalBytes is the size as the engine wrote it; StoredBytes the stored
	// (compressed, deduplicated) size of the chunks it references; NewBytes the
	// stored bytes this snapshot added. A plain-file store reports all three
	// equal to Bytes.
	LogicalBytes int64
	StoredBytes  int64
	NewBytes     int64
	// DedupRatio is LogicalBytes / StoredBytes (0 when unknown).
	DedupRatio float64
	// Durable is true once every byte is in the store's durable tier.
	Durable bool
	// ExpiresAt is the owning sandbox's ExpiresAt (nil = never).
	ExpiresAt *time.Time
	// UsedBy lists the sandboxes that resume from this snapshot.
	UsedBy []string
}

// KeptSnapshot is a snapshot taken to be kept: a sandbox's saved state that
// new sandboxes start from (E2B's snapshots). It stays until it is deleted as
// such, whether or not a sandbox still resumes from it or its sandbox still
// exists. Name is its optional name, unique among kept snapshots ("" = none).
type KeptSnapshot struct {
	Snapshot
	Name string
}

// StoreUsage is the snapshot store's footprint, in bytes.
type StoreUsage struct {
	// Kind is the store: "chunked", "s3" or "plain" (filled in by whoever knows
	// how the store was opened).
	Kind string
	// Snapshots counts the committed snapshots; LogicalBytes sums their sizes
	// as the engine wrote them.
	Snapshots    int
	LogicalBytes int64
	// StoredBytes is what the durable tier holds (a plain store: its files).
	StoredBytes int64
	// DedupRatio is LogicalBytes / StoredBytes (0 when nothing is stored).
	DedupRatio float64
	// ChunkBytes is the compressed size of the distinct chunks in the durable
	// tier; Chunks and Packs count them and their pack objects.
	ChunkBytes int64
	Chunks     int
	Packs      int
	// PendingUploadBytes waits in the local outbox for an asynchronous upload.
	PendingUploadBytes int64
	// LocalBytes is what this host keeps besides the durable tier.
	LocalBytes int64
}

// VerifyResult is the result of a successful snapshot verification: every one
// of Files files, Bytes bytes in all, matched its hashes.
type VerifyResult struct {
	OK    bool
	Files int
	Bytes int64
}
