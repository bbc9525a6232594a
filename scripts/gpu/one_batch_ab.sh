#!/usr/bin/env bash
# One-batch decode and prefill of the V2-Lite-shaped dummy model (bf16, CUDA graphs), at another tree (A) and at
# this working tree (B), alternating A B A B, so a change is measured against its baseline in the same run.
# Usage on the GPU machine: [ORDER="A B A B"] bash scripts/gpu/one_batch_ab.sh OLD_TREE_DIR [batch sizes...]
#   OLD_TREE_DIR: a copy of the baseline's moeserve/ and benchmarks/ (e.g. `git archive REV moeserve benchmarks`).
set -uo pipefail
OLD=$1; shift
SIZES=${*:-1 64 256}
source scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE_PATH=$PYTHONPATH
ARGS="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.5 --max-running-requests 256 --input-len 128 --output-len 64 --batch-size $SIZES"
for side in ${ORDER:-A B A B}; do
  if [ "$side" = A ]; then tree=$OLD; else tree=$PWD; fi
  echo "== $side ($tree)"
  (cd "$tree" && PYTHONPATH="$tree:${BASE_PATH#*:}" python3 -m moeserve.cli bench one-batch $ARGS \
    --result-file "$OUT/one_batch_ab_$side.jsonl" 2>&1 | grep -E "^batch|Error|error|Traceback")
done
