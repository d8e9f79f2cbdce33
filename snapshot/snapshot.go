// Package snapshot defines torpor's snapshot store: where the bytes of a hibernated
// sandbox end up, and how they are proven intact before a resume.
//
// # Lifecycle
//
//	Stage(id)          -> an empty directory; the engine writes its checkpoint there
//	Commit(id, m)      -> every file is hashed (sha256) and synced, the manifest is
//	                      written (temporary file, fsync, rename) and the snapshot is
//	                      durable; only now may a sandbox be reported hibernated
//	Abort(id)          -> a staged snapshot that will not be committed is removed
//	Open(id)           -> every file is checked against the manifest; a directory
//	                      with the verified files is returned for the engine's restore
//	Delete(id)         -> the snapshot is gone
//
// A snapshot exists once, and only once, its manifest is committed: a crash during
// Stage or Commit leaves at most a staging directory that Open never returns and the
// next start removes (Store.Recover).
//
// # Words
//
// id names a snapshot ("snap-…"); file names are the engine's (gVisor writes
// checkpoint.img, pages_meta.img and pages.img); a manifest is the JSON record of a
// snapshot: the sandbox spec it restores to, its image digest, engine and version,
// sizes and the sha256 of every file, and its parent snapshot.
package snapshot

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"time"
)

// File is one file of a snapshot.
type File struct {
	Name   string `json:"name"`
	Bytes  int64  `json:"bytes"`
	SHA256 string `json:"sha256"` // lowercase hex
	// BlockBytes and Blocks, when set, are the sha256 of every BlockBytes-long
	// block of the file (the last one shorter), so a store can verify a large file
	// on several cores at once.
	BlockBytes int64    `json:"block_bytes,omitempty"`
	Blocks     []string `json:"blocks,omitempty"`
	// BlockXXH3, when set, are the XXH3-128 sums (32 hex digits) of the same
	// BlockBytes-long blocks: what a resume checks (see BlockSums). Manifests
	// written before it have Blocks only.
	BlockXXH3 []string `json:"block_xxh3,omitempty"`
}

// SandboxSpec is what a snapshot restores to: enough to start the sandbox again.
type SandboxSpec struct {
	Image       string            `json:"image"`
	ImageDigest string            `json:"image_digest"`
	MemoryMiB   int               `json:"memory_mib"`
	CPUs        float64           `json:"cpus"`
	Env         map[string]string `json:"env,omitempty"`
	// GuestDigest is the sha256 of the guest agent binary the sandbox runs; the
	// restore mounts the same binary.
	GuestDigest string `json:"guest_digest"`
}

// Manifest describes one committed snapshot.
type Manifest struct {
	ID            string      `json:"id"`
	SandboxID     string      `json:"sandbox_id"`
	Parent        string      `json:"parent,omitempty"`
	Engine        string      `json:"engine"`
	EngineVersion string      `json:"engine_version"`
	Spec          SandboxSpec `json:"spec"`
	Files         []File      `json:"files"`
	// Bytes is the sum of the files' sizes in bytes.
	Bytes int64 `json:"bytes"`
	// HibernateMS is how long the capture took, in ms (set by the caller).
	HibernateMS int64     `json:"hibernate_ms"`
	CreatedAt   time.Time `json:"created_at"`

	// Set by deduplicating stores (snapshot/chunked); zero for plain-file stores.
	// LogicalBytes is the snapshot's size as the engine wrote it; StoredBytes the
	// stored (compressed) size of the distinct chunks it references; NewBytes the
	// stored bytes this snapshot added (chunks no earlier snapshot had); Chunks
	// the number of chunks in its files.
	LogicalBytes int64 `json:"logical_bytes,omitempty"`
	StoredBytes  int64 `json:"stored_bytes,omitempty"`
	NewBytes     int64 `json:"new_bytes,omitempty"`
	Chunks       int   `json:"chunks,omitempty"`
}

// Store keeps snapshots. Implementations are safe for concurrent use on
// different ids.
type Store interface {
	// Stage creates an empty directory for snapshot id and returns its absolute
	// path. It fails if id is already staged or committed.
	Stage(ctx context.Context, id string) (dir string, err error)
	// Commit makes a staged snapshot durable. m's ID must be id; Commit fills in
	// Files and Bytes and returns the stored manifest.
	Commit(ctx context.Context, id string, m Manifest) (Manifest, error)
	// Abort removes a staged, uncommitted snapshot. Unknown ids are not an error.
	Abort(ctx context.Context, id string) error
	// Open verifies every file of a committed snapshot and returns the directory
	// that holds them. Errors: ErrNotFound (wrapped) when id is not committed;
	// *CorruptError when a file is missing, has the wrong size or the wrong sha256.
	// The files in dir are never written or truncated in place afterwards: a
	// store may remove them (an engine that opened them before reads on), so
	// an engine may keep reading them after its restore returned.
	Open(ctx context.Context, id string) (dir string, m Manifest, err error)
	// Manifest returns a committed snapshot's manifest without verifying its files.
	Manifest(ctx context.Context, id string) (Manifest, error)
	// Delete removes a committed or staged snapshot. Unknown ids are not an error.
	Delete(ctx context.Context, id string) error
	// List returns the ids of all committed snapshots.
	List(ctx context.Context) ([]string, error)
	// Recover removes what crashed Stage/Commit calls left behind; call it once at
	// start-up, before any Stage.
	Recover(ctx context.Context) error
}

// Releaser is a Store told when the restores that an Open returned a
// directory to are done with it (their engine has opened the files), so that
// it may remove the directory at once: snapshot/chunked does so with an
// encryption key, since the files are plain text of a sandbox's memory. Every
// successful Open is followed by one Release of its id, after the last
// restore from it returned (or failed); Opens of one id may overlap, and the
// directory stays until the last is released.
type Releaser interface {
	Release(id string)
}

// Streamer is a Store that can open a snapshot for a restore before its
// bytes are on this host: OpenStream returns a directory whose files read as
// the snapshot's, each read blocking until its bytes are fetched and verified
// (snapshot/chunked serves it through FUSE). Where it cannot stream (a local
// copy exists, the store encrypts, FUSE is unavailable) it opens as Open
// does, with Streaming false. Errors are Open's.
type Streamer interface {
	OpenStream(ctx context.Context, id string) (Streamed, error)
}

// Streamed is what OpenStream opened.
type Streamed struct {
	// Dir is the directory to restore from (absolute).
	Dir      string
	Manifest Manifest
	// Streaming is true when Dir is served while it is fetched.
	Streaming bool
	// Resumed tells the store the restored sandbox answered: the reads of
	// the memory file until now are its working set, recorded with the
	// snapshot so that the next streamed resume of it (or of a child
	// snapshot) fetches those bytes first. Call it at most once; never nil.
	Resumed func()
	// Release tells the store the restores from Dir have returned (as
	// Releaser.Release after an Open); call it once. Never nil.
	Release func()
}

// DeferredCommitter is a Store whose Commit may return a provisional manifest:
// snapshot/chunked acknowledges a first commit once its files are synced and
// stores its chunks after (Config.DeferFirstCommits). The snapshot is durable
// on this host and opens at once either way; only the manifest's sizes
// (StoredBytes, NewBytes, Chunks) and the files' SHA256 change.
type DeferredCommitter interface {
	// OnCommitted sets f to be called with the final manifest of every commit
	// that returned a provisional one, once, from a background goroutine.
	OnCommitted(f func(m Manifest))
}

// AsyncStore is a Store that can also commit a snapshot before its bytes reach
// the durable tier (snapshot/chunked with an outbox in front of its backend).
type AsyncStore interface {
	Store
	// CommitAsync commits a staged snapshot locally: every file is hashed and
	// the new bytes and the manifest are synced to local disk, so the snapshot
	// exists, is listed and can be opened from this host at once. A background
	// upload then moves it to the durable tier, retrying with backoff from the
	// local copy until it succeeds; Durable reports when it has.
	CommitAsync(ctx context.Context, id string, m Manifest) (Manifest, error)
	// Durable reports whether every byte of snapshot id, which the caller knows
	// is committed, is in the durable tier: false only while it waits for its
	// upload. It reads local state only (no request to the durable tier), so
	// listings stay fast and work while that tier is unreachable.
	Durable(ctx context.Context, id string) (bool, error)
	// OnUploaded sets f to be called with the id of every snapshot whose
	// upload has ended (Durable turned true: its manifest, the commit's last
	// object, is in the durable tier), once per snapshot, from the upload's
	// goroutine.
	OnUploaded(f func(id string))
}

// Usage is a store's footprint in bytes, from its own bookkeeping and a walk of
// its local directories (no request to a remote durable tier).
type Usage struct {
	// StoredBytes is what the durable tier holds for the snapshots: pack
	// objects and loose chunks (compressed; until the next garbage collection
	// also chunks no snapshot uses any more), or a plain store's files, and
	// the files of commits not chunked yet (snapshot/chunked's deferred
	// first commits).
	StoredBytes int64
	// ChunkBytes is the compressed size of the distinct chunks the store knows
	// in its durable tier; Chunks and Packs count them (0 for a plain store).
	ChunkBytes    int64
	Chunks, Packs int
	// PendingUploadBytes is what waits in the local outbox for an asynchronous
	// upload (snapshots that report durable false).
	PendingUploadBytes int64
	// LocalBytes is what this host keeps on disk besides the durable tier:
	// opened copies of snapshots (uncompressed, one per snapshot committed or
	// resumed here and still live), the chunk cache, the outbox and staging.
	LocalBytes int64
}

// UsageReporter is a store that reports its footprint. Errors: reading its
// local directories.
type UsageReporter interface {
	Usage(ctx context.Context) (Usage, error)
}

// DirBytes returns the apparent size in bytes of the regular files under dir
// (0 if dir does not exist). Files removed during the walk are skipped.
func DirBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		n += info.Size()
		return nil
	})
	return n, err
}

// ErrLockUnavailable is wrapped by a commit's error when the lock that keeps
// other stores' garbage collection away from commits (snapshot/chunked's
// collection lock, held in the shared database) could not be taken: the
// database did not answer. The staged files are kept; a later commit works.
var ErrLockUnavailable = errors.New("the database that holds it does not answer")

// ErrUnavailable is wrapped by errors of a store whose durable tier did not
// answer (an S3 server down or hung): trying again later may succeed.
var ErrUnavailable = errors.New("durable tier unreachable")

// ErrNotFound is wrapped by errors for snapshots that do not exist.
var ErrNotFound = errors.New("snapshot not found")

// Verifier is a store that checks a whole committed snapshot, every byte,
// against the durable hashes its manifest records (snapshot/local: each file's
// sha256; snapshot/chunked: each chunk from the durable backend), without
// preparing it for a restore. Errors: ErrNotFound; *CorruptError naming the
// file (and chunk); read errors.
type Verifier interface {
	Verify(ctx context.Context, id string) (Manifest, error)
}

// CorruptError says which snapshot file failed verification and why.
type CorruptError struct {
	Snapshot string
	File     string
	Reason   string // "missing", "size 12 != 34", "sha256 mismatch: want …, got …"
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("snapshot %s failed its integrity check (corrupt or incomplete): file %s: %s", e.Snapshot, e.File, e.Reason)
}

// KeyError says that a snapshot is encrypted with a key the store was not
// given: nothing of it can be read, and nothing was changed. KeyID is the
// id of the key it was sealed with; Have the id of the store's current key
// ("" when no key is configured).
type KeyError struct {
	Snapshot string
	KeyID    string
	Have     string
}

func (e *KeyError) Error() string {
	if e.Have == "" {
		return fmt.Sprintf("snapshot %s is encrypted (key %s) and no key is configured", e.Snapshot, e.KeyID)
	}
	return fmt.Sprintf("snapshot %s was encrypted with key %s, this server has key %s", e.Snapshot, e.KeyID, e.Have)
}
