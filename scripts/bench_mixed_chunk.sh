#!/usr/bin/env bash
# --enable-mixed-chunk off vs on, same run: `moeserve serve` (the embedded model on this machine's device) driven by
# `moeserve bench serving` with long random prompts that arrive while earlier requests decode (bounded concurrency,
# all requests queued at once), chunked prefill on in both. The two servers alternate ROUNDS times.
# Usage: scripts/bench_mixed_chunk.sh [extra serve flags...]; env: PY, PORT, ROUNDS, OUT, and the workload below.
set -uo pipefail
PY=${PY:-python3}
PORT=${PORT:-30123}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-/tmp/bench_mixed_chunk}
CHUNK=${CHUNK:-256}
INPUT_LEN=${INPUT_LEN:-1536}
OUTPUT_LEN=${OUTPUT_LEN:-64}
NUM_PROMPTS=${NUM_PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-8}
mkdir -p "$OUT"

run_one() {  # $1: off|on, $2: round; the rest: extra serve flags
  local mode=$1 round=$2
  shift 2
  local flag=()
  [ "$mode" = on ] && flag=(--enable-mixed-chunk)
  $PY -m moeserve.cli serve --port "$PORT" --chunked-prefill-size "$CHUNK" "${flag[@]}" "$@" \
    > "$OUT/server_${mode}_${round}.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  echo "== mixed chunk $mode, round $round (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  $PY -m moeserve.cli bench serving --port "$PORT" --dataset random --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" --random-range-ratio 0.5 --num-prompts "$NUM_PROMPTS" --request-rate inf \
    --max-concurrency "$CONCURRENCY" --disable-tqdm --output-file "$OUT/serving_${mode}_${round}.json" 2>&1 | tail -22
  kill -INT "$server"
  wait "$server"
}

for round in $(seq 1 "$ROUNDS"); do
  run_one off "$round" "$@"
  run_one on "$round" "$@"
done
