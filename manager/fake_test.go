package manager_test

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/sqlite"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/local"
)

// host is a manager on the in-memory engine (engine/fake): a real database,
// plain-file snapshot store and image store in a temporary directory, no root.
type host struct {
	t   *testing.T
	dir string
	eng *fake.Engine
	db  *sqlite.DB
	m   *manager.Manager
}

// hostOpts tune newHost.
type hostOpts struct {
	dir      string // reuse a data directory ("" = a new one)
	version  string // the fake engine's Version ("" = its default)
	timeouts manager.EngineTimeouts
	// eng reuses an engine whose instances outlived the previous host (crash).
	eng *fake.Engine
	// lifecycle is the manager's lifecycle configuration (VolumesDir is set).
	lifecycle manager.LifecycleConfig
	// limits are the manager's (admission.go).
	limits manager.LimitsConfig
	// wrap, when set, is the engine the manager gets, made from the fake one.
	wrap func(*fake.Engine) engine.Engine
	// node is the manager's node name (Config.Node; "" = none); with peer
	// set, the manager shares peer's database, image and snapshot stores
	// (another node of one cluster) and has its own engine.
	node string
	peer *host
	// store, when set, makes the host's snapshot store in its own data
	// directory dir (a node of a cluster with its own store on a shared
	// backend); nil: a plain-file store (the peer's, with peer set).
	store func(t *testing.T, dir string) snapshot.Store
	// db, when set, is the database the manager gets, made from the host's
	// (a test's hooks around its writes).
	db func(metadata.Store) metadata.Store
}

// newHost starts a manager (Reconcile included) on a fake engine.
func newHost(t *testing.T, o hostOpts) *host {
	t.Helper()
	dir := o.dir
	if dir == "" {
		dir = t.TempDir()
	}
	eng := o.eng
	if eng == nil {
		var err error
		if eng, err = fake.New(fake.Config{Dir: filepath.Join(dir, "fake"), Version: o.version}); err != nil {
			t.Fatal(err)
		}
	}
	var used engine.Engine = eng
	if o.wrap != nil {
		used = o.wrap(eng)
	}
	engines, err := engine.NewRegistry(eng.Name(), used)
	if err != nil {
		t.Fatal(err)
	}
	shared := dir
	if o.peer != nil {
		shared = o.peer.dir
	}
	db, err := sqlite.Open(filepath.Join(shared, "torpor.db"))
	if err != nil {
		t.Fatal(err)
	}
	images, err := image.Open(filepath.Join(shared, "images"), db)
	if err != nil {
		t.Fatal(err)
	}
	var store snapshot.Store
	if o.store != nil {
		store = o.store(t, dir)
	} else if store, err = local.New(filepath.Join(shared, "snapshots")); err != nil {
		t.Fatal(err)
	}
	agentBin := filepath.Join(dir, "agent-binary")
	if err := os.WriteFile(agentBin, []byte("not run: the fake engine serves the agent in-process"), 0o644); err != nil {
		t.Fatal(err)
	}
	var mdb metadata.Store = db
	if o.db != nil {
		mdb = o.db(db)
	}
	m, err := manager.New(manager.Config{
		Engines: engines, EngineTimeouts: o.timeouts, Store: store, DB: mdb, Images: images,
		GuestDir: filepath.Join(dir, "guest"), AgentPath: agentBin, AgentTimeout: 5 * time.Second,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		Lifecycle: withVolumes(o.lifecycle, filepath.Join(dir, "volumes")),
		Limits:    o.limits,
		Node:      o.node,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, _, err := images.Get(ctx, "tiny"); err != nil {
		if _, err := images.Import(ctx, "tiny", tinyRootfs(t), nil); err != nil {
			t.Fatalf("import image: %v", err)
		}
	}
	if err := m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	h := &host{t: t, dir: dir, eng: eng, db: db, m: m}
	t.Cleanup(h.close)
	return h
}

func withVolumes(c manager.LifecycleConfig, dir string) manager.LifecycleConfig {
	c.VolumesDir = dir
	return c
}

// close waits for the manager's background work, stops every instance and
// closes the database (the server's shutdown leaves instances running; a
// test's host must not).
func (h *host) close() {
	if h.db == nil {
		return
	}
	h.m.Wait()
	ctx := context.Background()
	infos, _ := h.eng.List(ctx)
	for _, i := range infos {
		h.eng.Stop(ctx, i.ID)
	}
	h.db.Close()
	h.db = nil
}

// crash ends the host as a killed server would: its instances keep running
// (the next host on the same engine finds them), its database is closed.
func (h *host) crash() {
	h.m.Wait()
	h.db.Close()
	h.db = nil
}

// tinyRootfs is a rootfs tar with one file: the fake engine never reads the
// image, but the manager resolves it.
func tinyRootfs(t *testing.T) io.Reader {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	body := []byte("tiny\n")
	tw.WriteHeader(&tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "etc/hostname", Mode: 0o644, Size: int64(len(body))})
	tw.Write(body)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return &b
}

func (h *host) create() sandbox.Sandbox {
	h.t.Helper()
	sb, err := h.m.Create(context.Background(), sandbox.Spec{Image: "tiny", MemoryMiB: 64})
	if err != nil {
		h.t.Fatalf("create: %v", err)
	}
	return sb
}

// record returns the persisted record of sandbox id.
func (h *host) record(id string) *metadata.Sandbox {
	h.t.Helper()
	s, err := h.db.GetSandbox(context.Background(), id)
	if err != nil {
		h.t.Fatalf("record %s: %v", id, err)
	}
	return s
}

// writeFile writes content to path in sandbox id through the manager.
func (h *host) writeFile(id, path, content string) {
	h.t.Helper()
	if err := h.m.WriteFile(context.Background(), id, path, bytes.NewReader([]byte(content)), int64(len(content))); err != nil {
		h.t.Fatalf("write %s in %s: %v", path, id, err)
	}
}

// readFile reads path in sandbox id through the manager.
func (h *host) readFile(id, path string) string {
	h.t.Helper()
	r, _, err := h.m.ReadFile(context.Background(), id, path)
	if err != nil {
		h.t.Fatalf("read %s in %s: %v", path, id, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		h.t.Fatal(err)
	}
	return string(b)
}
