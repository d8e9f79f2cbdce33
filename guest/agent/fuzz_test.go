package agent

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fuzzRoutes are the agent's routes FuzzAgentRequest drives: envd's Connect
// procedures and HTTP routes and torpor's own, all but those that start
// commands (Start, /exec), block until the client leaves (WatchDir) or keep
// state past the request (CreateWatcher). Files go under Options.Root, a
// fresh directory per input.
var fuzzRoutes = []struct {
	method, path string
	connect      bool
}{
	{"POST", "/filesystem.Filesystem/Stat", true},
	{"POST", "/filesystem.Filesystem/MakeDir", true},
	{"POST", "/filesystem.Filesystem/Move", true},
	{"POST", "/filesystem.Filesystem/Remove", true},
	{"POST", "/filesystem.Filesystem/ListDir", true},
	{"POST", "/filesystem.Filesystem/GetWatcherEvents", true},
	{"POST", "/filesystem.Filesystem/RemoveWatcher", true},
	{"POST", "/process.Process/List", true},
	{"POST", "/process.Process/SendInput", true},
	{"POST", "/process.Process/StreamInput", true},
	{"POST", "/process.Process/CloseStdin", true},
	{"POST", "/process.Process/SendSignal", true},
	{"POST", "/process.Process/Update", true},
	{"POST", "/process.Process/Connect", true},
	{"POST", "/envd/files", false},
	{"GET", "/envd/files", false},
	{"GET", "/envd/envs", false},
	{"PUT", "/files", false},
	{"GET", "/files", false},
	{"POST", "/resume", false},
}

// fuzzTypes are the content types a request is sent with: Connect's unary
// codecs, its streaming envelopes (a flags byte and a 4-byte big-endian length
// before each message), gRPC-Web's, and the upload types of POST /files.
var fuzzTypes = []string{
	"application/json", "application/proto", "application/connect+json", "application/connect+proto",
	"application/grpc-web+proto", "application/octet-stream", "multipart/form-data; boundary=b", "text/plain",
}

// connectFraming says whether msg is connect-go's own error for a request
// whose envelopes are malformed (cut inside one, "promised N bytes in
// enveloped message", an end-stream message from the client), which it
// answers with code internal before a handler sees the request; E2B's envd,
// on the same library, answers the same.
func connectFraming(msg string) bool {
	return strings.HasPrefix(msg, "protocol error: ") || strings.HasPrefix(msg, "unmarshal end stream message: ")
}

// envelope frames msg as one Connect streaming message.
func envelope(msg string) []byte {
	b := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg)))
	return append(b, msg...)
}

// FuzzAgentRequest sends any body, content type, query and Authorization
// header to the agent's routes. No request makes the agent panic or answer
// 500 (every problem with a request is the request's: 4xx, or a Connect error
// other than internal, but for connect-go's own answer to a cut envelope),
// and nothing is written outside Options.Root.
func FuzzAgentRequest(f *testing.F) {
	root := "Basic cm9vdDo=" // root:
	add := func(route, ctype int, auth, query string, body []byte) {
		f.Add(uint8(route), uint8(ctype), auth, query, body)
	}
	add(0, 0, root, "", []byte(`{"path":"/"}`))
	add(1, 0, root, "", []byte(`{"path":"~/a/b"}`))
	add(2, 0, root, "", []byte(`{"source":"/a","destination":"/b"}`))
	add(3, 0, root, "", []byte(`{"path":"/a"}`))
	add(4, 0, root, "", []byte(`{"path":"/","depth":3}`))
	add(5, 0, root, "", []byte(`{"watcherId":"w1"}`))
	add(7, 1, root, "", nil)
	add(8, 0, root, "", []byte(`{"process":{"pid":1},"input":{"stdin":"aGk="}}`))
	add(9, 2, root, "", append(envelope(`{"start":{"process":{"tag":"t"}}}`), envelope(`{"data":{"input":{"stdin":"eA=="}}}`)...))
	add(9, 3, root, "", envelope("\x0a\x04\x0a\x02\x08\x01"))
	add(11, 0, root, "", []byte(`{"process":{"pid":7},"signal":"SIGNAL_SIGKILL"}`))
	add(12, 0, root, "", []byte(`{"process":{"pid":7},"pty":{"size":{"cols":80,"rows":24}}}`))
	add(13, 2, root, "", envelope(`{"process":{"pid":7}}`))
	add(13, 4, root, "", envelope("\x0a\x02\x08\x07"))
	add(14, 5, "", "path=/tmp/x&username=root", []byte("file content"))
	add(14, 6, "", "username=root", []byte("--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"d/f.txt\"\r\n\r\nhello\r\n--b--\r\n"))
	add(14, 5|8, "", "path=/z.gz&username=root", gzipped("compressed"))
	add(15, 0, "", "path=/etc/hostname&username=root", nil)
	add(17, 5, "", "path=/a/b&mode=0755", []byte("x"))
	add(18, 7, "", "path=/a/b", nil)
	add(19, 0, "", "", []byte(`{"generation":2,"forked":true,"snapshot_id":"s","host_time":"2026-12-01T10:00:00Z"}`))
	f.Fuzz(func(t *testing.T, route, ctype uint8, auth, query string, body []byte) {
		rt := fuzzRoutes[int(route)%len(fuzzRoutes)]
		base := t.TempDir()
		dir := filepath.Join(base, "root")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		srv := newServer(Options{Root: dir, Env: map[string]string{"PATH": "/usr/bin:/bin"}, Log: log.New(&bytes.Buffer{}, "", 0)})
		req := httptest.NewRequest(rt.method, "/", bytes.NewReader(body))
		req.URL.Path, req.URL.RawQuery = rt.path, query
		req.Header.Set("Content-Type", fuzzTypes[int(ctype&7)])
		if ctype&8 != 0 {
			req.Header.Set("Content-Encoding", "gzip")
		}
		if rt.connect {
			req.Header.Set("Connect-Protocol-Version", "1")
		}
		if auth != "" {
			req.Header["Authorization"] = []string{auth}
		}
		rec := httptest.NewRecorder()
		srv.handler().ServeHTTP(rec, req)
		t.Logf("%s %s: %d %.200s %v", rt.method, rt.path, rec.Code, rec.Body.Bytes(), rec.Header())
		grpcInternal := rec.Header().Get("Grpc-Status") == "13" && !connectFraming(rec.Header().Get("Grpc-Message"))
		if rec.Code >= 500 || grpcInternal {
			t.Fatalf("%s %s (%s): %d %s", rt.method, rt.path, req.Header.Get("Content-Type"), rec.Code, rec.Body.Bytes())
		}
		if _, msg, ok := strings.Cut(rec.Body.String(), `"code":"internal","message":"`); rt.connect && ok && !connectFraming(msg) {
			t.Fatalf("%s: internal error: %s", rt.path, rec.Body.Bytes())
		}
		ents, err := os.ReadDir(base)
		if err != nil || len(ents) > 1 || len(ents) == 1 && ents[0].Name() != "root" {
			t.Fatalf("%s %s wrote beside the root: %v (%v)", rt.method, rt.path, ents, err)
		}
	})
}

func gzipped(s string) []byte {
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	zw.Write([]byte(s))
	zw.Close()
	return b.Bytes()
}

// An upload whose gzip data is corrupt, or whose multipart part is cut, was
// answered 500 with the reader's error, as if the agent had failed (found by
// FuzzAgentRequest); it is the request's error, 400, naming the part.
func TestEnvdBadUploadBodyIs400(t *testing.T) {
	for name, c := range map[string]struct {
		ctype, encoding string
		body            []byte
		want            string
	}{
		"corrupt gzip": {"application/octet-stream", "gzip", append(gzipped("a file")[:10], 0x07, 0, 0, 0), // a deflate block of the reserved type 3
			"gzip body: flate: corrupt input"},
		"cut multipart part": {"multipart/form-data; boundary=b", "",
			[]byte("--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nhalf a fi"), "multipart part: unexpected EOF"},
	} {
		t.Run(name, func(t *testing.T) {
			srv := newServer(Options{Root: t.TempDir(), Env: map[string]string{}, Log: log.New(&bytes.Buffer{}, "", 0)})
			req := httptest.NewRequest("POST", "/envd/files?path=/z&username=root", bytes.NewReader(c.body))
			req.Header.Set("Content-Type", c.ctype)
			if c.encoding != "" {
				req.Header.Set("Content-Encoding", c.encoding)
			}
			rec := httptest.NewRecorder()
			srv.handler().ServeHTTP(rec, req)
			if rec.Code != 400 || !strings.Contains(rec.Body.String(), c.want) {
				t.Fatalf("%d %s, want 400 saying %q", rec.Code, rec.Body.Bytes(), c.want)
			}
		})
	}
}
