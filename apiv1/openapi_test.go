package apiv1

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

type openapiDoc struct {
	OpenAPI    string                                `json:"openapi"`
	Paths      map[string]map[string]json.RawMessage `json:"paths"`
	Components struct {
		Schemas    map[string]json.RawMessage `json:"schemas"`
		Responses  map[string]json.RawMessage `json:"responses"`
		Parameters map[string]json.RawMessage `json:"parameters"`
	} `json:"components"`
}

func TestOpenAPIHasEveryPath(t *testing.T) {
	var doc openapiDoc
	if err := json.Unmarshal(OpenAPI, &doc); err != nil {
		t.Fatalf("openapi.json does not parse: %v", err)
	}
	if !strings.HasPrefix(doc.OpenAPI, "3.0") {
		t.Errorf("openapi version %q, want 3.0.x", doc.OpenAPI)
	}
	want := map[string][]string{
		"/v1/sandboxes":                          {"post", "get"},
		"/v1/sandboxes/{id}":                     {"get", "delete", "patch"},
		"/v1/sandboxes/{id}/exec":                {"post"},
		"/v1/sandboxes/{id}/files":               {"get", "put"},
		"/v1/sandboxes/{id}/hibernate":           {"post"},
		"/v1/sandboxes/{id}/pause":               {"post"},
		"/v1/sandboxes/{id}/resume":              {"post"},
		"/v1/sandboxes/{id}/fork":                {"post"},
		"/v1/sandboxes/{id}/ports/{port}/{path}": {"get", "post", "put", "delete", "patch", "head", "options"},
		"/v1/snapshots":                          {"get"},
		"/v1/snapshots/{id}":                     {"get", "delete"},
		"/v1/snapshots/{id}/verify":              {"post"},
		"/v1/store":                              {"get"},
		"/v1/sandboxes/{id}/metrics":             {"get"},
		"/v1/images":                             {"get"},
		"/v1/volumes":                            {"post", "get"},
		"/v1/nodes":                              {"get"},
		"/v1/nodes/{name}/drain":                 {"post"},
		"/v1/nodes/{name}/undrain":               {"post"},
		"/v1/pools":                              {"get"},
		"/v1/images/{name}/pool":                 {"put"},
		"/v1/snapshots/{id}/pool":                {"put"},
		"/v1/volumes/{name}":                     {"get", "delete"},
		"/v1/images/build":                       {"post"},
		"/v1/images/import":                      {"post"},
		"/healthz":                               {"get"},
		"/metrics":                               {"get"},
		"/v1/openapi.json":                       {"get"},
	}
	for p, methods := range want {
		item, ok := doc.Paths[p]
		if !ok {
			t.Errorf("path %s missing", p)
			continue
		}
		for _, m := range methods {
			if _, ok := item[m]; !ok {
				t.Errorf("%s %s missing", strings.ToUpper(m), p)
			}
		}
	}
	for p := range doc.Paths {
		if _, ok := want[p]; !ok {
			t.Errorf("path %s is in openapi.json but not in the API", p)
		}
	}
}

// TestOpenAPIRefsResolve checks that every $ref points at a defined component.
func TestOpenAPIRefsResolve(t *testing.T) {
	var doc openapiDoc
	if err := json.Unmarshal(OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if k == "$ref" {
					ref, _ := x.(string)
					parts := strings.Split(strings.TrimPrefix(ref, "#/components/"), "/")
					if len(parts) != 2 {
						t.Errorf("bad $ref %q", ref)
						continue
					}
					var set map[string]json.RawMessage
					switch parts[0] {
					case "schemas":
						set = doc.Components.Schemas
					case "responses":
						set = doc.Components.Responses
					case "parameters":
						set = doc.Components.Parameters
					}
					if _, ok := set[parts[1]]; !ok {
						t.Errorf("$ref %q does not resolve", ref)
					}
					continue
				}
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	var all any
	if err := json.Unmarshal(OpenAPI, &all); err != nil {
		t.Fatal(err)
	}
	walk(all)
}

// TestOpenAPISchemasMatchTypes checks that the schema properties are the JSON field
// names of the Go wire types, so the document cannot drift from types.go.
func TestOpenAPISchemasMatchTypes(t *testing.T) {
	var doc openapiDoc
	if err := json.Unmarshal(OpenAPI, &doc); err != nil {
		t.Fatal(err)
	}
	code := 0
	cases := map[string]any{
		"CreateSandboxRequest": CreateSandboxRequest{Image: "i", MemoryMiB: 1, PidsLimit: 1, CPUs: 1, Env: map[string]string{"a": "b"},
			IdleTimeoutS: new(int), PauseAfterS: new(int), TimeoutS: 1, OnTimeout: "delete", HibernationMode: "none", OnResume: []string{"x"}, Volumes: []VolumeMount{{}}, ExpiresAt: &time.Time{},
			InternetAccess: new(bool), AllowOut: []string{"10.0.0.0/8"}, DenyOut: []string{"1.2.3.4"}},
		"UpdateSandboxRequest": UpdateSandboxRequest{IdleTimeoutS: new(int), PauseAfterS: new(int), TimeoutS: new(int), OnTimeout: new(string), HibernationMode: new(string), OnResume: &[]string{}, ExpiresAt: ExpireNever},
		"VolumeMount":          VolumeMount{}, "Hibernation": Hibernation{}, "Usage": Usage{},
		"Volume": Volume{CopiedFrom: "v", Node: "n", UsedBy: []string{"s"}}, "CreateVolumeRequest": CreateVolumeRequest{}, "ListVolumesResponse": ListVolumesResponse{},
		"Sandbox":               fullSandbox(),
		"Snapshot":              Snapshot{Parent: new(string), UsedBy: []string{"s"}},
		"ListSnapshotsResponse": ListSnapshotsResponse{}, "VerifySnapshotResponse": VerifySnapshotResponse{},
		"ListSandboxesResponse": ListSandboxesResponse{},
		"ExecRequest":           ExecRequest{Cmd: []string{"x"}, Env: map[string]string{"a": "b"}, Cwd: "/", Stdin: "x", TimeoutS: 1, Background: true},
		"ExecEvent":             ExecEvent{Stream: "stdout", Data: []byte("x"), ExitCode: &code, Pid: 1, Error: "e"},
		"ForkRequest":           ForkRequest{Volumes: "copy", Wait: ForkWaitFirst},
		"HibernateRequest":      HibernateRequest{AsyncUpload: new(bool)},
		"ForkResponse":          ForkResponse{},
		"Image":                 Image{},
		"ListImagesResponse":    ListImagesResponse{},
		"BuildImageRequest":     BuildImageRequest{},
		"ErrorBody":             ErrorBody{},
		"ErrorDetail":           ErrorDetail{},
		"ResumeReport":          ResumeReport{SnapshotID: "s", WindowMS: 1, AgentMS: 1, Error: "e"},
		"ResumeStep":            ResumeStep{Detail: "d"},
		"ResumeClock":           ResumeClock{},
		"ResumeSubscribers":     ResumeSubscribers{},
		"ResumeHook":            ResumeHook{},
		"StoreUsage":            StoreUsage{}, "SandboxMetrics": SandboxMetrics{},
		"Node": Node{}, "NodeResources": NodeResources{}, "ListNodesResponse": ListNodesResponse{},
		"Pool": Pool{SnapshotID: "s", MemoryMiB: 1, Error: "e"}, "SetPoolRequest": SetPoolRequest{Size: new(int)}, "ListPoolsResponse": ListPoolsResponse{},
	}
	for name, v := range cases {
		raw, ok := doc.Components.Schemas[name]
		if !ok {
			t.Errorf("schema %s missing", name)
			continue
		}
		var schema struct {
			Properties map[string]json.RawMessage `json:"properties"`
		}
		if err := json.Unmarshal(raw, &schema); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(v)
		var fields map[string]json.RawMessage
		_ = json.Unmarshal(b, &fields)
		for f := range fields {
			if _, ok := schema.Properties[f]; !ok {
				t.Errorf("schema %s lacks property %q of the Go type", name, f)
			}
		}
		for f := range schema.Properties {
			if _, ok := fields[f]; !ok {
				t.Errorf("schema %s has property %q that the Go type does not", name, f)
			}
		}
	}
}

func fullSandbox() Sandbox {
	var s Sandbox
	s.Env = map[string]string{"a": "b"}
	s.ForkedFrom = "f"
	s.Node = "n"
	s.Snapshot = &Snapshot{}
	s.Error = "e"
	s.LastHibernateAt = &s.CreatedAt
	s.LastResumeAt = &s.CreatedAt
	s.ResumeMS = 1
	s.OnResume = []string{"x"}
	s.Volumes = []VolumeMount{{}}
	s.LastResume = &ResumeReport{}
	s.AllowOut, s.DenyOut = []string{"10.0.0.0/8"}, []string{"1.2.3.4/32"}
	return s
}

// TestExpiryJSON: absent leaves expires_at unchanged, null clears it, a time sets it.
func TestExpiryJSON(t *testing.T) {
	var r UpdateSandboxRequest
	if err := json.Unmarshal([]byte(`{}`), &r); err != nil || r.ExpiresAt.Set {
		t.Fatalf("absent: %+v %v", r.ExpiresAt, err)
	}
	if err := json.Unmarshal([]byte(`{"expires_at":null}`), &r); err != nil || !r.ExpiresAt.Set || r.ExpiresAt.At != nil {
		t.Fatalf("null: %+v %v", r.ExpiresAt, err)
	}
	if err := json.Unmarshal([]byte(`{"expires_at":"2030-01-02T03:04:05Z"}`), &r); err != nil || r.ExpiresAt.At == nil || r.ExpiresAt.At.Year() != 2030 {
		t.Fatalf("time: %+v %v", r.ExpiresAt, err)
	}
	if err := json.Unmarshal([]byte(`{"expires_at":"tomorrow"}`), &r); err == nil {
		t.Fatal("a bad time was accepted")
	}
	b, _ := json.Marshal(UpdateSandboxRequest{})
	if string(b) != "{}" {
		t.Fatalf("empty request marshals to %s", b)
	}
	b, _ = json.Marshal(UpdateSandboxRequest{ExpiresAt: ExpireNever})
	if string(b) != `{"expires_at":null}` {
		t.Fatalf("never marshals to %s", b)
	}
}
