package server

import (
	"context"
	"net/http"
	"sync"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
)

// startLifecycle runs the manager's idle and timeout loop (unless disabled)
// and its warm pools' refill loop, and returns a function that stops them
// and waits for them to end (the pools' ready clones stopped).
func startLifecycle(m *manager.Manager, disabled bool) func() {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		m.RunPools(ctx)
	}()
	if !disabled {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.RunLifecycle(ctx)
		}()
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			wg.Wait()
		})
	}
}

func (s *Server) lifecycleRoutes(mux *http.ServeMux) {
	mux.HandleFunc("PATCH /v1/sandboxes/{id}", s.updateSandbox)
	mux.HandleFunc("POST /v1/volumes", s.createVolume)
	mux.HandleFunc("GET /v1/volumes", s.listVolumes)
	mux.HandleFunc("GET /v1/volumes/{name}", s.getVolume)
	mux.HandleFunc("DELETE /v1/volumes/{name}", s.deleteVolume)
}

func (s *Server) updateSandbox(w http.ResponseWriter, r *http.Request) {
	var req apiv1.UpdateSandboxRequest
	if err := decode(r, &req, false); err != nil {
		s.fail(w, r, err)
		return
	}
	sb, err := s.Manager.Update(r.Context(), r.PathValue("id"), policyUpdateFromWire(req))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, wireSandbox(sb))
}

func (s *Server) createVolume(w http.ResponseWriter, r *http.Request) {
	var req apiv1.CreateVolumeRequest
	if err := decode(r, &req, false); err != nil {
		s.fail(w, r, err)
		return
	}
	v, err := s.Manager.CreateVolume(r.Context(), req.Name)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, apiv1.Volume(v))
}

func (s *Server) listVolumes(w http.ResponseWriter, r *http.Request) {
	vs, err := s.Manager.ListVolumes(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.ListVolumesResponse{Volumes: wireVolumes(vs)})
}

func (s *Server) getVolume(w http.ResponseWriter, r *http.Request) {
	v, err := s.Manager.GetVolume(r.Context(), r.PathValue("name"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.Volume(v))
}

func (s *Server) deleteVolume(w http.ResponseWriter, r *http.Request) {
	if err := s.Manager.DeleteVolume(r.Context(), r.PathValue("name")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
