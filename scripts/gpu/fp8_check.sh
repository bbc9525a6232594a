#!/usr/bin/env bash
# FP8 on the GPU machine: the Triton FP8 kernels against their torch references (exact activation quantization on
# hardware), the FP8 model on CUDA against the CPU path and with CUDA graphs, then the FP8 GEMM benchmark beside
# torch._scaled_mm and bf16, and one-batch decode/prefill of V2-Lite- and V3-layer-shaped dummy models, bf16 beside
# --quantization fp8. Usage: bash scripts/gpu/fp8_check.sh   (results in $OUT)
set -uo pipefail
source scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 400 python3 -m pytest -o addopts="" -q -x -s -p no:cacheprovider tests/kernels/test_fp8_kernels.py \
  tests/models/test_fp8_gpu.py tests/models/test_fp8.py 2>&1 | tail -8
timeout 300 python3 scripts/gpu/fp8_bench.py --result-file "$OUT/fp8_gemm.jsonl" 2>&1 | tail -20
for model in deepseek-v2-lite deepseek-v3-4layer; do
  for quant in "" "--quantization fp8"; do
    timeout 300 python3 -m moeserve.cli bench one-batch --model-path benchmarks/configs/$model --load-format dummy \
      --dtype bfloat16 --context-length 4096 --mem-fraction-static 0.85 --max-running-requests 256 $quant \
      --batch-size 64 256 --input-len 128 --output-len 32 \
      --result-file "$OUT/one_batch_${model}${quant:+_fp8}.jsonl" 2>&1 | grep -E "^batch|Memory|Error|error|Traceback"
  done
done
