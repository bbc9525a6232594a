#!/usr/bin/env bash
# GPU run for serving: `moeserve serve` on a DeepSeek-V2-Lite-shaped dummy model (bf16, CUDA graphs), driven by
# `moeserve bench serving` (random dataset, all requests at once, bounded concurrency).
# The dummy model has no tokenizer: the embedded default model's tokenizer stands in (its ids fit the vocab).
set -uo pipefail
source scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOK=$(python3 -c "from moeserve.models.default_model import default_model_path; print(default_model_path())")
python3 -m moeserve.cli serve --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy \
  --dtype bfloat16 --tokenizer-path "$TOK" --context-length 4096 --port 30000 --max-running-requests 128 \
  --cuda-graph-max-bs 128 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 120); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
for conc in 16 64 128; do
  python3 -m moeserve.cli bench serving --port 30000 --dataset random --random-input-len 512 \
    --random-output-len 256 --random-range-ratio 0.5 --num-prompts $((conc * 4)) --request-rate inf \
    --max-concurrency $conc --disable-tqdm --output-file "$OUT/serving_c${conc}.json" 2>&1 | tail -25
done
kill -INT $SERVER; wait $SERVER
tail -5 "$OUT/server.log"
