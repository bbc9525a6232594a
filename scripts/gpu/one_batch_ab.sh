#!/usr/bin/env bash
# One-batch decode and prefill of the V2-Lite-shaped dummy model (bf16, CUDA graphs) at two trees, alternating
# A B A B, so a change is measured against its baseline in the same run and with the same invocation.
# Usage on the GPU machine: [ORDER="A B A B"] bash scripts/gpu/one_batch_ab.sh A_DIR B_DIR [batch sizes...]
#   A_DIR, B_DIR: copies of moeserve/ and benchmarks/ (e.g. `git archive REV moeserve benchmarks | tar -x -C DIR`).
set -uo pipefail
A=$(realpath "$1"); B=$(realpath "$2"); shift 2
SIZES=${*:-1 64 256}
source scripts/gpu/setup.sh
SITE=${PYTHONPATH#*:}  # the carried wheels' site dir
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ARGS="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.5 --max-running-requests 256 --input-len 128 --output-len 64 --repeat 3
  --batch-size $SIZES"
for side in ${ORDER:-A B A B}; do
  if [ "$side" = A ]; then tree=$A; else tree=$B; fi
  echo "== $side ($tree)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 -m moeserve.cli bench one-batch $ARGS \
    --result-file "$OUT/one_batch_ab_$side.jsonl" 2>&1 | grep -E "^batch|Error|error|Traceback")
done
