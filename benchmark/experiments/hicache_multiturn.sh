#!/usr/bin/env bash
# Multi-turn conversations whose histories outgrow the device KV pool: TTFT and input throughput with the
# hierarchical KV cache off, host memory only, and host plus the file storage tier, in one run (docs/BENCHMARKS.md).
#   bash benchmark/experiments/hicache_multiturn.sh [OUT_DIR]
# The embedded default model on CPU, a device pool of 2,048 tokens (--max-total-tokens), a host pool of twice
# that; 24 conversations of 6 turns (a shared 512-token system prompt, 64-token user turns, 32-token answers):
# a working set of about 14k tokens, so the host pool overflows too and the file tier holds the rest. One request
# in flight, so TTFT is the prefill of what is not cached (not queueing behind other requests). Pages of 16
# tokens in all three (a storage tier stores a file per page: with pages of 1 its writes, a file per token, took
# the CPU from the prefills they ran beside, 2.7x on the forward in benchmark/experiments/hicache_phases.py).
set -euo pipefail
OUT=${1:-/tmp/hicache_bench}
PY=${PY:-.venv/bin/python}
PORT=${PORT:-31870}
rm -rf "$OUT" && mkdir -p "$OUT"
COMMON=(--max-total-tokens 2048 --page-size 16 --port "$PORT" --log-level warning)
BENCH=(--port "$PORT" --dataset multiturn --multiturn-num-conversations 24 --multiturn-turns 6
       --multiturn-system-prompt-len 512 --multiturn-user-len 64 --multiturn-output-len 32 --max-concurrency 1
       --seed 1 --disable-tqdm)
declare -A MODES=(
  [off]=""
  [host]="--enable-hierarchical-cache --hicache-ratio 2"
  [host_file]="--enable-hierarchical-cache --hicache-ratio 2 --hicache-storage-backend file --hicache-storage-backend-extra-config {\"path\":\"$OUT/pages\"}"
)
for mode in off host host_file; do
  # shellcheck disable=SC2086
  $PY -m moeserve.cli serve "${COMMON[@]}" ${MODES[$mode]} > "$OUT/server_$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  echo "=== $mode"
  $PY -m moeserve.cli bench serving "${BENCH[@]}" --output-file "$OUT/$mode.json" | tee "$OUT/bench_$mode.txt"
  kill -INT $pid; wait $pid || true
done
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
print(f"{'mode':<10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'input tok/s':>12} {'cached':>8}")
for mode in ("off", "host", "host_file"):
    s = json.load(open(f"{out}/{mode}.json"))["summary"]
    print(f"{mode:<10} {s['ttft_ms']['median']:>12.1f} {s['ttft_ms']['p99']:>12.1f} {s['input_throughput']:>12.1f} "
          f"{100 * s['cached_token_rate']:>7.1f}%")
PYEOF
