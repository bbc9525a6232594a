#!/usr/bin/env bash
# GPU run of `moeserve bench pd`: one colocated server, then a prefill and a decode server as two processes on the
# same GPU behind sglang-router, on a DeepSeek-V2-Lite-shaped dummy model (bf16, CUDA graphs), concurrency 64.
# PD uses the zmq backend: it copies CUDA KV pages through host memory; the mooncake wheel for machines without
# CUDA (the one that installs here) refuses CUDA buffers.
# Both PD servers size their KV pool with --max-total-tokens: --mem-fraction-static counts the memory the other
# process on the GPU holds as used, so a split of fractions does not divide the GPU between two servers.
# Needs sglang-router, orjson and setproctitle as cp312 wheels in .whl/ beside the others (benchmark/setup.sh).
#   benchmark/experiments/pd_bench.sh [more bench flags]       environment: OUT (results), MODEL_FLAGS, SIZE_FLAGS
set -uo pipefail
source benchmark/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the dummy model has no tokenizer: the embedded model's stands in (its ids fit the vocab); TOK overrides it
TOK=${TOK:-$(python3 -c "from moeserve.models.default_model import default_model_path; print(default_model_path())")}
MODEL_FLAGS=${MODEL_FLAGS:-"--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 \
  --context-length 4096 --max-running-requests 128 --cuda-graph-max-bs 128 --max-total-tokens 131072"}
SIZE_FLAGS=${SIZE_FLAGS:-"--random-input-len 512 --random-output-len 256 --random-range-ratio 0.5 --num-prompts 128 \
  --max-concurrency 64 --warmup-requests 64"}
# shellcheck disable=SC2086 # the flag lists split into words
exec python3 -m moeserve.cli bench pd --runs colocated zmq --dataset random --request-rate inf $SIZE_FLAGS \
  --disable-tqdm --log-dir "$OUT/logs" --output-file "$OUT/pd.json" "$@" -- $MODEL_FLAGS --tokenizer-path "$TOK"
