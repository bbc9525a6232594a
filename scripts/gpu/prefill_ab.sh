#!/usr/bin/env bash
# One GPU call for the batched prefill attention and the direct Triton launches: GPU tests, then `bench one-batch`
# on a baseline tree (A) and this tree (B), A then B, prefill 1/64/256 x 128 with decode at those batches, then
# prefill 4 x 2048; then launch_overhead.py and prefill_stalls.py on B.
# Usage on the GPU machine, from this tree's root:  bash scripts/gpu/prefill_ab.sh BASE_DIR
#   BASE_DIR: a copy of the baseline tree (e.g. `git archive gpu | tar -x -C DIR`). Results: $OUT/log, $OUT/*.jsonl.
set -uo pipefail
BASE=$(realpath "$1")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/setup.sh
SITE=${PYTHONPATH#*:}
M="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --mem-fraction-static 0.5
  --max-running-requests 256"
echo "== tests $(date -u +%T)"
timeout "${TEST_S:-75}" python3 -m pytest -o addopts="" -v -p no:cacheprovider tests/models/test_attention_ops.py \
  tests/kernels/test_direct_launch.py tests/models/test_gpu.py tests/rank/test_cuda_graph.py \
  tests/kernels/test_kernels_gpu.py -k "not v2_lite_dummy" 2>&1 | grep -E "PASS|FAIL|ERROR|Error|passed|failed" \
  | grep -v "^tests/.*PASSED" | tail -30
for side in A B; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== short $side $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout "${SHORT_S:-45}" python3 -m moeserve.cli bench one-batch $M --repeat ${REPEAT:-2} \
    --context-length 512 --cuda-graph-max-bs 64 --input-len 128 --output-len 16 --batch-size 1 64 256 \
    --result-file "$OUT/short_$side.jsonl" 2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
done
for side in A B; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== long $side $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout "${LONG_S:-35}" python3 -m moeserve.cli bench one-batch $M --repeat ${REPEAT:-2} \
    --context-length 4096 --disable-cuda-graph --input-len 2048 --output-len 2 --batch-size 4 \
    --result-file "$OUT/long_$side.jsonl" 2>&1 | grep -E "^batch|Error|error" | grep -v Warning)
done
echo "== launch overhead (B) $(date -u +%T)"
timeout 20 python3 scripts/gpu/launch_overhead.py 2>&1 | grep -v Warning
echo "== prefill stalls (B) $(date -u +%T)"
timeout "${STALL_S:-35}" python3 scripts/gpu/prefill_stalls.py $M --context-length 512 --disable-cuda-graph \
  --batch-size 64 2>&1 | grep -E "^bs|Error|error" | grep -v Warning
echo "== done $(date -u +%T)"
