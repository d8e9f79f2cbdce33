package resume

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// journalState is what a journal holds, in order.
func journalState(j *Journal) []Intent {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]Intent, 0, len(j.order))
	for _, k := range j.order {
		out = append(out, *j.intents[k])
	}
	return out
}

// FuzzJournal opens a journal file holding any bytes (a crash may leave
// anything at its end; a disk, anything anywhere). Open either fails naming
// the journal and the offset of the bad record, or keeps a prefix of the file
// that ends a line, and then: opening it again reads the same intents and
// changes nothing, and an intent begun and completed after it is read back.
func FuzzJournal(f *testing.F) {
	at := "2026-12-01T10:00:00.5Z"
	f.Add([]byte(`{"type":"intent","key":"idem-1","tool":"create_pr","args":{"repo":"x/y"},"begun_at":"` + at + `"}` + "\n" +
		`{"type":"outcome","key":"idem-1","outcome":{"pr":7},"completed_at":"` + at + `"}` + "\n"))
	f.Add([]byte(`{"type":"intent","key":"idem-2","tool":"send_mail","fork_safe":true}` + "\n" + `{"type":"outcome","key":"idem-2"`))
	f.Add([]byte(`{"type":"intent","key":"a"}` + "\n" + `not json` + "\n" + `{"type":"intent","key":"b"}` + "\n"))
	f.Add([]byte(`{"type":"intent","key":"a"}`))
	f.Add([]byte("\n\n  \n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(t.TempDir(), "journal.jsonl")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		j, err := openJournal(path, nil)
		if err != nil {
			if !strings.Contains(err.Error(), path+": bad record at byte ") {
				t.Fatalf("refused without naming the journal and the offset: %v", err)
			}
			return
		}
		first := journalState(j)
		j.Close()
		kept, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if tail := kept[bytes.LastIndexByte(kept, '\n')+1:]; !bytes.HasPrefix(data, kept) || len(bytes.TrimSpace(tail)) > 0 {
			t.Fatalf("kept %q of %q: not a prefix that ends a line", kept, data)
		}
		j, err = openJournal(path, nil)
		if err != nil {
			t.Fatalf("reopening what the first open kept: %v", err)
		}
		if again := journalState(j); !reflect.DeepEqual(again, first) {
			t.Fatalf("reopened journal holds %+v, first open %+v", again, first)
		}
		if b, _ := os.ReadFile(path); !bytes.Equal(b, kept) {
			t.Fatalf("the second open changed the file: %q to %q", kept, b)
		}
		in, err := j.Begin("fuzz", map[string]int{"n": 1})
		if err != nil {
			t.Fatal(err)
		}
		if err := j.Complete(in.Key, "done"); err != nil {
			t.Fatal(err)
		}
		j.Close()
		j, err = openJournal(path, nil)
		if err != nil {
			t.Fatalf("reopening after an append: %v", err)
		}
		defer j.Close()
		got, ok := j.Get(in.Key)
		if !ok || !got.Done() || string(got.Outcome) != `"done"` {
			t.Fatalf("the intent appended after %q reads back as %+v (%v)", kept, got, ok)
		}
	})
}

// FuzzParseEvent decodes any line of the agent's event stream. An event that
// decodes encodes back (as the agent writes it) to a line that decodes to the
// same event.
func FuzzParseEvent(f *testing.F) {
	f.Add([]byte(`{"event":"resume","generation":3,"forked":true,"host_time":"2026-12-01T10:00:00.123456789Z","snapshot_id":"snap-1","seq":2}`))
	f.Add([]byte(`{"event":"hello","generation":1}`))
	f.Add([]byte(`{"event":"resume","host_time":"yesterday"}`))
	f.Add([]byte(`{"event":"resume","host_time":"2026-12-01T10:00:00+01:00"}` + "\n"))
	f.Fuzz(func(t *testing.T, line []byte) {
		ev, err := ParseEvent(line)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "resume: bad ") {
				t.Fatalf("error %v", err)
			}
			return
		}
		w := wireEvent{Event: ev.Event, Generation: ev.Generation, Forked: ev.Forked, SnapshotID: ev.SnapshotID, Seq: ev.Seq}
		if !ev.HostTime.IsZero() {
			w.HostTime = ev.HostTime.Format(time.RFC3339Nano)
		}
		b, err := json.Marshal(w)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseEvent(b)
		if err != nil || again.Event != ev.Event || again.Generation != ev.Generation || again.Forked != ev.Forked ||
			again.SnapshotID != ev.SnapshotID || again.Seq != ev.Seq || !again.HostTime.Equal(ev.HostTime) {
			t.Fatalf("%s parsed as %+v, written again as %s, parsed as %+v (%v)", line, ev, b, again, err)
		}
	})
}
