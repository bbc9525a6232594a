#!/usr/bin/env bash
# `bench one-batch --profile` on a baseline tree (A) and this tree (B), one after the other, with the same flags.
# Usage on the GPU machine, from this tree's root:  bash scripts/gpu/profile_ab.sh BASE_DIR TAG [one-batch flags...]
#   BASE_DIR: a copy of the baseline's moeserve/ and benchmarks/; its bench/one_batch.py and bench/step_profile.py are
#   replaced by this tree's, so both sides print the same table. Results: ${RESULTS:-$OUT}/TAG_{A,B}.jsonl; the
#   traces of batch TRACE_BS: $OUT/trace_TAG_{A,B}_{prefill,decode}.json.gz when TRACE_BS is set.
set -uo pipefail
BASE=$(realpath "$1"); TAG=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=${PYTHONPATH#*:}
cp moeserve/bench/one_batch.py moeserve/bench/step_profile.py "$BASE/moeserve/bench/"
for side in ${ORDER:-A B}; do
  if [ "$side" = A ]; then tree=$BASE; else tree=$PWD; fi
  echo "== $TAG $side ($tree) $(date -u +%T)"
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout "${BENCH_S:-170}" python3 -m moeserve.cli bench one-batch "$@" \
    --profile --profile-dir /tmp/prof --result-file "${RESULTS:-$OUT}/${TAG}_$side.jsonl" 2>&1 \
    | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy weights")
  if [ -n "${TRACE_BS:-}" ]; then
    cp "/tmp/prof/one_batch_bs$TRACE_BS.json.gz" "$OUT/trace_${TAG}_${side}_decode.json.gz"
    cp "/tmp/prof/one_batch_prefill_bs$TRACE_BS.json.gz" "$OUT/trace_${TAG}_${side}_prefill.json.gz"
  fi
  rm -rf /tmp/prof
done
