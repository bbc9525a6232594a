source scripts/gpu/setup.sh >/dev/null; nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader
M="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096"
P="--mem-fraction-static 0.5 --max-running-requests 8 --input-len 2048 --output-len 2 --batch-size 4 --chunked-prefill-size 8192 --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 --profile"
F="grep -vE ^\s*$|it/s\]|Warning|warn|Dummy|^traces"
for q in bf16 fp8; do
  Q=""; [ $q = fp8 ] && Q="--quantization fp8"
  echo "== $q prefill profile $(date -u +%T)"
  timeout 120 python3 -m moeserve.cli bench one-batch $M $Q $P --profile-dir /tmp/pp_$q --result-file $OUT/prefprof_$q.jsonl 2>&1 | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy|^traces" | sed -n '/prefill of/,/decode step/p'
done
for q in bf16 fp8; do
  Q=""; [ $q = fp8 ] && Q="--quantization fp8"
  echo "== $q decode profile 256 $(date -u +%T)"
  timeout 150 python3 -m moeserve.cli bench one-batch $M $Q --mem-fraction-static 0.5 --max-running-requests 256 --cuda-graph-max-bs 256 --input-len 128 --output-len 16 --batch-size 256 --profile --profile-dir /tmp/pd_$q --result-file $OUT/decprof_$q.jsonl 2>&1 | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy|^traces" | tail -22
done
