#!/usr/bin/env bash
# Multi-turn conversations whose histories outgrow the device KV pool: TTFT and input throughput with the
# hierarchical KV cache off, host memory only, and host plus the file storage tier, in one run (docs/BENCHMARKS.md);
# beside them device_all, no hierarchy and a device pool that holds the whole working set: every prompt's cached
# part found in place and nothing to load, the bound any cache tier can reach on this workload.
#   [EXTRA="--dtype bfloat16"] [BASELINE=/path/to/other/checkout] bash benchmark/experiments/hicache_multiturn.sh [OUT_DIR]
# BASELINE: also run that checkout's off and host + file servers (named base_off, base_host_file), interleaved with
# this tree's four, for an A/B of two trees in the same minutes (`git worktree add /tmp/base <rev>`).
# The embedded default model on CPU, a device pool of 2,048 tokens (--max-total-tokens; device_all's 32k), a host
# pool of twice that; 24 conversations of 6 turns (a shared 512-token system prompt, 64-token user turns, 32-token
# answers): a working set of about 14k tokens, so the host pool overflows too and the file tier holds the rest. One
# request in flight, so TTFT is the prefill of what is not cached (not queueing behind other requests). Pages of 16
# tokens in all (a storage tier stores a file per page: with pages of 1 its writes, a file per token, took the CPU
# from the prefills they ran beside, 2.7x on the forward in benchmark/experiments/hicache_phases.py).
# The servers run at once and take the turns in turn (hicache_interleaved.py): an idle server waits in a blocking
# poll, and the VM's drift over the run falls on all of them alike.
set -euo pipefail
OUT=$(realpath -m "${1:-/tmp/hicache_bench}")
PY=${PY:-.venv/bin/python}
PORT=${PORT:-31870}
rm -rf "$OUT" && mkdir -p "$OUT"
# EXTRA: more server flags for all of them, e.g. EXTRA="--dtype bfloat16" (--dtype auto is float32 on the CPU)
# shellcheck disable=SC2206
COMMON=(--page-size 16 --log-level warning ${EXTRA:-})
POOL="--max-total-tokens 2048"  # the device pool of the three servers the working set outgrows
HOST="$POOL --enable-hierarchical-cache --hicache-ratio 2"
declare -A MODES=(
  [off]="$POOL"
  [host]="$HOST"
  [host_file]="$HOST --hicache-storage-backend file --hicache-storage-backend-extra-config {\"path\":\"@PAGES@\"}"
  [device_all]="--max-total-tokens 32768"
)
pids=()
servers=()
trap 'for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait' EXIT
port=$PORT
PY=$(realpath -s "$(command -v "$PY")")  # absolute, the venv's link kept (the servers run from other directories)
# serve TREE NAME MODE: a server of checkout TREE (run from there, its own moeserve first on the path)
serve() {
  local flags=${MODES[$3]//@PAGES@/$OUT/pages_$2}
  # shellcheck disable=SC2086
  (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m moeserve.cli serve "${COMMON[@]}" --port "$port" $flags \
    > "$OUT/server_$2.log" 2>&1) &
  pids+=($!)
  servers+=(--server "$2=http://localhost:$port")
  port=$((port + 1))
}
for mode in off host host_file device_all; do
  serve "$PWD" "$mode" "$mode"
done
if [ -n "${BASELINE:-}" ]; then
  for mode in off host_file; do
    serve "$(realpath "$BASELINE")" "base_$mode" "$mode"
  done
fi
$PY benchmark/experiments/hicache_interleaved.py "${servers[@]}" --out "$OUT" --conversations 24 --turns 6 \
  --system-len 512 --user-len 64 --output-len 32 --seed 1 | tee "$OUT/table.txt"
