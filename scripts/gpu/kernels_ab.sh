#!/usr/bin/env bash
# One GPU call for the Triton MoE kernels: their GPU tests, a tuning run that writes the launch tables into this
# tree, then `bench one-batch --profile` on a baseline tree (A) and this tree (B), one after the other.
# Usage on the GPU machine, from this tree's root:  bash scripts/gpu/kernels_ab.sh BASE_DIR [batch sizes...]
#   BASE_DIR: a copy of the baseline's moeserve/ and benchmarks/ (e.g. `git archive main | tar -x -C DIR`); its
#   bench/one_batch.py and bench/step_profile.py are replaced by this tree's so both sides print the same table.
# Results under $OUT: log, tune_stats.jsonl, configs.tar, ab_A.jsonl, ab_B.jsonl, trace_A_bs64.json.gz, trace_B_...
set -uo pipefail
BASE=$(realpath "$1"); shift
SIZES=${*:-1 64 256}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/gpu/setup.sh
SITE=${PYTHONPATH#*:}
echo "== tests $(date -u +%T)"
timeout "${TEST_S:-110}" python3 -m pytest -o addopts="" -q -x tests/kernels/test_kernels_gpu.py \
  tests/rank/test_cuda_graph.py tests/models/test_gpu.py -k "not v2_lite_dummy" 2>&1 | tail -25
echo "== tune $(date -u +%T)"
timeout "${TUNE_S:-150}" python3 scripts/gpu/tune_moe.py --tokens ${TUNE_TOKENS:-1 64 256 2048 8192} \
  --stats "$OUT/tune_stats.jsonl" 2>&1 | grep -v "^  skip"
tar -cf "$OUT/configs.tar" moeserve/kernels/configs
cp moeserve/bench/one_batch.py moeserve/bench/step_profile.py "$BASE/moeserve/bench/"
ARGS="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.5 --max-running-requests 256 --input-len 128 --output-len 64 --repeat ${REPEAT:-2}
  --batch-size $SIZES --profile --profile-dir /tmp/prof"
for side in A B; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== $side ($tree) $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout "${BENCH_S:-170}" python3 -m moeserve.cli bench one-batch $ARGS \
    --result-file "$OUT/ab_$side.jsonl" 2>&1 | grep -vE "^\s*$|it/s\]|Warning|warn")
  cp /tmp/prof/one_batch_bs64.json.gz "$OUT/trace_${side}_bs64.json.gz" 2>/dev/null
  rm -rf /tmp/prof
done
echo "== done $(date -u +%T)"
