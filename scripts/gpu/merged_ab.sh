#!/usr/bin/env bash
# One GPU call: the GPU tests, then one-batch A/B (BASE_DIR = a baseline tree from `git archive`, default out/base) and
# FP8 beside bf16. Usage on the GPU machine from the repo root: bash scripts/gpu/merged_ab.sh [BASE_DIR]
set -uo pipefail
BASE=$(realpath "${1:-out/base}")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/setup.sh
SITE=${PYTHONPATH#*:}
echo "== tests $(date -u +%T)"
timeout 150 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/models/test_attention_ops.py \
  tests/kernels tests/models/test_gpu.py tests/rank/test_cuda_graph.py tests/models/test_fp8_gpu.py \
  -k "not v2_lite_dummy" 2>&1 | grep -E "FAIL|ERROR|Error|passed|failed" | tail -25
M="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --mem-fraction-static 0.5 --max-running-requests 256"
for side in A B; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== short $side $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 50 python3 -m moeserve.cli bench one-batch $M --repeat 2 \
    --context-length 512 --cuda-graph-max-bs 64 --input-len 128 --output-len 16 --batch-size 1 64 256 \
    2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
done
for side in A B; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== long $side $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 40 python3 -m moeserve.cli bench one-batch $M --repeat 2 \
    --context-length 4096 --disable-cuda-graph --input-len 2048 --output-len 2 --batch-size 4 \
    2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
done
echo "== fp8 gemm $(date -u +%T)"
timeout 70 python3 scripts/gpu/fp8_bench.py --result-file "$OUT/fp8_gemm.jsonl" 2>&1 | tail -14
for quant in "" "--quantization fp8"; do
  echo "== one-batch v2-lite ${quant:-bf16} $(date -u +%T)"
  timeout 80 python3 -m moeserve.cli bench one-batch $M --context-length 1024 --cuda-graph-max-bs 256 $quant \
    --batch-size 64 256 --input-len 128 --output-len 32 2>&1 | grep -E "^batch|Memory|memory|Error|error|Traceback" | grep -v Warning
done
echo "== done $(date -u +%T)"
