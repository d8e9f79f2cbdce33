package server

import (
	"archive/tar"
	"bytes"
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/engine/fake"
)

// StartFake starts a server with cfg on the in-memory engine (engine/fake: no
// root, no runsc) in a new data directory with the plain store, no lifecycle
// loop and image "tiny" (an empty root filesystem), served over real HTTP on
// loopback and stopped at the test's end. cfg's DataDir, AgentPath, Engines,
// Store and DisableLifecycle are set by it. It returns the server, its URL,
// the data directory and the engine. Exported for the server_test package.
func StartFake(t *testing.T, cfg Config) (*Server, string, string, *fake.Engine) {
	t.Helper()
	dir := t.TempDir()
	eng, engines, agent := fakeEngines(t, dir)
	ctx := context.Background()
	cfg.DataDir, cfg.AgentPath, cfg.Engines, cfg.Store, cfg.DisableLifecycle = dir, agent, engines, StoreConfig{Kind: "plain"}, true
	srv, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		hs.Close()
		infos, _ := eng.List(ctx)
		for _, i := range infos {
			eng.Stop(ctx, i.ID)
		}
		srv.Close()
	})
	var tiny bytes.Buffer
	tw := tar.NewWriter(&tiny)
	tw.WriteHeader(&tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.Close()
	if _, err := srv.Images.Import(ctx, "tiny", &tiny, nil); err != nil {
		t.Fatalf("import image: %v", err)
	}
	return srv, hs.URL, dir, eng
}

// fakeEngines makes the in-memory engine (its state in dir/fake), a
// registry of it alone and a stand-in agent binary file in dir.
func fakeEngines(t *testing.T, dir string) (*fake.Engine, *engine.Registry, string) {
	t.Helper()
	eng, err := fake.New(fake.Config{Dir: filepath.Join(dir, "fake")})
	if err != nil {
		t.Fatal(err)
	}
	engines, err := engine.NewRegistry(eng.Name(), eng)
	if err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "agent-binary")
	if err := os.WriteFile(agent, []byte("not run: the fake engine serves the agent in-process"), 0o644); err != nil {
		t.Fatal(err)
	}
	return eng, engines, agent
}
