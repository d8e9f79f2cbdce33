package resume

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestJournalCrashBetweenIntentAndOutcome(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j.jsonl")
	j, err := openJournal(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	a, err := j.Begin("create_pr", map[string]any{"repo": "x/y", "n": 1})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := j.Begin("send_mail", "hello")
	if err := j.Complete(b.Key, map[string]string{"id": "m1"}); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.Key, "idem-") || len(a.Key) != 37 || a.Key == b.Key {
		t.Errorf("keys %q %q", a.Key, b.Key)
	}
	// "Crash": the process dies without closing; a new one reopens the file.
	j2, err := openJournal(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := j2.Pending()
	if len(p) != 1 || p[0].Key != a.Key || p[0].Tool != "create_pr" || p[0].BegunAt.IsZero() {
		t.Fatalf("pending after reopen = %+v", p)
	}
	var args map[string]any
	if err := json.Unmarshal(p[0].Args, &args); err != nil || args["repo"] != "x/y" {
		t.Errorf("args %s", p[0].Args)
	}
	// Reconcile: retry with the recorded key, then complete.
	if err := j2.Complete(p[0].Key, "created"); err != nil {
		t.Fatal(err)
	}
	if err := j2.Complete("idem-nope", 1); err == nil {
		t.Error("Complete of an unknown key succeeded")
	}
	j.Close()
	j2.Close()
	j3, _ := openJournal(path, nil)
	defer j3.Close()
	if p := j3.Pending(); len(p) != 0 {
		t.Errorf("pending after completing: %+v", p)
	}
}

func TestJournalTornLastLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j.jsonl")
	j, _ := openJournal(path, nil)
	a, _ := j.Begin("t", 1)
	j.Close()
	for _, tail := range []string{`{"type":"outcome","key":"` + a.Key + `","outc`, `{"type":"outcome","key":"` + a.Key + `","outcome":1}`} {
		before, _ := os.ReadFile(path)
		f, _ := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
		f.WriteString(tail) // a crash mid-append: no newline
		f.Close()
		j, err := openJournal(path, nil)
		if err != nil {
			t.Fatalf("reopen with torn tail %q: %v", tail, err)
		}
		if p := j.Pending(); len(p) != 1 || p[0].Key != a.Key {
			t.Errorf("pending with torn tail = %+v", p)
		}
		after, _ := os.ReadFile(path)
		if string(after) != string(before) {
			t.Errorf("torn tail not truncated: %q", after)
		}
		// Appends after the truncation produce a readable file.
		if err := j.Complete(a.Key, "x"); err != nil {
			t.Fatal(err)
		}
		j.Close()
		j, _ = openJournal(path, nil)
		if len(j.Pending()) != 0 {
			t.Error("outcome appended after a truncated tail was lost")
		}
		j.Close()
		os.WriteFile(path, before, 0o600)
	}
	// Corruption in the middle is an error, not silently dropped data.
	data, _ := os.ReadFile(path)
	os.WriteFile(path, append([]byte("garbage\n"), data...), 0o600)
	if _, err := openJournal(path, nil); err == nil {
		t.Error("a journal with a bad record in the middle opened")
	}
}
