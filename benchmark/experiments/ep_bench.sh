#!/usr/bin/env bash
# Expert parallelism on N GPUs of one machine, against one GPU (EP 1), with and without two-batch overlap.
# Usage: bash benchmark/experiments/ep_bench.sh N PART, PART one of:
#   check     GPU dispatcher tests over NCCL, then benchmark/experiments/multi_gpu.py N (tokens vs the single-GPU run)
#   dispatch  dispatch/combine microbenchmark at DeepSeek-V3's shapes (hidden 7168, 256 experts, top-8)
#   v3        offline Engine on the DeepSeek-V3-layer-shaped dummy model: EP 1, EP N, EP N + TBO
#   v2        offline Engine and `moeserve serve` on the DeepSeek-V2-Lite-shaped dummy model: the same three
# EP N runs DP attention over the N GPUs with all2all dispatch (DeepEP mode auto). Results: JSON lines in $OUT.
set -uo pipefail
source benchmark/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${1:-2}; PART=${2:-check}
EPN="--tp-size $N --dp-size $N --enable-dp-attention --moe-a2a-backend all2all"
V3="--model-path benchmarks/configs/deepseek-v3-4layer --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.85"
V2="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096
  --mem-fraction-static 0.8"

offline() {  # offline TAG MODEL-ARGS...: 256 prompts of 128 tokens, 64 new tokens each, EP 1 / N / N + TBO
  local tag=$1; shift
  for par in "" "$EPN" "$EPN --enable-two-batch-overlap"; do
    echo "== $tag offline: ${par:-EP 1}"
    timeout 280 python3 -m moeserve.cli bench offline "$@" $par --num-prompts 256 --input-len 128 --output-len 64 \
      --max-running-requests 256 --skip-tokenizer-init --result-file "$OUT/${tag}_offline.jsonl" 2>&1 \
      | grep -vE "^Loading|it/s\]$" | tail -4
  done
}

case $PART in
  check)
    timeout 150 python3 -m pytest tests/ep/test_ep_cuda.py -q -p no:cacheprovider 2>&1 | tail -3
    timeout 400 python3 benchmark/experiments/multi_gpu.py "$N" 2>&1 | grep -vE "INFO|WARNING|^Loading"
    ;;
  dispatch)
    timeout 300 python3 -m moeserve.cli bench dispatch --device cuda --world-size "$N" --tokens 128 4096 \
      --hidden 7168 --topk 8 --experts 256 --iters 20 --warmup 3 --result-file "$OUT/dispatch_cuda.jsonl"
    ;;
  v3) offline v3_layer $V3 ;;
  v2)
    offline v2_lite $V2
    TOK=$(python3 -c "from moeserve.models.default_model import default_model_path; print(default_model_path())")
    k=0
    for par in "" "$EPN" "$EPN --enable-two-batch-overlap"; do
      k=$((k + 1))
      echo "== v2_lite serving: ${par:-EP 1}"
      python3 -m moeserve.cli serve $V2 $par --tokenizer-path "$TOK" --port 30000 --max-running-requests 128 \
        --cuda-graph-max-bs 128 > "$OUT/server.log" 2>&1 &
      SERVER=$!
      for i in $(seq 1 180); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
      timeout 150 python3 -m moeserve.cli bench serving --port 30000 --dataset random --random-input-len 512 \
        --random-output-len 256 --random-range-ratio 0.5 --num-prompts 256 --request-rate inf \
        --max-concurrency 128 --disable-tqdm --output-file "$OUT/v2_lite_serving_$k.json" 2>&1 \
        | grep -E "throughput|Successful|TTFT|ITL|TPOT" | head -8
      kill -INT $SERVER; wait $SERVER
      tail -2 "$OUT/server.log"
    done
    ;;
esac
