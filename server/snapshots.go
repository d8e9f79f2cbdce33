package server

import (
	"net/http"

	"github.com/torpor/torpor/apiv1"
)

// snapshotRoutes: visibility and explicit delete of snapshots (docs/api.md).
func (s *Server) snapshotRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/snapshots", s.listSnapshots)
	mux.HandleFunc("GET /v1/snapshots/{id}", s.getSnapshot)
	mux.HandleFunc("DELETE /v1/snapshots/{id}", s.deleteSnapshot)
	mux.HandleFunc("POST /v1/snapshots/{id}/verify", s.verifySnapshot)
	mux.HandleFunc("GET /v1/store", s.storeUsage)
}

func (s *Server) storeUsage(w http.ResponseWriter, r *http.Request) {
	u, err := s.Manager.StoreUsage(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	u.Kind = s.StoreKind
	writeJSON(w, http.StatusOK, WireStoreUsage(u))
}

func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) {
	snaps, err := s.Manager.ListSnapshots(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.ListSnapshotsResponse{Snapshots: wireSnapshots(snaps)})
}

func (s *Server) getSnapshot(w http.ResponseWriter, r *http.Request) {
	snap, err := s.Manager.GetSnapshot(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.Snapshot(snap))
}

func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	if err := s.Manager.DeleteSnapshot(r.Context(), r.PathValue("id")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) verifySnapshot(w http.ResponseWriter, r *http.Request) {
	// No options: an empty body or {} (anything else is refused, as for resume).
	if err := decode(r, &struct{}{}, true); err != nil {
		s.fail(w, r, err)
		return
	}
	res, err := s.Manager.VerifySnapshot(r.Context(), r.PathValue("id"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiv1.VerifySnapshotResponse(res))
}
