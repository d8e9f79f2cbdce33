// Package chunked is the deduplicating snapshot store: every snapshot file is cut
// into content-defined chunks (see chunker.go), each chunk is stored once under
// the sha256 of its content, zstd-compressed, in packs (pack.go) in a durable
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
// durable when it returns), then writes the manifest. A snapshot exists once its manifest exists;
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
// manifest references (and loose chunks no manifest references). Collect is safe against concurrent Commits in this process: every
// chunk a Commit uses is pinned in memory from before the Commit checks whether
// the chunk exists until its manifest is written, pins released while a
// collection runs stay protected until it ends, and a Commit that needs a chunk
// Collect is deleting waits for the deletion and uploads it again. Several hosts
// sharing one bucket would need a lease on top of this (not built).
package chunked
