package proto_test

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/torpor/torpor/api/e2b"
	"github.com/torpor/torpor/guest/proto"
)

// TestVersion1Wire decodes bodies exactly as a version 1 agent and host send
// them and encodes them back: every field survives under the same name, so a
// host of this version and a version 1 agent understand each other both ways.
func TestVersion1Wire(t *testing.T) {
	for _, tc := range []struct {
		name string
		wire string
		v    any
	}{
		{"health", `{"ok":true,"pid":1,"started_at":"2026-01-02T03:04:05.123456789Z"}`, &proto.Health{}},
		{"exec request", `{"cmd":["sh","-c","x"],"env":{"A":"1"},"cwd":"/tmp","stdin":"in","timeout_s":1.5,"background":true}`, &proto.ExecRequest{}},
		{"exec output", `{"stream":"stdout","data":"aGkK"}`, &proto.ExecEvent{}},
		{"exec exit", `{"exit_code":0}`, &proto.ExecEvent{}},
		{"exec not started", `{"exit_code":127,"error":"exec: \"nope\": executable file not found in $PATH"}`, &proto.ExecEvent{}},
		{"exec background", `{"pid":42}`, &proto.ExecEvent{}},
		{"resume request", `{"generation":3,"forked":true,"snapshot_id":"snp_1","host_time":"2026-01-02T03:04:05.5Z","hook_deadline_s":10,"ack_deadline_s":5,"start":true}`, &proto.ResumeRequest{}},
		{"resume report", `{"event":"resume","generation":3,"forked":false,"snapshot_id":"snp_1",` +
			`"steps":[{"name":"clock","ms":0.2,"ok":false,"detail":"d"}],"clock":{"skew_ms":60.5,"corrected":"offset-file"},` +
			`"subscribers":{"total":2,"acked":1,"timed_out":["sub"]},"hooks":[{"name":"h","exit_code":124,"ms":10,"timed_out":true,"output":"o"}],"ok":false}`,
			&proto.ResumeReport{}},
		{"error", `{"error":{"code":"not_found","message":"no such endpoint: /x"}}`, &proto.ErrorBody{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := json.Unmarshal([]byte(tc.wire), tc.v); err != nil {
				t.Fatal(err)
			}
			b, err := json.Marshal(tc.v)
			if err != nil {
				t.Fatal(err)
			}
			var want, got any
			json.Unmarshal([]byte(tc.wire), &want)
			json.Unmarshal(b, &got)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("re-encoded as\n%s\nwant the version 1 body\n%s", b, tc.wire)
			}
		})
	}
}

func TestVersionOf(t *testing.T) {
	for _, tc := range []struct {
		h    proto.Health
		want int
	}{
		{proto.Health{OK: true}, proto.Version1},
		{proto.Health{OK: true, ProtocolVersion: 2}, 2},
		{proto.Health{OK: true, ProtocolVersion: 7}, 7},
	} {
		if got := proto.VersionOf(tc.h); got != tc.want {
			t.Errorf("VersionOf(%+v) = %d, want %d", tc.h, got, tc.want)
		}
	}
	if proto.MinVersion > proto.Version1 {
		t.Errorf("MinVersion %d: version 1 snapshots may still exist (see doc.go)", proto.MinVersion)
	}
}

func TestEnvdPath(t *testing.T) {
	for in, want := range map[string]string{
		"/health":                        "/envd/health",
		"/files":                         "/envd/files",
		"/envs":                          "/envd/envs",
		"/process.Process/Start":         "/process.Process/Start",
		"/filesystem.Filesystem/ListDir": "/filesystem.Filesystem/ListDir",
		"/exec":                          "/envd/exec",
		"/resume":                        "/envd/resume",
		"/envd/files":                    "/envd/envd/files",
		"/":                              "/envd/",
	} {
		if got := proto.EnvdPath(in); got != want {
			t.Errorf("EnvdPath(%q) = %q, want %q", in, got, want)
		}
	}
}

// The agent's default envd user is the one the E2B control plane documents.
func TestEnvdDefaultUser(t *testing.T) {
	if proto.EnvdDefaultUser != e2b.DefaultUser {
		t.Fatalf("proto.EnvdDefaultUser %q, e2b.DefaultUser %q", proto.EnvdDefaultUser, e2b.DefaultUser)
	}
}
