#!/usr/bin/env bash
# Runs a benchmark against a fresh server on a scratch data directory and stops
# that server (by its pid) afterwards: `scripts/bench.sh [resume|standby|pool] ARGS…`
# (resume when the first argument names no benchmark). ARGS go to
# `torpor bench resume`, `torpor bench standby` or `torpor bench pool`;
# TORPOR_SERVE_FLAGS are added to the server's command line (e.g.
# TORPOR_SERVE_FLAGS="--prepared-containers 1").
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/torpor-bench-XXXXXX)
port=${TORPOR_BENCH_PORT:-7079}
if curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1; then
  echo "bench: another server answers on port $port; set TORPOR_BENCH_PORT" >&2
  rm -rf "$dir"
  exit 1
fi
# shellcheck disable=SC2086 # TORPOR_SERVE_FLAGS is a list of flags
bin/torpor serve --data-dir "$dir" --listen "127.0.0.1:$port" ${TORPOR_SERVE_FLAGS:-} >"$dir/serve.log" 2>&1 &
pid=$!
cleanup() {
  TORPOR_URL="http://127.0.0.1:$port" bin/torpor ls --json 2>/dev/null |
    python3 -c 'import json,sys; [print(s["id"]) for s in json.load(sys.stdin)["sandboxes"]]' 2>/dev/null |
    while read -r id; do TORPOR_URL="http://127.0.0.1:$port" bin/torpor rm "$id" >/dev/null 2>&1 || true; done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  umount -l "$dir/gvisor/root/null-netns" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
case "${1:-}" in
standby) shift; TORPOR_URL="http://127.0.0.1:$port" bin/torpor bench standby "$@" ;;
pool) shift; TORPOR_URL="http://127.0.0.1:$port" bin/torpor bench pool "$@" ;;
resume) shift; TORPOR_URL="http://127.0.0.1:$port" bin/torpor bench resume --data-dir "$dir" "$@" ;;
*) TORPOR_URL="http://127.0.0.1:$port" bin/torpor bench resume --data-dir "$dir" "$@" ;;
esac
