package server

import (
	"context"
	"net/http"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/sandbox"
)

// poolRoutes: warm pools of images and template snapshots (docs/api.md#warm-pools).
func (s *Server) poolRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/pools", s.listPools)
	mux.HandleFunc("PUT /v1/images/{name}/pool", s.setPool(s.Manager.SetImagePool, "name"))
	mux.HandleFunc("PUT /v1/snapshots/{id}/pool", s.setPool(s.Manager.SetSnapshotPool, "id"))
}

func (s *Server) listPools(w http.ResponseWriter, r *http.Request) {
	pools, err := s.Manager.ListPools(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := apiv1.ListPoolsResponse{Pools: make([]apiv1.Pool, 0, len(pools))}
	for _, p := range pools {
		out.Pools = append(out.Pools, apiv1.Pool(p))
	}
	writeJSON(w, http.StatusOK, out)
}

// setPool answers a PUT of a template's pool size with set (the manager's
// call for that kind of template, named by path value key).
func (s *Server) setPool(set func(ctx context.Context, name string, size int) (sandbox.Pool, error), key string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req apiv1.SetPoolRequest
		if err := decode(r, &req, false); err != nil {
			s.fail(w, r, err)
			return
		}
		if req.Size == nil {
			s.fail(w, r, invalidArgument("size: required (0 to %d)", manager.MaxPoolSize))
			return
		}
		p, err := set(r.Context(), r.PathValue(key), *req.Size)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, apiv1.Pool(p))
	}
}
