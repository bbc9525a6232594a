#!/usr/bin/env bash
# Throughput of a DeepSeek-V3-layer-shaped dummy model (V3's hidden size, 256 experts top-8, MLA; 4
# layers, 3 of them MoE: about 73 GB in bf16) on the GPUs of this machine. Usage: bash scripts/gpu/v3_layer.sh [TP]
# TP 1 is the EP 1 baseline; TP > 1 runs expert parallelism over NCCL (all2all auto, DP attention).
# Results land in $OUT as JSON lines.
set -uo pipefail
source scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TP=${1:-1}
PAR=""
if [ "$TP" -gt 1 ]; then PAR="--tp-size $TP --dp-size $TP --enable-dp-attention --moe-a2a-backend all2all"; fi
MODEL="--model-path benchmarks/configs/deepseek-v3-4layer --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.85 --max-running-requests 128"
if [ "$TP" -eq 1 ]; then  # static batches, prefill and decode apart (in-process, one rank)
  python3 -m moeserve.cli bench one-batch $MODEL --batch-size 1 128 --input-len 128 --output-len 64 \
    --result-file "$OUT/v3_layer_one_batch.jsonl" 2>&1 | grep -E "^batch|Error|error|Traceback"
fi
# the offline Engine (rank processes, as a server runs them): 256 prompts at once
python3 -m moeserve.cli bench offline $MODEL $PAR --num-prompts 256 --input-len 128 --output-len 64 --skip-tokenizer-init \
  --result-file "$OUT/v3_layer_offline_tp$TP.jsonl" 2>&1 | grep -vE "^Loading|it/s\]$"
