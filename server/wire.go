package server

import (
	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/sandbox"
	"net/netip"
)

// The REST API's mapping between the domain model (package sandbox), which the
// manager takes and returns, and the wire types of API v1 (package apiv1). Types
// whose fields are the same on both sides are converted directly, so a field
// added to one side only stops the build here; the others are mapped field by
// field. Nil slices stay nil and empty ones empty: the JSON tells them apart
// (null or [] where a field has no omitempty).

func wireSandbox(s sandbox.Sandbox) apiv1.Sandbox {
	w := apiv1.Sandbox{
		ID: s.ID, State: apiv1.State(s.State), Image: s.Image, ImageDigest: s.ImageDigest,
		MemoryMiB: s.MemoryMiB, PidsLimit: s.PidsLimit, CPUs: s.CPUs, Env: s.Env, Generation: s.Generation, ForkedFrom: s.ForkedFrom, Node: s.Node,
		Error: s.Error, CreatedAt: s.CreatedAt, StateChangedAt: s.StateChangedAt,
		LastHibernateAt: s.LastHibernateAt, LastResumeAt: s.LastResumeAt, ResumeMS: s.ResumeMS,
		IdleTimeoutS: s.IdleTimeoutS, PauseAfterS: s.PauseAfterS, TimeoutS: s.TimeoutS, OnTimeout: s.OnTimeout,
		Hibernation: apiv1.Hibernation(s.Hibernation), OnResume: s.OnResume,
		Volumes: wireVolumeMounts(s.Volumes), Usage: apiv1.Usage(s.Usage),
		LastResume: wireResumeReport(s.LastResume), ExpiresAt: s.ExpiresAt,
		InternetAccess: s.Network.InternetAccess, AllowOut: prefixStrings(s.Network.AllowOut),
		DenyOut: prefixStrings(s.Network.DenyOut),
	}
	if s.Snapshot != nil {
		snap := apiv1.Snapshot(*s.Snapshot)
		w.Snapshot = &snap
	}
	return w
}

// mapList maps each element of in with f; nil stays nil, empty stays empty.
func mapList[A, B any](in []A, f func(A) B) []B {
	if in == nil {
		return nil
	}
	out := make([]B, len(in))
	for i, a := range in {
		out[i] = f(a)
	}
	return out
}

func wireSandboxes(in []sandbox.Sandbox) []apiv1.Sandbox { return mapList(in, wireSandbox) }

func wireVolumeMounts(in []sandbox.VolumeMount) []apiv1.VolumeMount {
	return mapList(in, func(v sandbox.VolumeMount) apiv1.VolumeMount { return apiv1.VolumeMount(v) })
}

func wireResumeReport(r *sandbox.ResumeReport) *apiv1.ResumeReport {
	if r == nil {
		return nil
	}
	return &apiv1.ResumeReport{
		Event: r.Event, Generation: r.Generation, Forked: r.Forked, SnapshotID: r.SnapshotID,
		Steps: mapList(r.Steps, func(st sandbox.ResumeStep) apiv1.ResumeStep { return apiv1.ResumeStep(st) }),
		Clock: apiv1.ResumeClock(r.Clock), Subscribers: apiv1.ResumeSubscribers(r.Subscribers),
		Hooks: mapList(r.Hooks, func(h sandbox.ResumeHook) apiv1.ResumeHook { return apiv1.ResumeHook(h) }),
		OK:    r.OK, WindowMS: r.WindowMS, AgentMS: r.AgentMS, Error: r.Error,
	}
}

func wireSnapshots(in []sandbox.Snapshot) []apiv1.Snapshot {
	return mapList(in, func(s sandbox.Snapshot) apiv1.Snapshot { return apiv1.Snapshot(s) })
}

func wireVolumes(in []sandbox.Volume) []apiv1.Volume {
	return mapList(in, func(v sandbox.Volume) apiv1.Volume { return apiv1.Volume(v) })
}

func wireImages(in []sandbox.Image) []apiv1.Image {
	return mapList(in, func(img sandbox.Image) apiv1.Image { return apiv1.Image(img) })
}

// WireStoreUsage is the body of GET /v1/store for store usage u (the CLI's
// offline `snapshot usage` prints the same).
func WireStoreUsage(u sandbox.StoreUsage) apiv1.StoreUsage { return apiv1.StoreUsage(u) }

// specFromWire is the sandbox spec of a POST /v1/sandboxes body.
func specFromWire(r apiv1.CreateSandboxRequest) sandbox.Spec {
	return sandbox.Spec{
		Image: r.Image, MemoryMiB: r.MemoryMiB, PidsLimit: r.PidsLimit, CPUs: r.CPUs, Env: r.Env, IdleTimeoutS: r.IdleTimeoutS,
		PauseAfterS: r.PauseAfterS, TimeoutS: r.TimeoutS, OnTimeout: r.OnTimeout, HibernationMode: r.HibernationMode, OnResume: r.OnResume,
		ExpiresAt:      r.ExpiresAt,
		Volumes:        mapList(r.Volumes, func(v apiv1.VolumeMount) sandbox.VolumeMount { return sandbox.VolumeMount(v) }),
		InternetAccess: r.InternetAccess, AllowOut: r.AllowOut, DenyOut: r.DenyOut,
		// Its ports need an API key through torpor's port proxy; through
		// E2B's in-sandbox routing (which takes no key) they need its traffic
		// access token, as for E2B's allowPublicTraffic false: a sandbox made
		// through this API is never public there.
		PrivateTraffic: true,
	}
}

func prefixStrings(ps []netip.Prefix) []string { return mapList(ps, netip.Prefix.String) }

// policyUpdateFromWire is the policy change of a PATCH /v1/sandboxes/{id} body.
func policyUpdateFromWire(r apiv1.UpdateSandboxRequest) sandbox.PolicyUpdate {
	return sandbox.PolicyUpdate{
		IdleTimeoutS: r.IdleTimeoutS, PauseAfterS: r.PauseAfterS, TimeoutS: r.TimeoutS, OnTimeout: r.OnTimeout,
		HibernationMode: r.HibernationMode, OnResume: r.OnResume,
		ExpiresAt: sandbox.Expiry{Set: r.ExpiresAt.Set, At: r.ExpiresAt.At},
	}
}
