package envd

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"reflect"
	"testing"
	"time"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
)

// The bodies below are the JSON that E2B's SDK (index.mjs, connect-web with
// useBinaryFormat false) sends; the tests post them as the SDK does and read the
// answers as raw JSON, so the field names on the wire are checked, not just the Go
// types.

// post sends one Connect request and answers the status, content type and body.
func post(t *testing.T, url, contentType string, body []byte) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequest("POST", url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("Connect-Protocol-Version", "1")
	req.Header.Set("Keepalive-Ping-Interval", "50")
	req.Header.Set("Connect-Timeout-Ms", "60000")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Content-Type"), b
}

// envelope frames one message of a Connect stream: a flag byte, a big-endian length.
func envelope(flag byte, msg []byte) []byte {
	out := []byte{flag, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(out[1:], uint32(len(msg)))
	return append(out, msg...)
}

type frame struct {
	flag byte
	msg  map[string]any
}

// frames splits a Connect stream body into its envelopes, each decoded as JSON.
func frames(t *testing.T, body []byte) []frame {
	t.Helper()
	var out []frame
	for len(body) > 0 {
		if len(body) < 5 {
			t.Fatalf("truncated envelope header %x", body)
		}
		n := binary.BigEndian.Uint32(body[1:5])
		if uint32(len(body)-5) < n {
			t.Fatalf("envelope of %d bytes, %d left", n, len(body)-5)
		}
		var m map[string]any
		if err := json.Unmarshal(body[5:5+n], &m); err != nil {
			t.Fatalf("envelope %q: %v", body[5:5+n], err)
		}
		out = append(out, frame{flag: body[0], msg: m})
		body = body[5+n:]
	}
	return out
}

func asJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestSDKStreamedStart(t *testing.T) {
	if _, err := os.Stat("/bin/bash"); err != nil {
		t.Skip("no /bin/bash: the SDK's commands.run runs /bin/bash -l -c")
	}
	f := newFakeEnvd(t)
	srv, _ := serve(t, f.handler())
	cwd := t.TempDir()
	// commands.run("echo hi", {cwd}) in 2.51 (envs is left out unless given; the
	// empty map is what older callers send).
	body := `{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{},"cwd":"` + cwd + `"},"stdin":false}`
	status, ctype, resp := post(t, srv.URL+processconnect.ProcessStartProcedure, "application/connect+json", envelope(0, []byte(body)))
	if status != 200 || ctype != "application/connect+json" {
		t.Fatalf("status %d content type %q: %s", status, ctype, resp)
	}
	fr := frames(t, resp)
	if len(fr) < 3 {
		t.Fatalf("%d frames, want start, data, end and end-of-stream: %v", len(fr), fr)
	}
	start, ok := fr[0].msg["event"].(map[string]any)["start"].(map[string]any)
	if !ok || fr[0].flag != 0 || start["pid"].(float64) <= 0 {
		t.Errorf("first frame %s, want {event:{start:{pid}}}", asJSON(fr[0].msg))
	}
	var stdout []byte
	for _, f := range fr[1 : len(fr)-2] {
		data, ok := f.msg["event"].(map[string]any)["data"].(map[string]any)
		if !ok {
			t.Fatalf("frame %s, want {event:{data:…}}", asJSON(f.msg))
		}
		b, err := base64.StdEncoding.DecodeString(data["stdout"].(string))
		if err != nil {
			t.Fatalf("stdout %v is not base64: %v", data["stdout"], err)
		}
		stdout = append(stdout, b...)
	}
	if string(stdout) != "hi\n" {
		t.Errorf("stdout %q, want %q", stdout, "hi\n")
	}
	// A zero exit code is left out of the JSON, as proto3 JSON does; the SDK reads it
	// as 0.
	end := fr[len(fr)-2].msg
	if got, want := asJSON(end), `{"event":{"end":{"exited":true,"status":"exit status 0"}}}`; got != want {
		t.Errorf("end frame %s, want %s", got, want)
	}
	if last := fr[len(fr)-1]; last.flag != 2 || len(last.msg) != 0 {
		t.Errorf("end-of-stream frame flag %d %s, want flag 2 {}", last.flag, asJSON(last.msg))
	}
	// The server decoded every field, and told stdin false from stdin left out.
	got := f.callsOf(processconnect.ProcessStartProcedure)[0].msg.(*process.StartRequest)
	cfg := got.GetProcess()
	if cfg.GetCmd() != "/bin/bash" || !reflect.DeepEqual(cfg.GetArgs(), []string{"-l", "-c", "echo hi"}) ||
		cfg.Cwd == nil || cfg.GetCwd() != cwd || len(cfg.GetEnvs()) != 0 || got.Stdin == nil || got.GetStdin() || got.Pty != nil || got.Tag != nil {
		t.Errorf("server decoded %v", got)
	}

	// A failing stream ends with the error in the end-of-stream frame, status 200.
	status, _, resp = post(t, srv.URL+processconnect.ProcessStartProcedure, "application/connect+json",
		envelope(0, []byte(`{"process":{"cmd":""}}`)))
	fr = frames(t, resp)
	if status != 200 || len(fr) != 1 || fr[0].flag != 2 || fr[0].msg["error"].(map[string]any)["code"] != "invalid_argument" {
		t.Errorf("failed start: status %d frames %v, want one end-of-stream frame with invalid_argument", status, fr)
	}
}

func TestSDKUnaryJSON(t *testing.T) {
	f := newFakeEnvd(t)
	srv, _ := serve(t, f.handler())
	path := writeFile(t, t.TempDir(), "notes.txt", 1234)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}

	// files.getInfo(path); a field this server does not know is ignored, so a newer
	// SDK's additions do not break it.
	status, ctype, resp := post(t, srv.URL+filesystemconnect.FilesystemStatProcedure, "application/json",
		[]byte(`{"path":"`+path+`","fieldFromTheFuture":1}`))
	if status != 200 || ctype != "application/json" {
		t.Fatalf("Stat: status %d %q %s", status, ctype, resp)
	}
	var stat struct {
		Entry map[string]any `json:"entry"`
	}
	if err := json.Unmarshal(resp, &stat); err != nil {
		t.Fatal(err)
	}
	e := stat.Entry
	// int64 travels as a string in proto3 JSON; enums by name; timestamps RFC 3339.
	if e["name"] != "notes.txt" || e["path"] != path || e["type"] != "FILE_TYPE_FILE" || e["size"] != "1234" ||
		e["mode"] != float64(0o640) || e["permissions"] != "-rw-r-----" || e["owner"] == nil || e["group"] == nil {
		t.Errorf("Stat answered %s", resp)
	}
	mt, err := time.Parse(time.RFC3339Nano, e["modifiedTime"].(string))
	if err != nil || !mt.Equal(fi.ModTime()) {
		t.Errorf("modifiedTime %v (%v), want %v", e["modifiedTime"], err, fi.ModTime())
	}
	if _, ok := e["symlinkTarget"]; ok {
		t.Errorf("a plain file has symlinkTarget: %s", resp)
	}
	link := path + ".link"
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	_, _, resp = post(t, srv.URL+filesystemconnect.FilesystemStatProcedure, "application/json", []byte(`{"path":"`+link+`"}`))
	if err := json.Unmarshal(resp, &stat); err != nil || stat.Entry["type"] != "FILE_TYPE_SYMLINK" || stat.Entry["symlinkTarget"] != path {
		t.Errorf("Stat of a symlink answered %s", resp)
	}

	// files.exists(missing): not_found, as Connect's JSON error body with HTTP 404.
	status, _, resp = post(t, srv.URL+filesystemconnect.FilesystemStatProcedure, "application/json", []byte(`{"path":"`+path+`.missing"}`))
	var cerr struct{ Code, Message string }
	if err := json.Unmarshal(resp, &cerr); status != 404 || err != nil || cerr.Code != "not_found" || cerr.Message == "" {
		t.Errorf("Stat of a missing file: status %d %s", status, resp)
	}

	// commands.list() with nothing running: an empty answer.
	status, _, resp = post(t, srv.URL+processconnect.ProcessListProcedure, "application/json", []byte(`{}`))
	if status != 200 || string(resp) != "{}" {
		t.Errorf("List: status %d %s, want 200 {}", status, resp)
	}

	// commands.kill(pid): the selector's oneof is flattened into the message, the
	// signal goes by name (protobuf-es) or number (any proto3 JSON writer).
	for _, body := range []string{`{"process":{"pid":4194304},"signal":"SIGNAL_SIGKILL"}`, `{"process":{"pid":4194304},"signal":9}`} {
		status, _, resp = post(t, srv.URL+processconnect.ProcessSendSignalProcedure, "application/json", []byte(body))
		if status != 404 {
			t.Errorf("SendSignal %s to no process: status %d %s, want 404", body, status, resp)
		}
	}
	for _, c := range f.callsOf(processconnect.ProcessSendSignalProcedure) {
		m := c.msg.(*process.SendSignalRequest)
		if m.GetProcess().GetPid() != 4194304 || m.GetSignal() != process.Signal_SIGNAL_SIGKILL {
			t.Errorf("server decoded %v", m)
		}
	}
}
