// Package chunked is the deduplicating snapshot store: every snapshot file is cut
// into content-defined chunks (see chunker.go), each chunk is stored once under
// the sha256 of its content as a zstd frame (compressed, or raw blocks for a
// chunk that looks random: rawframe.go), in packs (pack.go) in a durable
// Backend (the local filesystem, or an S3-compatible object store), and a
// manifest lists every file's chunks in order. A second hibernate of the same sandbox writes only the
// chunks that changed (a diff snapshot); forks of one template share chunks.
//
// # Layout
//
// In the backend:
//
//	packs/<p[:2]>/<p>           a pack: zstd frames of chunks; chunk id = sha256(bytes)
//	index/<p>.json              the pack's chunks: id, offset, stored length
//	chunks/<id[:2]>/<id>        a loose chunk (stores written before packs)
//	manifests/<snapshot>.json   the commit record, written last
//
// On local disk under Config.Dir:
//
//	staging/<snapshot>/   a snapshot being written by the engine
//	open/<snapshot>/      plain files of a committed snapshot, what Open returns
//	                      (runsc restore needs plain files); rebuilt from chunks
//	                      whenever missing or failing verification
//	cache/                the chunk cache (Config.CacheBytes, LRU) in front of a
//	                      remote backend
//	outbox/               snapshots committed asynchronously and not yet uploaded:
//	                      a filesystem backend with their new packs and manifests
//
// # Commit and durability
//
// Commit hashes and stores every chunk the backend does not hold yet (into
// packs), makes them durable (fsync for the filesystem backend; an S3 PUT is
// durable when it returns), then writes the manifest. A commit without a
// parent writes its packs to the filesystem backend with O_DIRECT
// (FS.PutDirect), so that its final fsync has little left to write. A snapshot exists once its manifest exists;
// a failed Commit leaves the staging directory untouched, so it can be retried.
//
// CommitAsync does the same work against the local outbox instead (chunks the
// backend already holds are not copied) and returns once the outbox is synced:
// the snapshot exists and opens from this host, but Durable reports false. A
// background upload copies the outbox's packs to the backend, then the
// manifest, then removes them from the outbox; a failure is retried from the
// outbox with exponential backoff (1 s doubling to 15 s) for as long as it takes,
// across restarts. A snapshot being uploaded reads its chunks from the outbox;
// one whose outbox copy is lost before the upload is refused by Open, naming the
// missing chunk.
//
// # Encryption at rest
//
// With Config.Key, chunks are addressed by HMAC-SHA256 under the key instead
// of their sha256 and stored sealed (AES-256-GCM), manifests are sealed, and
// a commit removes its staged plaintext instead of keeping it as the opened
// copy (seal.go). Manifests and chunks written without a key, or with an old
// key in Config.OldKeys, stay readable; one sealed with a key the store lacks
// fails with a *snapshot.KeyError.
//
// # Verification
//
// Open re-hashes every chunk of the snapshot: from open/<snapshot> when present
// (warm), otherwise while reassembling it from the cache or the backend (cold,
// four parallel fetches). A chunk that fails in the cache is dropped and fetched
// again from the backend; one that fails in the backend fails Open with a
// *snapshot.CorruptError naming the snapshot, the file and the chunk id.
//
// # Garbage collection
//
// Delete removes a manifest; Collect deletes packs none of whose chunks a live
// manifest references (and loose chunks no manifest references), and rewrites
// packs mostly unreferenced with their referenced chunks only (repack). Collect is safe against concurrent Commits in this process: every
// chunk a Commit uses is pinned in memory from before the Commit checks whether
// the chunk exists until its manifest is written, pins released while a
// collection runs stay protected until it ends, and a Commit that needs a chunk
// Collect is deleting waits for the deletion and uploads it again. Stores of
// several hosts sharing one backend also share a CollectLock (Config.CollectLock,
// collectlock.go): commits hold it shared, Collect exclusively or not at all.
//
// # Backends
//
// A Backend stores immutable objects under keys (backend.go). What a backend
// can do beyond that the store learns from optional interfaces, never from
// its concrete type: Syncer (Put is durable only after Sync: FS), Remote
// (reached over a network, possibly out of reach for a while: S3; more
// requests in flight, outages ridden out at start-up), TempCleaner (a
// crashed writer leaves temporary files: FS). A new backend implements
// Backend and those of them that apply. FS (backend.go) and S3 (s3.go) are
// the two there are; the outbox is an FS.
//
// # Files
//
//	store.go     Config, Store (its fields grouped by job), New, Close, Recover, Usage
//	manifest.go  the manifest object (doc), its checks, Manifest, List, the parsed-manifest cache
//	commit.go    Stage, Abort, Commit, CommitAsync: first and diff commits
//	deferred.go  first commits acknowledged once synced, chunked in the background (Config.DeferFirstCommits)
//	parent.go    a diff commit's match of unchanged chunks against the parent's keys
//	chunker.go   where chunks are cut, and their keys
//	pack.go      packs and their index objects; packSet, packWriter
//	index.go     the Store's index of both tiers' chunks, and the commit pins
//	open.go      Open, Verify: check the opened copy, or assemble it from the cache or backend
//	opened.go    the bound on the opened copies
//	cache.go     the chunk cache
//	gc.go        Delete, Collect, repack, the automatic collection
//	collectlock.go  the CollectLock of stores sharing a backend: commits against other hosts' collections
//	upload.go    the outbox: Durable, Pending, the background upload
//	seal.go      encryption at rest (Config.Key): keyed chunk addresses, sealed chunks and manifests
//	backend.go   Backend and its optional interfaces; the filesystem backend
//	s3.go        the S3 backend
//
// # Locks
//
// A Store's locks, in the order they may be taken: a goroutine holding one
// takes only locks further down the list (any lock may be taken alone).
//
//  0. the CollectLock (Config.CollectLock, collectlock.go): a commit or an
//     upload round takes it shared (which may wait) holding no store lock;
//     Collect takes it exclusively just after gc.mu, by a try-lock that never
//     waits. gc.cluster.mu guards its bookkeeping; it is held across a
//     pending uploads' Shared and the outbox listing, never with another
//     store lock.
//  1. gc.mu (collector, gc.go): one Collect at a time; held for the whole
//     collection, across requests to the backend.
//  2. a snapshot's lock in opening (snapshotLocks, open.go): held by Open
//     while it verifies or rebuilds open/<id>, and by trimOpened while it
//     removes that copy. No goroutine holds two snapshots' locks, nor one
//     with gc.mu.
//  3. up.mu (uploader, upload.go): an upload's manifest step against
//     Delete's; held across the requests that write and remove the two
//     manifests.
//  4. idx.loadMu (index.go): loadKnown is single-flight; held across the
//     listing of the backend, then idx.mu is taken to merge the listing in.
//  5. idx.mu (index.go): the index (known and outKnown with their packSets,
//     loaded, outGen, suspects) and the commit–Collect coordination (pins,
//     deleting, gcActive, protected, and gone/loading against listings). Never held across a request to the
//     durable backend nor while waiting (pin waits for a deletion with it
//     released); the outbox's clean-up removes local files under it.
//
// Leaf locks, taken with any of the above held or alone, and never held
// while taking another:
//
//   - gc.cluster.openMu (collectlock.go): the generation a cold open last
//     refreshed the index at; held only to read or set it.
//   - opening.mu: the map of snapshot locks and their user counts; held only
//     to update it, never while waiting for a snapshot's lock.
//   - docs.mu (docCache, manifest.go): the parsed manifests.
//   - deferred.mu (deferredSet, deferred.go): the pending first commits;
//     trimOpened reads them before it takes openCopies.mu.
//   - openCopies.mu (openedSet, opened.go): the opened copies' sizes and uses.
//   - a commit's commitState.mu and packWriter.mu (commit.go, pack.go): its
//     pinned ids and new bytes, its pack in progress. packWriter releases
//     its mu before it writes a pack (which takes idx.mu).
//   - the components' own: Cache.mu, cacheFiller.mu (cache.go); FS.syncMu,
//     then FS.mu (backend.go); S3.claimMu (s3.go). They never call back into
//     the Store.
package chunked
