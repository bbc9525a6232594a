#!/usr/bin/env bash
# Decode tok/s without and with speculative decoding (NEXTN at each draft count), one model, one machine, back to
# back: `bash benchmark/experiments/spec_one_batch.sh [OUT_DIR] [bench one-batch flags...]`.
# Defaults: the embedded default model (its trained MTP layer), batch 1 / 8 / 32, 64-token prompts, 64 tokens out.
# On the GPU machine: `source benchmark/setup.sh` first; e.g. the V3-layer model (dummy weights: its MTP layer is
# random, so the accept length is ~1 and the figure is what a round costs):
#   bash benchmark/experiments/spec_one_batch.sh $OUT --model-path benchmarks/configs/deepseek-v3-4layer \
#     --load-format dummy --mem-fraction-static 0.85 --batch-size 1 8 64
set -u
out=${1:-/tmp/spec_one_batch}; shift || true
mkdir -p "$out"
STEPS=${STEPS:-"0 1 2 3"}
PY=${PY:-python3}
for k in $STEPS; do
  spec=()
  [ "$k" -gt 0 ] && spec=(--speculative-algorithm NEXTN --speculative-num-steps "$k")
  echo "=== k=$k $*"
  timeout "${TIMEOUT:-300}" "$PY" -m moeserve.cli bench one-batch --batch-size 1 8 32 --input-len 64 --output-len 64 \
    --repeat 2 "$@" "${spec[@]}" --result-file "$out/k$k.jsonl" 2>&1 | grep -E "^batch|Error|error" | tail -8
done
