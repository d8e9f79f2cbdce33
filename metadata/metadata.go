// Package metadata is torpor's system of record for sandboxes, snapshots,
// volumes, image names, API keys, idempotent calls and counters: the interface
// Store and its record types. The sandbox manager writes every state change
// here before it acknowledges it.
//
// Implementations: metadata/sqlite (an embedded SQLite database in the data
// directory, the default) and metadata/postgres (a PostgreSQL database, which
// several hosts can reach). Every implementation passes the conformance suite
// metadata/storetest, and nothing in this interface depends on one database.
package metadata

import (
	"context"
	"errors"
	"time"

	"github.com/torpor/torpor/sandbox"
)

// Errors a Store returns, wrapped with the record they are about (test with
// errors.Is).
var (
	// ErrNotFound: no record with that id or name.
	ErrNotFound = errors.New("not found")
	// ErrExists: a record with that id or name exists already.
	ErrExists = errors.New("already exists")
	// ErrStale: the record's version is not the one the caller read; another
	// writer changed it since. Nothing was written. Read it again and decide
	// again.
	ErrStale = errors.New("changed by another writer since it was read")
	// ErrFenced: the write names a lease token (Sandbox.LeaseToken) older
	// than the record's: another node took the sandbox (ClaimSandbox) since
	// the writer's lease began, so the writer no longer owns it. Nothing was
	// written. The writer must stop acting on the sandbox, not retry.
	ErrFenced = errors.New("lease token is stale: another node has taken the sandbox since")
)

// Store is the metadata store. It is safe for concurrent use.
//
// Words:
//
//   - A record is one stored object: a Sandbox, a Snapshot, a Volume, an
//     image name (sandbox.Image) or a counter. Records are values: a Store
//     never keeps or changes the caller's copy except where a method says so
//     (a sandbox's Version).
//   - A sandbox record's Version counts its writes. CreateSandbox stores
//     version 1; each update names the version it read (Sandbox.Version),
//     succeeds only if the stored record still has it, stores it plus one
//     and advances the caller's Version to match. An update whose version is
//     not the stored one changes nothing and returns ErrStale: two writers
//     that read the same record cannot both write it (the second must read
//     again). The sandbox manager holds a lock per sandbox, so for it
//     ErrStale is a bug, not a retry.
//   - A sandbox record's Owner is the node that holds its instance (running,
//     paused, or being created, resumed or hibernated), "" for none (a
//     hibernated sandbox belongs to no node). LeaseToken is the fencing
//     token of the current lease: ClaimSandbox stores the record with a new
//     owner and the token one more than the stored one; every other write
//     (UpdateSandbox, BeginRestore, CommitHibernate) names the token it
//     read and fails with ErrFenced if the stored one differs. Tokens only
//     grow, per sandbox: a node that lost its lease (declared lost, its
//     sandbox taken by another) cannot write the record again.
//   - Atomic: a method that writes several records (BeginRestore,
//     CommitHibernate) writes all of them or, on any error, none.
//
// Lifecycle of a sandbox's records:
//
//	CreateSandbox            state creating, version 1
//	UpdateSandbox …          each state change, policy change, usage accrual
//	BeginRestore             a resume: the next generation and the record together
//	CommitHibernate          a hibernate: the new Snapshot record and the sandbox together
//	DeleteSandbox            the record is gone; its snapshots stay until
//	                         UnreferencedSnapshots lists them and DeleteSnapshot removes them
//
// List methods return every record of their kind in the order they name;
// an empty store gives an empty (nil) list, not an error. Errors other than
// the ones named are failures of the database itself.
//
// More record kinds join as further interfaces embedded here.
type Store interface {
	Sandboxes
	Snapshots
	Volumes
	Images
	Keys
	IdempotencyKeys
	Counters
	Nodes
	Pools
	Secrets
	// Close releases the store. Calls after Close fail.
	Close() error
}

// Secrets are server-wide secrets that every server sharing this store must
// agree on: the key the E2B surface derives its envdAccessTokens from
// (api/e2b), so that a token one node handed out is good on every node. A
// secret is written once; nothing here changes or deletes it.
type Secrets interface {
	// EnsureSecret returns the secret stored under name. When there is none it
	// first stores value (which must not be empty, nor name: an error) under it; of
	// servers racing to store one, the first wins and every caller gets the
	// value that won.
	EnsureSecret(ctx context.Context, name string, value []byte) ([]byte, error)
}

// Pools are the warm pools' settings: how many restored-and-paused clones
// each template keeps ready (manager/pool.go). A template is an image (its
// pool's SnapshotID is the snapshot torpor took of a fresh sandbox of it) or a
// snapshot marked as a template (SnapshotID is that snapshot). A snapshot a
// pool names is never in UnreferencedSnapshots.
type Pools interface {
	// SetPool records p, replacing the pool of the same Kind and Name. With
	// snap non-nil it also records that snapshot (the template snapshot made
	// for p) in the same transaction; ErrExists if its id is taken (nothing is
	// written then).
	SetPool(ctx context.Context, p Pool, snap *Snapshot) error
	// GetPool returns the pool of kind and name; ErrNotFound.
	GetPool(ctx context.Context, kind PoolKind, name string) (Pool, error)
	// ListPools returns every pool, by kind and then name.
	ListPools(ctx context.Context) ([]Pool, error)
	// DeletePool removes the pool of kind and name; ErrNotFound.
	DeletePool(ctx context.Context, kind PoolKind, name string) error
}

// PoolKind is what a pool's template is.
type PoolKind string

// Pool kinds.
const (
	PoolImage    PoolKind = "image"    // Name is an image's name
	PoolSnapshot PoolKind = "snapshot" // Name is a snapshot's id
)

// Pool is one template's warm pool setting.
type Pool struct {
	Kind PoolKind
	Name string
	// Size is how many clones to keep ready (0: none).
	Size int
	// SnapshotID is the snapshot the clones are restored from ("" for an
	// image pool whose snapshot is not made yet); ImageDigest is the image's
	// digest it was made of (image pools only: a replaced image makes a new one).
	SnapshotID  string
	ImageDigest string
	UpdatedAt   time.Time
}

// Sandboxes are the sandbox records.
type Sandboxes interface {
	// CreateSandbox stores a new record and sets s.Version to 1 and
	// s.LeaseToken to 1 when s.Owner is set (the first lease), else 0.
	// ErrExists if the id is taken.
	CreateSandbox(ctx context.Context, s *Sandbox) error
	// GetSandbox returns the record of id. ErrNotFound if there is none.
	GetSandbox(ctx context.Context, id string) (*Sandbox, error)
	// ListSandboxes returns every record, oldest first (CreatedAt, then ID).
	ListSandboxes(ctx context.Context) ([]*Sandbox, error)
	// UpdateSandbox replaces the record of s.ID with s (Owner included, the
	// lease token kept) if its stored version is s.Version and its stored
	// lease token s.LeaseToken, and advances s.Version. ErrFenced if the
	// token differs, else ErrStale if the version differs, ErrNotFound if
	// there is no such record.
	UpdateSandbox(ctx context.Context, s *Sandbox) error
	// ClaimSandbox starts a new lease: it replaces the record of s.ID with s,
	// owner s.Owner ("" fences the old owner out and leaves the sandbox to
	// none), lease token one more than the stored one, if the stored version
	// is s.Version (whatever the stored token), and advances s.Version and
	// sets s.LeaseToken. Of concurrent claims of one version exactly one
	// succeeds. ErrStale if the version differs, ErrNotFound if there is no
	// such record.
	ClaimSandbox(ctx context.Context, s *Sandbox) error
	// DeleteSandbox removes the record of id. ErrNotFound if there is none.
	DeleteSandbox(ctx context.Context, id string) error
	// BeginRestore takes the next generation (see Counters) and updates s as
	// UpdateSandbox does, atomically, and returns the generation; s itself is
	// written as given (the caller stores the generation in it later). Errors
	// as UpdateSandbox's (ErrFenced included); on error no generation is taken.
	BeginRestore(ctx context.Context, s *Sandbox) (int64, error)
	// CommitHibernate stores the new snapshot record snap and updates s as
	// UpdateSandbox does, atomically. ErrExists if snap.ID is taken; else
	// UpdateSandbox's errors.
	CommitHibernate(ctx context.Context, snap *Snapshot, s *Sandbox) error
	// SnapshotUsers returns the ids of the sandboxes whose SnapshotID or
	// PendingSnapshot is snapshotID, sorted. Unknown ids have none.
	SnapshotUsers(ctx context.Context, snapshotID string) ([]string, error)
}

// Snapshots are the snapshot records. A record is made by CommitHibernate;
// its files live in the snapshot store (package snapshot).
type Snapshots interface {
	// GetSnapshot returns the record of id. ErrNotFound if there is none.
	GetSnapshot(ctx context.Context, id string) (*Snapshot, error)
	// ListSnapshots returns every record, oldest first (CreatedAt, then ID).
	ListSnapshots(ctx context.Context) ([]*Snapshot, error)
	// SetSnapshotSizes fills in the sizes (bytes) of a record made before
	// they were kept. ErrNotFound if there is no such record.
	SetSnapshotSizes(ctx context.Context, id string, logical, stored, newBytes int64) error
	// SetSnapshotUploaded records that snapshot id is in the durable tier
	// (OutboxNode ""): its node calls it once the manifest is uploaded.
	// ErrNotFound if there is no such record.
	SetSnapshotUploaded(ctx context.Context, id string) error
	// UnreferencedSnapshots returns the ids of the records that no sandbox
	// resumes from (SnapshotID) or is writing (PendingSnapshot) and no pool
	// restores from (Pool.SnapshotID), sorted.
	UnreferencedSnapshots(ctx context.Context) ([]string, error)
	// DeleteSnapshot removes the record of id. ErrNotFound if there is none.
	DeleteSnapshot(ctx context.Context, id string) error
	// SetSnapshotKept marks the record of id kept (with name, "" for none) or,
	// with kept false, no longer kept (its name is cleared). A kept record is
	// never in UnreferencedSnapshots. ErrNotFound if there is no such record;
	// ErrExists if another record has the name.
	SetSnapshotKept(ctx context.Context, id string, kept bool, name string) error
	// SnapshotByName returns the kept record named name. ErrNotFound if there
	// is none.
	SnapshotByName(ctx context.Context, name string) (*Snapshot, error)
}

// Volumes are the named volumes' records (their data is a host directory).
type Volumes interface {
	// CreateVolume stores a new record. ErrExists if the name is taken.
	CreateVolume(ctx context.Context, v Volume) error
	// GetVolume returns the record of name. ErrNotFound if there is none.
	GetVolume(ctx context.Context, name string) (Volume, error)
	// ListVolumes returns every record, by name.
	ListVolumes(ctx context.Context) ([]Volume, error)
	// DeleteVolume removes the record of name. ErrNotFound if there is none.
	DeleteVolume(ctx context.Context, name string) error
}

// Images are the image names: each name points at one image digest, and
// several names may point at the same digest. The image files live in the
// image store (package image).
type Images interface {
	// PutImage points img.Name at img (digest, size, source, time), making
	// the name or replacing what it pointed at: the last writer wins.
	PutImage(ctx context.Context, img sandbox.Image) error
	// GetImage returns what name points at. ErrNotFound if nothing.
	GetImage(ctx context.Context, name string) (sandbox.Image, error)
	// ImageByDigest returns the first name (in name order) that points at
	// digest. ErrNotFound if none does.
	ImageByDigest(ctx context.Context, digest string) (sandbox.Image, error)
	// ListImages returns every name, by name.
	ListImages(ctx context.Context) ([]sandbox.Image, error)
}

// Keys are the API keys' records. A record holds a key's SHA-256, never the
// key: package apikey makes keys, hashes them and checks requests against
// these records (see apikey for why a fast hash is the right one).
type Keys interface {
	// CreateAPIKey stores a new record. ErrExists if its ID or its Hash is
	// taken.
	CreateAPIKey(ctx context.Context, k APIKey) error
	// GetAPIKey returns the record of id. ErrNotFound if there is none.
	GetAPIKey(ctx context.Context, id string) (APIKey, error)
	// APIKeyByHash returns the record whose Hash is hash (32 bytes). ErrNotFound
	// if there is none.
	APIKeyByHash(ctx context.Context, hash []byte) (APIKey, error)
	// ListAPIKeys returns every record, oldest first (CreatedAt, then ID).
	ListAPIKeys(ctx context.Context) ([]APIKey, error)
	// TouchAPIKey sets the record's LastUsedAt to at. ErrNotFound if there is
	// no such record. Callers bound how often they call it (package apikey:
	// once a minute per key at most).
	TouchAPIKey(ctx context.Context, id string, at time.Time) error
	// DeleteAPIKey removes the record of id. ErrNotFound if there is none.
	DeleteAPIKey(ctx context.Context, id string) error
}

// APIKey is an API key's record.
type APIKey struct {
	// ID is the key's public name, "key_" and 12 hex digits (what `torpor key
	// ls` shows and `torpor key rm` takes).
	ID   string
	Name string
	// Prefix is the key's first characters ("e2b_" and 8 hex digits), public:
	// it tells a user which key is which; it is too short to use the key.
	Prefix string
	// Hash is the SHA-256 of the whole key (32 bytes).
	Hash      []byte
	CreatedAt time.Time
	// LastUsedAt is when a request last presented the key (nil: never), to
	// the minute.
	LastUsedAt *time.Time
}

// Nodes are the records of the hosts whose torpor servers use this store
// (package node registers a server and heartbeats). A record's Name is its
// node's; a node that starts again replaces its record, keeping Draining.
type Nodes interface {
	// PutNode stores n: a new record, or in place of the record of n.Name
	// with that record's Draining kept (n.Draining is not written).
	PutNode(ctx context.Context, n Node) error
	// HeartbeatNode sets the record's Load and HeartbeatAt. ErrNotFound if
	// there is no such record.
	HeartbeatNode(ctx context.Context, name string, load NodeResources, at time.Time) error
	// GetNode returns the record of name. ErrNotFound if there is none.
	GetNode(ctx context.Context, name string) (Node, error)
	// ListNodes returns every record, by name.
	ListNodes(ctx context.Context) ([]Node, error)
	// SetNodeDraining sets the record's Draining. ErrNotFound if there is no
	// such record.
	SetNodeDraining(ctx context.Context, name string, draining bool) error
	// DeleteNode removes the record of name. ErrNotFound if there is none.
	DeleteNode(ctx context.Context, name string) error
}

// Node is a node's record.
type Node struct {
	Name string
	// Advertise is the base URL of the node's API that other nodes and
	// operators use (http://host:port).
	Advertise string
	// Capacity is what the host has for sandboxes; Load what its running and
	// paused sandboxes hold, as of HeartbeatAt.
	Capacity NodeResources
	Load     NodeResources
	// MemoryOvercommit is the ratio of Capacity.MemoryMiB the node's
	// admission control admits (node.HasRoom; 1 for records from before it
	// was registered). Load.MemoryMiB is then the memory it has committed.
	MemoryOvercommit float64
	// Draining: the node takes no new sandboxes (an operator's choice; it
	// survives the node's restart).
	Draining    bool
	StartedAt   time.Time
	HeartbeatAt time.Time
}

// NodeResources are a node's capacity or load: memory in MiB, CPUs (cores)
// and a number of sandboxes.
type NodeResources struct {
	MemoryMiB int64
	CPUs      float64
	Sandboxes int
}

// IdempotencyKeys are the records of calls made with an idempotency key (REST
// v1's create and fork, header Idempotency-Key): the ids of the sandboxes a
// call will make, stored before it makes any, then the status it answered,
// so that a retry with the same key (after a timeout, or a crash that cut the
// answer) gets the same sandboxes and never makes a second set. The caller
// removes records older than a day (DeleteIdempotencyKeysBefore).
type IdempotencyKeys interface {
	// ClaimIdempotencyKey stores r unless a record with r.Key exists, and
	// returns the record now stored under the key: r (created true) or the
	// existing one, unchanged (created false). Atomic: of concurrent claims
	// of one key exactly one creates.
	ClaimIdempotencyKey(ctx context.Context, r IdempotencyKey) (stored IdempotencyKey, created bool, err error)
	// FinishIdempotencyKey sets the Status of the record of key if its
	// Holder is holder (a server whose call was taken over meanwhile
	// changes nothing). ErrNotFound if there is no record of key held by
	// holder.
	FinishIdempotencyKey(ctx context.Context, key, holder string, status int) error
	// TakeIdempotencyKey makes to the Holder of the record of key if its
	// Holder is from and it has no Status yet (a call whose holder crashed
	// or was lost, taken over by a retry), and reports whether it did.
	// Atomic: of concurrent takes from one holder at most one succeeds.
	// ErrNotFound if there is no record of key.
	TakeIdempotencyKey(ctx context.Context, key, from, to string) (bool, error)
	// DeleteIdempotencyKey removes the record of key (a call that made
	// nothing, which a retry may run again) if its Holder is holder.
	// ErrNotFound if there is no record of key held by holder.
	DeleteIdempotencyKey(ctx context.Context, key, holder string) error
	// DeleteIdempotencyKeysBefore removes every record whose CreatedAt is
	// before t and returns how many it removed.
	DeleteIdempotencyKeysBefore(ctx context.Context, t time.Time) (int, error)
}

// IdempotencyKey is the record of a call made with an idempotency key.
type IdempotencyKey struct {
	// Key is the caller's key (1 to 255 printable ASCII characters).
	Key string
	// RequestHash is the SHA-256 of the call (method, path and body; 32
	// bytes): a retry must send the same call.
	RequestHash []byte
	// SandboxIDs are the ids of the sandboxes the call makes, in order,
	// chosen before it made any.
	SandboxIDs []string
	// Status is the HTTP status the call answered; 0 while it runs, or when
	// a crash ended it before it answered.
	Status    int
	CreatedAt time.Time
	// Holder is the server process that runs the call: "" with one server,
	// else its node's name and start time ("name@<StartedAt, Unix ms>"),
	// so that a retry on another node waits for a call that still runs
	// there and takes over one whose server is gone.
	Holder string
}

// Counters are the store-wide counters.
type Counters interface {
	// NextGeneration returns the next value of the generation counter: 1 on
	// a new store, then each call one more, never the same value twice (also
	// under concurrent calls). Every start, resume and fork takes one, so no
	// two incarnations of any sandboxes ever share a generation.
	NextGeneration(ctx context.Context) (int64, error)
}

// Sandbox is a sandbox's record.
type Sandbox struct {
	ID string
	// Version counts the record's writes (see Store).
	Version     int64
	State       sandbox.State
	Image       string
	ImageDigest string
	GuestDigest string
	MemoryMiB   int
	CPUs        float64
	Env         map[string]string
	// PidsLimit is the sandbox's pids limit (sandbox.Sandbox.PidsLimit); 0 =
	// none (records from before pids limits).
	PidsLimit  int
	Generation int64
	ForkedFrom string
	// SnapshotID is the latest committed snapshot this sandbox resumes from ("" if
	// none). A clone starts with its source's snapshot here.
	SnapshotID string
	// PendingSnapshot is the id of a snapshot being written while State is
	// hibernating, so a restart can tell whether the commit happened.
	PendingSnapshot string
	// Owner is the node that holds the sandbox's instance ("" for none);
	// LeaseToken the fencing token of its lease (see Store). SnapshotNode is
	// the node that committed SnapshotID ("" if unknown), which may keep a
	// local copy of it.
	Owner        string
	LeaseToken   int64
	SnapshotNode string
	// Instance is the engine instance id while the sandbox runs; Seq counts launches.
	Instance string
	Seq      int64
	Error    string
	// Deleting is set (and persisted) before a delete starts stopping things.
	Deleting        bool
	CreatedAt       time.Time
	StateChangedAt  time.Time
	LastHibernateAt *time.Time
	LastResumeAt    *time.Time
	ResumeMS        int64
	// Metadata is the caller's key-value pairs (sandbox.Spec.Metadata); nil = none.
	Metadata map[string]string
	// Policy is the sandbox's lifecycle policies; Meter its metered usage.
	sandbox.Policy
	Meter
	// LastResume is the guest agent's report of the last start, resume or fork.
	LastResume *sandbox.ResumeReport
}

// Meter is a sandbox record's metered usage: RunningMS is the running time
// accrued up to UsageAt, SnapshotByteS the snapshot storage accrued up to
// UsageAt in byte-seconds, TimeoutBaseMS RunningMS at the start of the current
// timeout period.
type Meter struct {
	RunningMS     int64
	SnapshotByteS float64
	UsageAt       time.Time
	TimeoutBaseMS int64
}

// Snapshot is a snapshot's record (its manifest lives in the snapshot store).
type Snapshot struct {
	ID        string
	SandboxID string
	// Parent is the snapshot this one follows ("" for none).
	Parent      string
	Bytes       int64
	HibernateMS int64
	Engine      string
	CreatedAt   time.Time
	// LogicalBytes, StoredBytes and NewBytes are the manifest's sizes (a plain
	// store: all equal to Bytes); 0 in records made before they were kept.
	LogicalBytes int64
	StoredBytes  int64
	NewBytes     int64
	// Kept and Name: see sandbox.Snapshot (SetSnapshotKept sets them).
	Kept bool
	Name string
	// OutboxNode is the node whose upload outbox holds the snapshot while its
	// bytes are on their way to the durable tier (an asynchronous commit, or
	// a synchronous one that fell back to it); "" once its manifest is there
	// (SetSnapshotUploaded), for a synchronous commit and for records from
	// before version 15.
	OutboxNode string
}

// Volume is a named volume's record.
type Volume struct {
	Name       string
	CreatedAt  time.Time
	CopiedFrom string
	// Node is the name of the node whose data directory holds the volume
	// (the node that created it): sandboxes that mount it start and resume
	// only there. "" on a record from before nodes were recorded (version
	// 14): such a volume is on whichever node serves, as with one node.
	Node string
}
