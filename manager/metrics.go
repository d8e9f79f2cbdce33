package manager

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/torpor/torpor/sandbox"
)

// Metrics are the manager's Prometheus metrics.
type Metrics struct {
	hibernate     prometheus.Histogram
	resume        prometheus.Histogram
	unpause       prometheus.Histogram
	pauses        prometheus.Counter
	demotions     *prometheus.CounterVec
	snapshotBytes prometheus.Counter
	created       prometheus.Counter
	forked        prometheus.Counter
	refused       prometheus.Counter
	poolTaken     prometheus.Counter
	poolFilled    prometheus.Counter
	// resumesWaiting: resumes admitted and waiting for their turn to
	// restore (LimitsConfig.Restores).
	resumesWaiting prometheus.Gauge
}

// Buckets in seconds: 10 ms to ~40 s, for hibernate and resume durations
// (measured: 0.1–1.5 s on this machine, docs/benchmarks/).
var durationBuckets = prometheus.ExponentialBuckets(0.01, 2, 13)

// NewMetrics makes the metrics and registers them with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		hibernate: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "torpor_hibernate_duration_seconds", Help: "Time from hibernate call to committed snapshot.", Buckets: durationBuckets}),
		resume: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "torpor_resume_duration_seconds", Help: "Time from resume call to a guest agent answering.", Buckets: durationBuckets}),
		unpause: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "torpor_unpause_duration_seconds", Help: "Time from the call that woke a paused sandbox to its resume contract done.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}),
		pauses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_sandboxes_paused_total", Help: "Pauses (running to paused)."}),
		demotions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "torpor_paused_demotions_total", Help: "Paused sandboxes hibernated, by cause (idle, standby_budget, call, exited)."},
			[]string{"cause"}),
		snapshotBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_snapshot_bytes_written_total", Help: "Bytes of snapshot files committed."}),
		created: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_sandboxes_created_total", Help: "Sandboxes created."}),
		forked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_sandboxes_forked_total", Help: "Clones made by fork."}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_admission_refused_total", Help: "Creates, resumes and forks refused because the host's memory would be exceeded."}),
		poolTaken: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_pool_clones_taken_total", Help: "Warm pools' ready clones taken by creates, forks and starts from snapshots."}),
		poolFilled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "torpor_pool_clones_made_total", Help: "Ready clones made by the warm pools' refill."}),
		resumesWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "torpor_resumes_waiting", Help: "Resumes of hibernated sandboxes waiting for their turn to restore (serve --restores)."}),
	}
	if reg != nil {
		reg.MustRegister(m.hibernate, m.resume, m.unpause, m.pauses, m.demotions, m.snapshotBytes, m.created, m.forked, m.refused,
			m.poolTaken, m.poolFilled, m.resumesWaiting)
	}
	return m
}

// StateCollector reports torpor_sandboxes{state=…}, read from the database at
// scrape time so it can never drift from what the API reports.
type StateCollector struct {
	M    *Manager
	desc *prometheus.Desc
}

// NewStateCollector returns a collector for m.
func NewStateCollector(m *Manager) *StateCollector {
	return &StateCollector{M: m, desc: prometheus.NewDesc("torpor_sandboxes", "Sandboxes by state.", []string{"state"}, nil)}
}

// Describe implements prometheus.Collector.
func (c *StateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *StateCollector) Collect(ch chan<- prometheus.Metric) {
	counts := map[sandbox.State]int{}
	for _, st := range []sandbox.State{sandbox.StateCreating, sandbox.StateRunning, sandbox.StatePaused, sandbox.StateHibernating,
		sandbox.StateHibernated, sandbox.StateResuming, sandbox.StateError} {
		counts[st] = 0
	}
	if all, err := c.M.List(context.Background()); err == nil {
		for _, s := range all {
			counts[s.State]++
		}
	}
	for st, n := range counts {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), string(st))
	}
}

// StoreCollector reports the snapshot store's footprint (Manager.StoreUsage)
// at scrape time: torpor_store_snapshots and torpor_store_*_bytes gauges.
type StoreCollector struct {
	M     *Manager
	descs map[string]*prometheus.Desc
}

// NewStoreCollector returns a collector for m's snapshot store.
func NewStoreCollector(m *Manager) *StoreCollector {
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, nil) }
	return &StoreCollector{M: m, descs: map[string]*prometheus.Desc{
		"snapshots":      d("torpor_store_snapshots", "Committed snapshots."),
		"logical":        d("torpor_store_logical_bytes", "Sum of the committed snapshots' logical sizes."),
		"stored":         d("torpor_store_stored_bytes", "Bytes the durable tier holds (packs and loose chunks; a plain store's files)."),
		"chunks":         d("torpor_store_chunk_bytes", "Compressed bytes of the distinct chunks in the durable tier."),
		"pending_upload": d("torpor_store_pending_upload_bytes", "Bytes in the local outbox waiting for an asynchronous upload."),
		"local":          d("torpor_store_local_bytes", "Bytes kept on this host besides the durable tier (opened copies, cache, outbox, staging)."),
	}}
}

// Describe implements prometheus.Collector.
func (c *StoreCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector; nothing is reported when the usage
// cannot be read.
func (c *StoreCollector) Collect(ch chan<- prometheus.Metric) {
	u, err := c.M.StoreUsage(context.Background())
	if err != nil {
		c.M.log.Warn("metrics: snapshot store usage", "err", err)
		return
	}
	for k, v := range map[string]float64{"snapshots": float64(u.Snapshots), "logical": float64(u.LogicalBytes),
		"stored": float64(u.StoredBytes), "chunks": float64(u.ChunkBytes),
		"pending_upload": float64(u.PendingUploadBytes), "local": float64(u.LocalBytes)} {
		ch <- prometheus.MustNewConstMetric(c.descs[k], prometheus.GaugeValue, v)
	}
}
