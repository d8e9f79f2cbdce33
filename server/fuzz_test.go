package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/sandbox"
)

// requestBodies are the JSON bodies of API v1, each as its handler reads it
// (the allowEmpty of its decode call). FuzzRequestBody picks one by index.
var requestBodies = []struct {
	name       string
	new        func() any
	allowEmpty bool
	// check maps an accepted body as its handler does (nil: nothing to map).
	check func(v any)
}{
	{"create", func() any { return &apiv1.CreateSandboxRequest{} }, true,
		func(v any) { specFromWire(*v.(*apiv1.CreateSandboxRequest)) }},
	{"update", func() any { return &apiv1.UpdateSandboxRequest{} }, false,
		func(v any) { policyUpdateFromWire(*v.(*apiv1.UpdateSandboxRequest)) }},
	{"exec", func() any { return &apiv1.ExecRequest{} }, false,
		func(v any) { _ = sandbox.ExecRequest(*v.(*apiv1.ExecRequest)) }},
	{"hibernate", func() any { return &apiv1.HibernateRequest{} }, true, nil},
	{"fork", func() any { return &apiv1.ForkRequest{Count: 1} }, true, nil},
	{"volume", func() any { return &apiv1.CreateVolumeRequest{} }, false, nil},
	{"build", func() any { return &apiv1.BuildImageRequest{} }, false, nil},
	{"resume", func() any { return &struct{}{} }, true, nil},
}

// FuzzRequestBody feeds any bytes to the body decoder of API v1's calls. A
// refused body is an invalid_argument error (400) that says what is wrong; an
// accepted one is a JSON object (nothing after it), and encoding the decoded
// value and decoding that again gives the same value.
func FuzzRequestBody(f *testing.F) {
	f.Add(uint8(0), []byte(`{"image":"base","memory_mib":256,"cpus":0.5,"env":{"A":"1"},"idle_timeout_s":0,"timeout_s":60,"on_timeout":"delete","hibernation_mode":"filesystem","on_resume":["sh","-c","true"],"volumes":[{"name":"v","path":"/data"}],"expires_at":"2030-01-02T03:04:05+02:00"}`))
	f.Add(uint8(1), []byte(`{"idle_timeout_s":30,"expires_at":null}`))
	f.Add(uint8(2), []byte(`{"cmd":["echo","hi"],"stdin":"x","timeout_s":1.5,"background":true}`))
	f.Add(uint8(4), []byte(`{"count":3,"volumes":"copy"}`))
	f.Add(uint8(7), []byte(``))
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		rb := requestBodies[int(which)%len(requestBodies)]
		v := rb.new()
		err := decode(httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body)), v, rb.allowEmpty)
		if err != nil {
			if status, code := classify(err); status != http.StatusBadRequest || code != apiv1.CodeInvalidArgument || err.Error() == "" {
				t.Fatalf("%s: refused with %d %s %q, want 400 invalid_argument and a message", rb.name, status, code, err)
			}
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			return // an empty body where one is optional
		}
		if !json.Valid(body) {
			t.Fatalf("%s: accepted a body that is not one JSON value: %q", rb.name, body)
		}
		if rb.check != nil {
			rb.check(v)
		}
		enc, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("%s: accepted %q, which does not encode: %v", rb.name, body, err)
		}
		v2 := rb.new()
		if err := decode(httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(enc)), v2, rb.allowEmpty); err != nil {
			t.Fatalf("%s: accepted %q but not its encoding %s: %v", rb.name, body, enc, err)
		}
		if enc2, _ := json.Marshal(v2); !bytes.Equal(enc, enc2) {
			t.Fatalf("%s: round trip changed the value: %s then %s", rb.name, enc, enc2)
		}
	})
}

// A body with a stray "}" or "]" after its object ("{}}") was accepted, as if
// the rest were not there (found by FuzzRequestBody); it is a 400 like any
// other data after the object.
func TestDecodeRefusesDataAfterTheObject(t *testing.T) {
	for _, body := range []string{`{}}`, `{} ]`, `{"cmd":["x"]}}`, `{} {}`, `{}x`} {
		var req apiv1.ExecRequest
		err := decode(httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body)), &req, false)
		if status, _ := classify(err); status != http.StatusBadRequest || !strings.Contains(fmt.Sprint(err), "data after the object") {
			t.Errorf("%q: %v (%d), want 400 data after the object", body, err, status)
		}
	}
	for _, body := range []string{`{}`, " {} \n\t", `{"cmd":["x"]}` + "\n"} {
		var req apiv1.ExecRequest
		if err := decode(httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body)), &req, false); err != nil {
			t.Errorf("%q: %v", body, err)
		}
	}
}
