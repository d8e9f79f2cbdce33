package e2e

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
)

// TestClusterVolume: a volume created through cl-a lives on cl-a; a sandbox
// created through cl-b that mounts it is placed on cl-a; hibernated and
// resumed through cl-b it lands on cl-a again with the volume's file
// intact; a create through cl-c that mounts it and a volume of cl-b is
// refused (409) naming both volumes and nodes; while cl-a drains, its resume through cl-b is refused with a 503
// naming the volume and cl-a (it stays hibernated), and after the undrain it
// resumes on cl-a.
func TestClusterVolume(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runsc, network namespaces)")
	}
	ctx := ctxFor(t, 15*time.Minute)
	cl := startCluster(t, ctx)
	a, b := cl.nodes["cl-a"], cl.nodes["cl-b"]
	if v, err := a.c.CreateVolume(ctx, "vol-a"); err != nil || v.Node != "cl-a" {
		t.Fatalf("create volume through cl-a: %+v %v, want node cl-a", v, err)
	}
	sb := create(t, b.c, apiv1.CreateSandboxRequest{MemoryMiB: 256, Volumes: []apiv1.VolumeMount{{Name: "vol-a", Path: "/data"}}})
	id := sb.ID
	t.Cleanup(func() {
		if err := a.c.DeleteSandbox(context.Background(), id); err != nil && !client.IsNotFound(err) {
			t.Errorf("delete %s: %v", id, err)
		}
		if err := a.c.DeleteVolume(context.Background(), "vol-a"); err != nil {
			t.Errorf("delete volume: %v", err)
		}
	})
	if sb.Node != "cl-a" {
		t.Fatalf("created through cl-b mounting cl-a's volume: node %q, want cl-a", sb.Node)
	}
	// A second volume on cl-b: a sandbox mounting both can run on neither
	// node, and its create is refused (409) naming both, making nothing.
	if v, err := b.c.CreateVolume(ctx, "vol-b"); err != nil || v.Node != "cl-b" {
		t.Fatalf("create volume through cl-b: %+v %v, want node cl-b", v, err)
	}
	t.Cleanup(func() {
		if err := b.c.DeleteVolume(context.Background(), "vol-b"); err != nil {
			t.Errorf("delete volume vol-b: %v", err)
		}
	})
	c := cl.nodes["cl-c"]
	listed, err := c.c.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 256,
		Volumes: []apiv1.VolumeMount{{Name: "vol-a", Path: "/a"}, {Name: "vol-b", Path: "/b"}}})
	var ae *client.APIError
	if !errors.As(err, &ae) || ae.Status != http.StatusConflict ||
		!strings.Contains(ae.Message, "volume vol-a is on node cl-a and volume vol-b on node cl-b") {
		t.Fatalf("create through cl-c mounting vol-a (cl-a) and vol-b (cl-b): %v; want 409 naming both", err)
	}
	if now, err := c.c.ListSandboxes(ctx); err != nil || len(now) != len(listed) {
		t.Fatalf("after the refused create: %d sandboxes %v, want %d", len(now), err, len(listed))
	}

	sh(t, b.c, id, "echo kept > /data/f && sync")
	hibernate(t, b.c, id)
	r, err := b.c.Resume(ctx, id)
	if err != nil || r.Node != "cl-a" {
		t.Fatalf("resume through cl-b: node %q %v, want cl-a", r.Node, err)
	}
	if got := sh(t, b.c, id, "cat /data/f"); strings.TrimSpace(got) != "kept" {
		t.Fatalf("the volume's file after the resume: %q, want kept", got)
	}

	// cl-a drains: the sandbox is hibernated and can resume only on cl-a.
	if out, err := runTorpor(cl.bin, "node", "drain", "cl-a", "--url", a.proc.url); err != nil {
		t.Fatalf("torpor node drain cl-a: %v: %s", err, out)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err := b.c.GetSandbox(ctx, id)
		if err == nil && s.State == "hibernated" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not hibernated by the drain: %+v %v", s, err)
		}
		time.Sleep(time.Second)
	}
	_, err = b.c.Resume(ctx, id)
	if !errors.As(err, &ae) || ae.Status != http.StatusServiceUnavailable ||
		!strings.Contains(ae.Message, "volume vol-a is on node cl-a, which is draining") {
		t.Fatalf("resume through cl-b while cl-a drains: %v; want 503 naming vol-a and cl-a", err)
	}
	if s, err := b.c.GetSandbox(ctx, id); err != nil || s.State != "hibernated" {
		t.Fatalf("after the refused resume: %+v %v, want hibernated", s, err)
	}
	if out, err := runTorpor(cl.bin, "node", "undrain", "cl-a", "--url", a.proc.url); err != nil {
		t.Fatalf("torpor node undrain cl-a: %v: %s", err, out)
	}
	r, err = b.c.Resume(ctx, id)
	if err != nil || r.Node != "cl-a" {
		t.Fatalf("resume through cl-b after the undrain: node %q %v, want cl-a", r.Node, err)
	}
	if got := sh(t, b.c, id, "cat /data/f"); strings.TrimSpace(got) != "kept" {
		t.Fatalf("the volume's file after the undrain: %q, want kept", got)
	}
}
