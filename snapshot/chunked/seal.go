package chunked

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"os"
	"strings"
	"sync"

	"github.com/torpor/torpor/snapshot"
)

// Encryption at rest. With a Key (Config.Key), everything the store writes to
// its backend or outbox that holds a sandbox's bytes or names is sealed with
// AES-256-GCM before it leaves the process:
//
//   - A chunk's address is HMAC-SHA256(addrKey, plaintext) instead of its
//     sha256, so the address does not give away the plaintext's hash (whoever
//     knows a candidate content cannot check it against the store without the
//     key). Its stored bytes are
//
//     "TPS1" | key id (8 bytes) | nonce (12) | AES-256-GCM(subkey, nonce, zstd(plaintext), aad = address)
//
//     with subkey = HMAC-SHA256(chunkKey, address): one key per distinct
//     chunk, derived from the key and the content alone. The nonce is random:
//     a chunk is sealed again only when it is stored again (a repair of a
//     damaged copy, two commits storing it at once), and the compressor need
//     not give the same bytes twice, so a fixed nonce could meet two
//     plaintexts under one subkey. Encryption is convergent: equal chunks
//     under one key have one address, stored once, which keeps deduplication
//     (diff snapshots, forks) and shows whoever reads the store which chunks
//     are equal — not what they hold. Different keys give unrelated addresses.
//   - A manifest (sandbox spec and environment, file names, chunk addresses)
//     is the JSON object sealedDoc: its key id in clear, then
//     AES-256-GCM(manifestKey, random nonce, zstd(the plain manifest), aad =
//     "torpor manifest " + snapshot id), so a manifest moved to another id
//     fails too.
//   - Pack indexes stay plain: they list keyed addresses, offsets and lengths,
//     which the packs show anyway; loading them needs no key, so a store
//     started with the wrong key still knows its packs and never takes them for
//     garbage.
//
// The subkeys come from the 32-byte key by HKDF-SHA256 with distinct labels;
// the key id is the first 8 bytes of HMAC-SHA256(key, label), in hex.

// KeyBytes is the length of a snapshot encryption key.
const KeyBytes = 32

// Key is a snapshot encryption key with its derived subkeys. Immutable.
type Key struct {
	id       string // 16 hex digits
	idRaw    []byte // 8 bytes
	addrKey  []byte
	chunkKey []byte
	manifest cipher.AEAD
	macs     sync.Pool // *hmac of addrKey
}

// NewKey derives a Key from raw, which must be KeyBytes long.
func NewKey(raw []byte) (*Key, error) {
	if len(raw) != KeyBytes {
		return nil, fmt.Errorf("snapshot key: %d bytes, want %d", len(raw), KeyBytes)
	}
	derive := func(label string) []byte {
		b, err := hkdf.Key(sha256.New, raw, nil, "torpor snapshot "+label, 32)
		if err != nil {
			panic(err) // only for lengths hkdf cannot give
		}
		return b
	}
	m := hmac.New(sha256.New, raw)
	m.Write([]byte("torpor snapshot key id"))
	k := &Key{idRaw: m.Sum(nil)[:8], addrKey: derive("chunk address"), chunkKey: derive("chunk key")}
	k.id = hex.EncodeToString(k.idRaw)
	blk, err := aes.NewCipher(derive("manifest"))
	if err != nil {
		return nil, err
	}
	if k.manifest, err = cipher.NewGCM(blk); err != nil {
		return nil, err
	}
	k.macs.New = func() any { return hmac.New(sha256.New, k.addrKey) }
	return k, nil
}

// ParseKey reads a key file's content: the KeyBytes raw bytes (head -c 32
// /dev/urandom), or them in hex (64 digits) or standard base64, with
// surrounding white space.
func ParseKey(b []byte) (*Key, error) {
	if len(b) == KeyBytes {
		return NewKey(b)
	}
	t := strings.TrimSpace(string(b))
	if raw, err := hex.DecodeString(t); err == nil && len(raw) == KeyBytes {
		return NewKey(raw)
	}
	if raw, err := base64.StdEncoding.DecodeString(t); err == nil && len(raw) == KeyBytes {
		return NewKey(raw)
	}
	return nil, fmt.Errorf("snapshot key: want %d bytes, raw or in hex or base64 (%d bytes read)", KeyBytes, len(b))
}

// LoadKey reads a key file (ParseKey). A file that its group or others may
// read or write is refused: the key opens every snapshot.
func LoadKey(path string) (*Key, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("snapshot key %s: not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("snapshot key %s: mode %04o lets others read or change it; make it readable by its owner only (chmod 600 %s)", path, perm, path)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	k, err := ParseKey(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return k, nil
}

// ID is the key's id: 16 hex digits, safe to show (it is recorded beside
// every sealed manifest and chunk).
func (k *Key) ID() string { return k.id }

// address is the chunk address of data under k: its sha256 without a key,
// HMAC-SHA256(addrKey, data) with one (64 hex digits either way).
func (k *Key) address(data []byte) string {
	if k == nil {
		return sha256Hex(data)
	}
	m := k.macs.Get().(hash.Hash)
	m.Reset()
	m.Write(data)
	var sum [sha256.Size]byte
	out := hex.EncodeToString(m.Sum(sum[:0]))
	k.macs.Put(m)
	return out
}

// chunkMagic starts a sealed chunk; a plain one is a zstd frame (28 b5 2f fd).
var chunkMagic = []byte("TPS1")

// A sealed chunk's header: magic [0,4), key id [4,nonceAt), nonce
// [nonceAt,sealedChunkHeader).
const (
	nonceAt           = 4 + 8
	sealedChunkHeader = nonceAt + 12
)

// chunkAEAD is the AEAD of the chunk at addr (its subkey).
func (k *Key) chunkAEAD(addr []byte) cipher.AEAD {
	m := hmac.New(sha256.New, k.chunkKey)
	m.Write(addr)
	blk, err := aes.NewCipher(m.Sum(nil))
	if err != nil {
		panic(err) // a 32-byte key is always valid
	}
	g, err := cipher.NewGCM(blk)
	if err != nil {
		panic(err)
	}
	return g
}

// sealChunk returns the stored form of a chunk at address addr whose
// compressed bytes are z.
func (k *Key) sealChunk(addr string, z []byte) []byte {
	raw, _ := hex.DecodeString(addr)
	out := make([]byte, sealedChunkHeader, sealedChunkHeader+len(z)+16)
	copy(out, chunkMagic)
	copy(out[4:nonceAt], k.idRaw)
	nonce := out[nonceAt:sealedChunkHeader]
	_, _ = rand.Read(nonce)
	return k.chunkAEAD(raw).Seal(out, nonce, z, raw)
}

// sealed reports whether stored chunk bytes are sealed, and by which key id.
func sealedChunk(comp []byte) (keyID string, ok bool) {
	if len(comp) < sealedChunkHeader+16 || !bytes.Equal(comp[:4], chunkMagic) {
		return "", false
	}
	return hex.EncodeToString(comp[4:nonceAt]), true
}

// unsealChunk returns the compressed bytes of a stored chunk at address
// addr: comp itself when it is not sealed, else comp opened with the key it
// names. The returned key is that key (nil: not sealed). Errors name what
// failed, for a CorruptError's reason.
func (s *Store) unsealChunk(comp []byte, addr string) ([]byte, *Key, error) {
	kid, ok := sealedChunk(comp)
	if !ok {
		return comp, nil, nil
	}
	k := s.keys[kid]
	if k == nil {
		return nil, nil, fmt.Errorf("sealed with key %s, which this store does not have", kid)
	}
	raw, err := hex.DecodeString(addr)
	if err != nil {
		return nil, nil, fmt.Errorf("bad address")
	}
	z, err := k.chunkAEAD(raw).Open(nil, comp[nonceAt:sealedChunkHeader], comp[sealedChunkHeader:], raw)
	if err != nil {
		return nil, nil, errors.New("authentication failed (tampered or damaged)")
	}
	return z, k, nil
}

// sealedDoc is the stored form of a manifest written with a key. Its
// encoding starts with sealedDocPrefix (json.Marshal keeps field order), by
// which readers tell it from a plain doc ({"format":1,…}).
type sealedDoc struct {
	Format int    `json:"format"` // 2
	KeyID  string `json:"key_id"`
	Alg    string `json:"alg"`
	Sealed []byte `json:"sealed"` // nonce | AES-256-GCM(zstd(plain doc JSON))
}

var sealedDocPrefix = []byte(`{"format":2,`)

func manifestAAD(id string) []byte { return []byte("torpor manifest " + id) }

// marshalDoc is the stored form of snapshot id's doc: plain JSON, or sealed
// with the doc's key (the key its chunks are addressed under).
func (s *Store) marshalDoc(id string, d doc) ([]byte, error) {
	b, err := json.Marshal(d)
	if err != nil || d.key == nil {
		return b, err
	}
	g := d.key.manifest
	nonce := make([]byte, g.NonceSize(), g.NonceSize()+len(b)/2)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	z := s.enc.EncodeAll(b, nil)
	return json.Marshal(sealedDoc{Format: 2, KeyID: d.key.id, Alg: "AES-256-GCM",
		Sealed: g.Seal(nonce, nonce, z, manifestAAD(id))})
}

// unmarshalDoc parses snapshot id's stored manifest b (plain or sealed) and
// checks it. Errors: *snapshot.KeyError (sealed with a key this store lacks),
// *snapshot.CorruptError naming manifest.json.
func (s *Store) unmarshalDoc(id string, b []byte) (doc, error) {
	var d doc
	var key *Key
	if bytes.HasPrefix(b, sealedDocPrefix) {
		var sd sealedDoc
		if err := json.Unmarshal(b, &sd); err != nil {
			return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: err.Error()}
		}
		if key = s.keys[sd.KeyID]; key == nil {
			return d, &snapshot.KeyError{Snapshot: id, KeyID: sd.KeyID, Have: s.KeyID()}
		}
		g := key.manifest
		if len(sd.Sealed) < g.NonceSize() {
			return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "sealed manifest truncated"}
		}
		z, err := g.Open(nil, sd.Sealed[:g.NonceSize()], sd.Sealed[g.NonceSize():], manifestAAD(id))
		if err != nil {
			return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "authentication failed (tampered, damaged or another snapshot's)"}
		}
		if b, err = s.dec.DecodeAll(z, nil); err != nil {
			return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: "undecodable: " + err.Error()}
		}
	}
	if err := json.Unmarshal(b, &d); err != nil {
		return d, &snapshot.CorruptError{Snapshot: id, File: "manifest.json", Reason: err.Error()}
	}
	d.key = key
	return d, checkDoc(id, d)
}

// KeyID is the id of the key new snapshots are sealed with, "" without one.
func (s *Store) KeyID() string {
	if s.key == nil {
		return ""
	}
	return s.key.id
}
