// Package apikey is torpor's API keys: it makes them, checks their form,
// hashes them, and checks the key a request presents against the stored
// records (metadata.Keys). REST v1 (package server) and the E2B-compatible
// API both call it; neither compares keys itself.
//
// # A key
//
// A key is "e2b_" and 40 lower-case hex digits: 160 bits from crypto/rand,
// the form E2B issues and its SDKs check before they send anything
// (`^e2b_[0-9a-f]+$`), so one key works for both APIs. Its record
// (metadata.APIKey) has a public id ("key_" and 12 hex digits), a name, the
// public prefix (the key's first 12 characters, "e2b_" and 8 hex digits, shown
// by `torpor key ls` so that a user can tell keys apart) and the key's SHA-256.
// The key itself is shown once, by Create's caller, and kept nowhere.
//
// # Why SHA-256 and not bcrypt or argon2
//
// Slow password hashes exist because passwords are guessable: whoever steals
// the hashes tries a dictionary against them, and the cost per guess is the
// only defence. A key has 160 bits from a random source and no dictionary:
// finding a key from its SHA-256 is a preimage search of 2^160 (2^128 with the
// prefix known), out of reach at any cost per guess. A fast hash loses nothing
// here, and it lets every request be checked with one hash and one indexed
// lookup instead of the work a slow hash spends per check by design.
//
// # Checking a request
//
// A Verifier answers whether a key is valid:
//
//  1. The key's form is checked first (Valid): a malformed key is refused
//     without a database read.
//  2. Its SHA-256 is looked up in the store (APIKeyByHash, a unique index),
//     on every check: there is no cache of verified keys. The record's hash
//     is then compared with the computed one in constant time
//     (crypto/subtle). The lookups are by hash, never by key: a timing
//     difference could tell at most how much of a hash matched, and choosing
//     a key whose hash starts a given way is itself a preimage search.
//  3. The record's LastUsedAt is written at most once per
//     Config.TouchInterval (1 minute) per key, so requests cost no writes.
//
// Revocation: a key removed from the store (`torpor key rm`, from any
// process, directly in the database) is refused by the next check of every
// server on that database, from the removal's commit on; new keys work at
// once. The price is one indexed read per request that presents a key.
//
// # Failed attempts
//
// Check is what a request handler calls. Every refused attempt (no key, a
// malformed, unknown or removed key) is logged with the client's address and,
// for a well-formed key, its public prefix; no other character of a presented
// key is ever logged. Refusals are counted per client address (IPv4 address,
// or IPv6 /64) in a token bucket (Config.FailureBurst refusals at once, then
// Config.FailureRate per second). Only failed attempts are throttled: a
// valid key is admitted from any address. An address whose bucket is empty
// is answered ErrLimited, with the time until its next attempt, for a
// missing or malformed key without a lookup and for a well-formed key the
// store does not hold, and is not logged again until it may try again. The buckets are bounded (Config.MaxAddresses): full
// buckets, which are the same as none, are dropped first.
//
// # Using it from an API
//
// A server has one Verifier (server.Server.Verifier), so every API on it
// shares one cache and one set of failure limits. An API wraps its handlers
// when keys are required:
//
//	h = v.Require(h, apikey.FromXAPIKey, func(w http.ResponseWriter, r *http.Request, err error) {
//		status, retryAfter, msg := apikey.Deny(err) // 401, 429 or 503; msg safe to show
//		// set Retry-After for a 429, write status and msg in the API's own error shape
//	})
//
// REST v1 reads Authorization: Bearer (FromBearer), the E2B API X-API-KEY
// (FromXAPIKey); the admitted key's record is in the request's context
// (FromContext).
//
// The client address is the connection's peer (http.Request.RemoteAddr); a
// server behind a reverse proxy sees the proxy's address (X-Forwarded-For is
// not trusted).
package apikey
