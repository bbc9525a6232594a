#!/usr/bin/env bash
# One GPU call for the Triton MLA decode kernel: its tests and the GPU model tests, the kernel beside the torch
# path (scripts/gpu/bench_mla_decode.py), then one-batch decode A/B against BASE_DIR (a tree from `git archive`
# without the kernel, default out/base). Usage on the GPU machine from the repo root:
#   bash scripts/gpu/mla_ab.sh [BASE_DIR]
set -uo pipefail
BASE=$(realpath "${1:-out/base}")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/setup.sh
SITE=${PYTHONPATH#*:}
echo "== tests $(date -u +%T)"
timeout 100 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/kernels/test_mla_decode.py \
  tests/models/test_gpu.py tests/rank/test_cuda_graph.py -k "not v2_lite_dummy" \
  2>&1 | grep -E "FAIL|ERROR|Error|passed|failed" | tail -25
echo "== kernel $(date -u +%T)"
timeout 100 python3 scripts/gpu/bench_mla_decode.py --result-file "$OUT/mla_decode.jsonl" 2>&1 | tail -12
M="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --mem-fraction-static 0.5"
for run in 1; do
  for side in A B; do
    if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
    echo "== decode $side run $run $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 70 python3 -m moeserve.cli bench one-batch $M --repeat 2 \
      --context-length 4096 --max-running-requests 256 --input-len 128 --output-len 64 --batch-size 1 64 256 \
      2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 60 python3 -m moeserve.cli bench one-batch $M --repeat 2 \
      --context-length 4096 --max-running-requests 64 --input-len 2048 --output-len 32 --batch-size 64 \
      2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
  done
done
echo "== done $(date -u +%T)"
