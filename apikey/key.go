package apikey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
	"unicode"

	"github.com/torpor/torpor/metadata"
)

const (
	// KeyPrefix starts every key.
	KeyPrefix = "e2b_"
	// keyHexLen is the number of hex digits after KeyPrefix (160 bits).
	keyHexLen = 40
	// prefixHexLen is the number of hex digits of the public prefix.
	prefixHexLen = 8
	// idPrefix starts every key's id; idHexLen hex digits follow.
	idPrefix = "key_"
	idHexLen = 12
	// MaxNameLen bounds a key's name (bytes).
	MaxNameLen = 100
)

// Generate returns a new key: KeyPrefix and 40 lower-case hex digits, 160 bits
// from crypto/rand. Errors: the system's random source failed.
func Generate() (string, error) { return randomHex(KeyPrefix, keyHexLen) }

// randomHex returns prefix and n hex digits from crypto/rand.
func randomHex(prefix string, n int) (string, error) {
	b := make([]byte, n/2)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("apikey: random source: %w", err)
	}
	return prefix + hex.EncodeToString(b), nil
}

// Valid reports whether key has the form Generate makes: KeyPrefix and exactly
// 40 lower-case hex digits. (E2B's SDKs accept any number of digits; torpor
// issues 40 and refuses other lengths without looking them up.)
func Valid(key string) bool {
	if len(key) != len(KeyPrefix)+keyHexLen || key[:len(KeyPrefix)] != KeyPrefix {
		return false
	}
	for _, c := range key[len(KeyPrefix):] {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Hash returns the SHA-256 of key (32 bytes), what a record keeps.
func Hash(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// PublicPrefix returns key's public prefix, KeyPrefix and its first 8 hex
// digits (e.g. "e2b_3f9a1c2b"), or "" if key is not Valid: nothing of a
// malformed key (which may be some other secret pasted by mistake) is ever
// shown.
func PublicPrefix(key string) string {
	if !Valid(key) {
		return ""
	}
	return key[:len(KeyPrefix)+prefixHexLen]
}

// newID returns a new key id: "key_" and 12 hex digits.
func newID() (string, error) { return randomHex(idPrefix, idHexLen) }

// ValidName reports whether name can name a key: at most MaxNameLen bytes of
// printable characters ("" is allowed).
func ValidName(name string) bool {
	if len(name) > MaxNameLen {
		return false
	}
	for _, r := range name {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// Create makes a new key named name, stores its record in keys (created at
// now) and returns the key and the record. The key is returned this once: the
// store keeps its hash. Errors: a name ValidName refuses, the random source,
// the store (an id taken twice in a row, which 48 random bits make
// vanishingly rare, is retried).
func Create(ctx context.Context, keys metadata.Keys, name string, now time.Time) (string, metadata.APIKey, error) {
	if !ValidName(name) {
		return "", metadata.APIKey{}, fmt.Errorf("apikey: name %q: at most %d printable characters", name, MaxNameLen)
	}
	for attempt := 0; ; attempt++ {
		key, err := Generate()
		if err != nil {
			return "", metadata.APIKey{}, err
		}
		id, err := newID()
		if err != nil {
			return "", metadata.APIKey{}, err
		}
		rec := metadata.APIKey{ID: id, Name: name, Prefix: PublicPrefix(key), Hash: Hash(key), CreatedAt: now.UTC()}
		err = keys.CreateAPIKey(ctx, rec)
		if errors.Is(err, metadata.ErrExists) && attempt < 3 {
			continue
		}
		if err != nil {
			return "", metadata.APIKey{}, fmt.Errorf("apikey: store the new key: %w", err)
		}
		return key, rec, nil
	}
}
