package resume

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/torpor/torpor/internal/atomicfile"
)

// Intent is an external action recorded before it was made.
type Intent struct {
	// Key is the idempotency key: send it with the action and reuse it on every
	// retry. It comes from crypto/rand (the kernel), never from a user-space
	// generator a clone could share.
	Key  string          `json:"key"`
	Tool string          `json:"tool"`
	Args json.RawMessage `json:"args,omitempty"`
	// ForkSafe intents stay pending in a clone; the others are moved aside there.
	ForkSafe bool      `json:"fork_safe"`
	BegunAt  time.Time `json:"begun_at"`
	// Outcome and CompletedAt are set once Complete recorded the outcome.
	Outcome     json.RawMessage `json:"outcome,omitempty"`
	CompletedAt *time.Time      `json:"completed_at,omitempty"`
}

// Done reports whether the intent's outcome was recorded.
func (i Intent) Done() bool { return i.CompletedAt != nil }

// record is one line of the journal file.
type record struct {
	Type        string          `json:"type"` // "intent" or "outcome"
	Key         string          `json:"key"`
	Tool        string          `json:"tool,omitempty"`
	Args        json.RawMessage `json:"args,omitempty"`
	ForkSafe    bool            `json:"fork_safe,omitempty"`
	BegunAt     *time.Time      `json:"begun_at,omitempty"`
	Outcome     json.RawMessage `json:"outcome,omitempty"`
	CompletedAt *time.Time      `json:"completed_at,omitempty"`
}

// IntentOption modifies Begin.
type IntentOption func(*Intent)

// ForkSafe marks an intent as safe to retry from a clone too (e.g. an
// idempotent read or an action scoped to the clone). Without it, a clone never
// sees the intent as pending.
func ForkSafe() IntentOption { return func(i *Intent) { i.ForkSafe = true } }

// Journal is an intent journal: a JSON-lines file where every intent is appended
// and fsynced before the action and its outcome after. It survives a crash (or a
// hibernation that is never resumed in the same place) between the two: reopen
// it and Pending lists what needs reconciling. One process at a time may use a
// journal file.
type Journal struct {
	path string
	reg  *Registry

	mu      sync.Mutex
	f       *os.File
	order   []string
	intents map[string]*Intent
}

// ErrUnknownIntent is returned by Complete for a key the journal does not hold.
var ErrUnknownIntent = errors.New("resume: unknown intent key")

// OpenJournal opens (creating if needed) the journal at path and registers it
// with the default registry, so that in a clone its fork-unsafe pending intents
// are moved aside. A torn last line (a crash mid-append) is dropped.
func OpenJournal(path string) (*Journal, error) { return openJournal(path, Default) }

// OpenJournal opens a journal registered with r.
func (r *Registry) OpenJournal(path string) (*Journal, error) { return openJournal(path, r) }

func openJournal(path string, reg *Registry) (*Journal, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	_, statErr := os.Stat(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if os.IsNotExist(statErr) {
		if err := atomicfile.SyncDir(filepath.Dir(path)); err != nil {
			f.Close()
			return nil, err
		}
	}
	j := &Journal{path: path, reg: reg, f: f, intents: map[string]*Intent{}}
	if err := j.load(); err != nil {
		f.Close()
		return nil, err
	}
	if reg != nil {
		reg.addJournal(j)
	}
	return j, nil
}

// load reads the file, rebuilding the state; a torn or undecodable last line is
// truncated away.
func (j *Journal) load() error {
	data, err := io.ReadAll(j.f)
	if err != nil {
		return err
	}
	good := 0
	for off := 0; off < len(data); {
		nl := bytes.IndexByte(data[off:], '\n')
		last := nl < 0
		end := len(data)
		if !last {
			end = off + nl
		}
		line := bytes.TrimSpace(data[off:end])
		next := end + 1
		if last {
			next = len(data)
		}
		if len(line) > 0 {
			var rec record
			if err := json.Unmarshal(line, &rec); err != nil || rec.Key == "" {
				if last || len(bytes.TrimSpace(data[next:])) == 0 {
					break // torn tail
				}
				return fmt.Errorf("resume: journal %s: bad record at byte %d: %v", j.path, off, err)
			}
			if last {
				break // complete JSON but no newline: the append never finished
			}
			j.apply(rec)
		}
		off = next
		good = next
	}
	if good < len(data) {
		if err := j.f.Truncate(int64(good)); err != nil {
			return err
		}
		if err := j.f.Sync(); err != nil {
			return err
		}
	}
	_, err = j.f.Seek(0, io.SeekEnd)
	return err
}

func (j *Journal) apply(rec record) {
	switch rec.Type {
	case "intent":
		if _, ok := j.intents[rec.Key]; ok {
			return
		}
		in := &Intent{Key: rec.Key, Tool: rec.Tool, Args: rec.Args, ForkSafe: rec.ForkSafe}
		if rec.BegunAt != nil {
			in.BegunAt = *rec.BegunAt
		}
		j.intents[rec.Key] = in
		j.order = append(j.order, rec.Key)
	case "outcome":
		if in, ok := j.intents[rec.Key]; ok {
			in.Outcome = rec.Outcome
			in.CompletedAt = rec.CompletedAt
			if in.CompletedAt == nil {
				t := time.Time{}
				in.CompletedAt = &t
			}
		}
	}
}

// Path returns the journal file's path.
func (j *Journal) Path() string { return j.path }

// NewKey returns a fresh idempotency key from crypto/rand.
func NewKey() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "idem-" + hex.EncodeToString(b[:]), nil
}

// Begin records the intent to call tool with args (anything encoding/json can
// encode) and returns it with a new idempotency key. The record is on disk
// (fsynced) when Begin returns: make the action only after that, sending the
// key with it.
func (j *Journal) Begin(tool string, args any, opts ...IntentOption) (Intent, error) {
	key, err := NewKey()
	if err != nil {
		return Intent{}, err
	}
	raw, err := json.Marshal(args)
	if err != nil {
		return Intent{}, fmt.Errorf("resume: intent args: %w", err)
	}
	in := Intent{Key: key, Tool: tool, Args: raw, BegunAt: Now().UTC()}
	for _, o := range opts {
		o(&in)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return Intent{}, errors.New("resume: journal closed")
	}
	if err := j.append(record{Type: "intent", Key: in.Key, Tool: in.Tool, Args: in.Args, ForkSafe: in.ForkSafe, BegunAt: &in.BegunAt}); err != nil {
		return Intent{}, err
	}
	cp := in
	j.intents[in.Key] = &cp
	j.order = append(j.order, in.Key)
	return in, nil
}

// Complete records the outcome (anything encoding/json can encode) of the
// intent with key. Completing an intent twice keeps the first outcome.
func (j *Journal) Complete(key string, outcome any) error {
	raw, err := json.Marshal(outcome)
	if err != nil {
		return fmt.Errorf("resume: intent outcome: %w", err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return errors.New("resume: journal closed")
	}
	in, ok := j.intents[key]
	if !ok {
		return fmt.Errorf("%w %q in %s", ErrUnknownIntent, key, j.path)
	}
	if in.Done() {
		return nil
	}
	now := Now().UTC()
	if err := j.append(record{Type: "outcome", Key: key, Outcome: raw, CompletedAt: &now}); err != nil {
		return err
	}
	in.Outcome, in.CompletedAt = raw, &now
	return nil
}

// Pending returns the intents without an outcome, oldest first. After a resume
// (or a restart) each must be reconciled: ask the external system, or retry with
// the same Key — never with a new one.
func (j *Journal) Pending() []Intent {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []Intent
	for _, k := range j.order {
		if in := j.intents[k]; !in.Done() {
			out = append(out, *in)
		}
	}
	return out
}

// Get returns the intent with key.
func (j *Journal) Get(key string) (Intent, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return Intent{}, false
	}
	return *in, true
}

// MoveAsideForFork is what the runtime does in a clone of generation gen: the
// pending intents not marked fork-safe are written to <path>.forked-<gen> and
// removed from the journal (which is rewritten atomically), so the clone never
// retries an action its parent owns. It returns the intents moved.
func (j *Journal) MoveAsideForFork(gen int64) ([]Intent, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil, nil
	}
	var moved []Intent
	var keep []string
	for _, k := range j.order {
		in := j.intents[k]
		if !in.Done() && !in.ForkSafe {
			moved = append(moved, *in)
		} else {
			keep = append(keep, k)
		}
	}
	if len(moved) == 0 {
		return nil, nil
	}
	var aside bytes.Buffer
	for _, in := range moved {
		b, _ := json.Marshal(intentRecord(in))
		aside.Write(append(b, '\n'))
	}
	asidePath := fmt.Sprintf("%s.forked-%d", j.path, gen)
	if err := writeFileSync(asidePath, aside.Bytes(), true); err != nil {
		return nil, err
	}
	var rest bytes.Buffer
	for _, k := range keep {
		in := j.intents[k]
		b, _ := json.Marshal(intentRecord(*in))
		rest.Write(append(b, '\n'))
		if in.Done() {
			b, _ = json.Marshal(record{Type: "outcome", Key: in.Key, Outcome: in.Outcome, CompletedAt: in.CompletedAt})
			rest.Write(append(b, '\n'))
		}
	}
	if err := writeFileSync(j.path, rest.Bytes(), false); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(j.path, os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if _, err := f.Seek(0, io.SeekEnd); err != nil {
		f.Close()
		return nil, err
	}
	j.f.Close()
	j.f = f
	for _, in := range moved {
		delete(j.intents, in.Key)
	}
	j.order = keep
	return moved, nil
}

func intentRecord(in Intent) record {
	t := in.BegunAt
	return record{Type: "intent", Key: in.Key, Tool: in.Tool, Args: in.Args, ForkSafe: in.ForkSafe, BegunAt: &t}
}

// Close closes the file and unregisters the journal.
func (j *Journal) Close() error {
	if j.reg != nil {
		j.reg.removeJournal(j)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}

func (j *Journal) append(rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if _, err := j.f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("resume: journal %s: %w", j.path, err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("resume: journal %s: fsync: %w", j.path, err)
	}
	return nil
}

// writeFileSync replaces path with data durably (atomicfile.WriteFile), or
// with appendTo appends data to it and fsyncs the file and its directory.
func writeFileSync(path string, data []byte, appendTo bool) error {
	if !appendTo {
		return atomicfile.WriteFile(path, data, 0o600)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return atomicfile.SyncDir(filepath.Dir(path))
}
