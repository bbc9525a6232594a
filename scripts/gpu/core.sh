#!/usr/bin/env bash
# GPU run for the core engine: parity tests on CUDA (CUDA graphs, torch.compile), then one-batch throughput on a
# DeepSeek-V2-Lite-shaped dummy model (bf16) beside transformers, eager+graphs and compiled+graphs.
# Usage on the GPU machine: bash scripts/gpu/core.sh
set -uo pipefail
source scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 -m pytest tests/models tests/rank/test_generation.py tests/rank/test_cuda_graph.py \
  tests/rank/test_torch_compile.py -q -x -p no:cacheprovider 2>&1 | tail -4
V2LITE="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.5 --max-running-requests 64 --input-len 128 --output-len 64"
python3 -m moeserve.cli bench one-batch $V2LITE --batch-size 1 64 --compare-transformers \
  --result-file "$OUT/one_batch_gpu.jsonl" 2>&1 | grep -E "^batch|Error|error|Traceback"
python3 -m moeserve.cli bench one-batch $V2LITE --batch-size 1 64 --repeat 3 --enable-torch-compile \
  --torch-compile-max-bs 64 --result-file "$OUT/one_batch_gpu_compiled.jsonl" 2>&1 \
  | grep -E "^batch|compiled in|Error|error|Traceback"
