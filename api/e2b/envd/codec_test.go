package envd

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem/filesystemconnect"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/api/e2b/envd/gen/process/processconnect"
)

// run collects the events of one Start stream: pid, stdout, stderr and the end.
func run(t *testing.T, c processconnect.ProcessClient, req *process.StartRequest) (pid uint32, stdout, stderr string, end *process.ProcessEvent_EndEvent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := c.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var out, errb strings.Builder
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().GetEvent().(type) {
		case *process.ProcessEvent_Start:
			pid = ev.Start.GetPid()
		case *process.ProcessEvent_Data:
			out.Write(ev.Data.GetStdout())
			errb.Write(ev.Data.GetStderr())
		case *process.ProcessEvent_End:
			end = ev.End
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	return pid, out.String(), errb.String(), end
}

// TestGoClients calls the fake envd with connect-go's client over every protocol and
// codec a caller may use: Connect with JSON (what E2B's SDKs use) and binary protobuf
// over HTTP/1.1, and gRPC over HTTP/2.
func TestGoClients(t *testing.T) {
	f := newFakeEnvd(t)
	plain, h2 := serve(t, f.handler())
	for _, tc := range []struct {
		name   string
		client *http.Client
		url    string
		opts   []connect.ClientOption
	}{
		{"connect+json", plain.Client(), plain.URL, []connect.ClientOption{connect.WithProtoJSON()}},
		{"connect+proto", plain.Client(), plain.URL, nil},
		{"grpc+proto", h2.Client(), h2.URL, []connect.ClientOption{connect.WithGRPC()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pc := processconnect.NewProcessClient(tc.client, tc.url, tc.opts...)
			fc := filesystemconnect.NewFilesystemClient(tc.client, tc.url, tc.opts...)
			cwd := t.TempDir()
			pid, stdout, stderr, end := run(t, pc, &process.StartRequest{
				Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", `echo "$GREETING from $(pwd)"; echo oops >&2; exit 3`},
					Envs: map[string]string{"GREETING": "hi"}, Cwd: &cwd},
				Stdin: new(bool),
			})
			if pid == 0 {
				t.Error("no StartEvent with a pid")
			}
			if want := "hi from " + cwd + "\n"; stdout != want || stderr != "oops\n" {
				t.Errorf("stdout %q stderr %q; want %q, %q", stdout, stderr, want, "oops\n")
			}
			if end == nil || end.GetExitCode() != 3 || !end.GetExited() || end.GetStatus() != "exit status 3" {
				t.Errorf("end event %v, want exit code 3, exited", end)
			}
			// The stdin field's presence survives the codec: set to false, not left out.
			starts := f.callsOf(processconnect.ProcessStartProcedure)
			if got := starts[len(starts)-1].msg.(*process.StartRequest); got.Stdin == nil || *got.Stdin {
				t.Errorf("server decoded stdin %v, want set to false", got.Stdin)
			}

			path := writeFile(t, cwd, "data.bin", 1234)
			st, err := fc.Stat(context.Background(), connect.NewRequest(&filesystem.StatRequest{Path: path}))
			if err != nil {
				t.Fatal(err)
			}
			fi, _ := os.Stat(path)
			e := st.Msg.GetEntry()
			if e.GetName() != "data.bin" || e.GetPath() != path || e.GetSize() != 1234 || e.GetType() != filesystem.FileType_FILE_TYPE_FILE ||
				e.GetMode() != 0o640 || e.GetPermissions() != "-rw-r-----" || !e.GetModifiedTime().AsTime().Equal(fi.ModTime()) {
				t.Errorf("Stat answered %v", e)
			}
			_, err = fc.Stat(context.Background(), connect.NewRequest(&filesystem.StatRequest{Path: path + ".missing"}))
			if connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("Stat of a missing file: %v, want not_found", err)
			}

			// A running process is listed, with the tag it was started with, and
			// SendSignal ends it; a second SendSignal finds nothing.
			tag := "sleeper-" + tc.name
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			stream, err := pc.Start(ctx, connect.NewRequest(&process.StartRequest{
				Process: &process.ProcessConfig{Cmd: "sleep", Args: []string{"30"}}, Tag: &tag}))
			if err != nil {
				t.Fatal(err)
			}
			defer stream.Close()
			if !stream.Receive() {
				t.Fatalf("no StartEvent: %v", stream.Err())
			}
			sleeper := stream.Msg().GetEvent().GetStart().GetPid()
			list, err := pc.List(context.Background(), connect.NewRequest(&process.ListRequest{}))
			if err != nil {
				t.Fatal(err)
			}
			var listed *process.ProcessInfo
			for _, p := range list.Msg.GetProcesses() {
				if p.GetPid() == sleeper {
					listed = p
				}
			}
			if listed == nil || listed.GetTag() != tag || listed.GetConfig().GetCmd() != "sleep" || listed.GetConfig().GetArgs()[0] != "30" {
				t.Fatalf("List answered %v, want pid %d tagged %q", list.Msg, sleeper, tag)
			}
			sig := connect.NewRequest(&process.SendSignalRequest{
				Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: sleeper}}, Signal: process.Signal_SIGNAL_SIGKILL})
			if _, err := pc.SendSignal(context.Background(), sig); err != nil {
				t.Fatal(err)
			}
			var end2 *process.ProcessEvent_EndEvent
			for stream.Receive() {
				if e := stream.Msg().GetEvent().GetEnd(); e != nil {
					end2 = e
				}
			}
			if end2 == nil || end2.GetExited() || end2.GetStatus() != "signal: killed" {
				t.Errorf("killed process ended with %v, want not exited, signal: killed", end2)
			}
			_, err = pc.SendSignal(context.Background(), sig)
			var ce *connect.Error
			if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound {
				t.Errorf("SendSignal to an ended process: %v, want not_found", err)
			}
		})
	}
}
