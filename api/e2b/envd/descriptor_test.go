package envd

import (
	"encoding/base64"
	"os"
	"regexp"
	"testing"

	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/torpor/torpor/api/e2b/envd/gen/filesystem"
	"github.com/torpor/torpor/api/e2b/envd/gen/process"
	"github.com/torpor/torpor/e2e/e2bsdk"
)

// fileDescRE finds the serialized FileDescriptorProtos that protobuf-es code embeds:
// fileDesc("<base64>", …).
var fileDescRE = regexp.MustCompile(`fileDesc\("([A-Za-z0-9+/=]+)"`)

// sdkDescriptors reads the descriptors one installed SDK embeds, by file name.
func sdkDescriptors(t *testing.T, pkg string) map[string]*descriptorpb.FileDescriptorProto {
	t.Helper()
	src, err := os.ReadFile(e2bsdk.Module(pkg))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*descriptorpb.FileDescriptorProto{}
	for _, m := range fileDescRE.FindAllSubmatch(src, -1) {
		raw, err := base64.RawStdEncoding.DecodeString(string(m[1]))
		if err != nil {
			raw, err = base64.StdEncoding.DecodeString(string(m[1]))
		}
		if err != nil {
			t.Fatalf("%s: descriptor is not base64: %v", pkg, err)
		}
		fd := &descriptorpb.FileDescriptorProto{}
		if err := proto.Unmarshal(raw, fd); err != nil {
			t.Fatalf("%s: descriptor: %v", pkg, err)
		}
		out[fd.GetName()] = fd
	}
	return out
}

// wireShape strips what does not travel on the wire or in JSON names from a file
// descriptor: file options (go_package), source info, the list of imported files
// (protobuf-es passes them beside the descriptor instead; the fields that use an
// import still name its types), and json_name (protoc fills it in, protobuf-es leaves
// it out; both derive it from the field name the same way).
func wireShape(fd *descriptorpb.FileDescriptorProto) *descriptorpb.FileDescriptorProto {
	fd = proto.Clone(fd).(*descriptorpb.FileDescriptorProto)
	fd.Options, fd.SourceCodeInfo, fd.Dependency = nil, nil, nil
	var strip func([]*descriptorpb.DescriptorProto)
	strip = func(msgs []*descriptorpb.DescriptorProto) {
		for _, m := range msgs {
			for _, f := range m.Field {
				f.JsonName = nil
			}
			strip(m.NestedType)
		}
	}
	strip(fd.MessageType)
	return fd
}

// TestDescriptorsMatchSDK compares our generated descriptors with the ones each pinned
// SDK embeds: same packages, services, methods and streaming, messages, field names,
// numbers, types, labels, oneofs and enums. Any difference breaks the binary codec, the
// JSON codec, or both.
func TestDescriptorsMatchSDK(t *testing.T) {
	e2bsdk.Installed(t)
	ours := []protoreflect.FileDescriptor{process.File_process_process_proto, filesystem.File_filesystem_filesystem_proto}
	for pkg := range e2bsdk.Packages {
		sdk := sdkDescriptors(t, pkg)
		for _, fd := range ours {
			theirs, ok := sdk[fd.Path()]
			if !ok {
				t.Errorf("%s embeds no %s (it has %d descriptors)", pkg, fd.Path(), len(sdk))
				continue
			}
			a, b := wireShape(theirs), wireShape(protodesc.ToFileDescriptorProto(fd))
			if !proto.Equal(a, b) {
				t.Errorf("%s: %s differs from the SDK's:\n%s", pkg, fd.Path(), describeDiff(a, b))
			}
		}
	}
}

// describeDiff names the top-level messages, enums and services that differ between
// the SDK's descriptor a and ours b, with both versions of each.
func describeDiff(a, b *descriptorpb.FileDescriptorProto) string {
	type named interface {
		proto.Message
		GetName() string
	}
	index := func(fd *descriptorpb.FileDescriptorProto) map[string]named {
		m := map[string]named{}
		for _, x := range fd.MessageType {
			m["message "+x.GetName()] = x
		}
		for _, x := range fd.EnumType {
			m["enum "+x.GetName()] = x
		}
		for _, x := range fd.Service {
			m["service "+x.GetName()] = x
		}
		return m
	}
	ia, ib := index(a), index(b)
	var out string
	for k, x := range ia {
		if y, ok := ib[k]; !ok {
			out += k + ": missing in ours\n"
		} else if !proto.Equal(x, y) {
			out += k + ":\n  sdk:  " + prototext.Format(x) + "\n  ours: " + prototext.Format(y) + "\n"
		}
	}
	for k := range ib {
		if _, ok := ia[k]; !ok {
			out += k + ": not in the SDK's\n"
		}
	}
	if out == "" {
		out = "file-level fields differ:\n  sdk:  " + prototext.Format(a) + "\n  ours: " + prototext.Format(b)
	}
	return out
}
