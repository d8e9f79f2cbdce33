// Package bench holds torpor's benchmarks. Resume (`torpor bench resume`, and
// BenchmarkResume under `go test -bench`) measures, per working-set size, against
// a running torpor server:
//
//   - hibernate time and snapshot size (from the hibernate answer);
//   - time to first request: from just before a GET /count sent through the port
//     proxy to a hibernated sandbox until its answer (that request resumes it),
//     checking that the workload's counter continued;
//   - exec latency of `true` on the running sandbox.
//
// In the same run it times raw runsc checkpoint and restore-to-first-answer of an
// equivalent container — the same image, the same workload process, no torpor
// server around it — through package engine/gvisor directly, so the result can say
// what torpor adds on top of runsc (ratio_p50). Percentiles are nearest-rank.
package bench
