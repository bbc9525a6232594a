#!/usr/bin/env bash
# Overlap scheduling (and the fused MLA rotary + cache write) on one GPU: overlap off (--disable-overlap-schedule)
# beside on, in one call, on the same tree. Usage: bash benchmark/experiments/overlap_ab.sh PART... with PARTs
#   tests      the CUDA tests of both, and the rotary + cache-write kernel beside the ops it replaced
#   onebatch   one-batch decode at batch 1/64/256 (V2-Lite-shaped dummy model): BASE=DIR (a `git archive` of the
#              commit before, the baseline), this tree with overlap off, this tree with overlap on
#   v3         one-batch decode at batch 128, V3-layer-shaped, overlap off / on
#   v3ab       the same at batch 128: BASE=DIR (as onebatch), then this tree (overlap on)
#   profile    the per-part profile of a batch-1 and a batch-64 decode step, overlap on
#   prefprof   the per-part profile of a 4 x 2,048 prefill, shared experts apart / fused (UNFUSED=1: apart only)
#   bs1spy     py-spy over a one-batch decode at batch 1 (256 steps, 3 rounds): where the host's time goes
#              (py-spy wheel in .whl), folded stacks in $OUT/pyspy_bs1.txt
#   pcgtests   the CUDA tests of piecewise CUDA graphs and of what runs through them (decode graphs, overlap),
#              of the kernels changed since (selection, gathered rows, split query, SiLU + FP8 quant, extend
#              attention, SiLU-and-mul, router logits, combine + shared add, tables by expert count), shared-experts
#              fusion (bf16 and FP8), and greedy parity with transformers on CUDA
#              a failure stops the run
#   attn       the CUDA tests of the Triton extend attention and of the models through it (parity with the CPU
#              model, piecewise graphs), then benchmark/experiments/bench_extend_attention.py; a failure stops the run
#   prefillon  one-batch prefill of 1 x 512, 4 x 512 and 4 x 2048 tokens (piecewise CUDA graphs on)
#   prefill    one-batch prefill of 1 x 512, 4 x 512 and 4 x 2048 tokens, piecewise CUDA graphs off / on
#   fp8prof    the per-part profile of an FP8 decode step (--quantization fp8) at batch 64 and 256 (PROF_BS picks;
#              QUANTS="bf16 fp8": both; MODEL=v3: the V3-layer-shaped model)
#   fp8prefprof the per-part profile of an FP8 prefill of 4 x 2,048 tokens (--quantization fp8; QUANTS="bf16 fp8":
#              both; MODEL=v3: the V3-layer-shaped model)
#   fp8ab      FP8 one-batch decode at batch 64 / 256 and prefill 4 x 2,048: BASE=DIR (as onebatch), then this tree
#   fp8vsbf16  this tree in bf16 then FP8: one-batch decode at batch 64 / 256 and prefill 4 x 2,048 (V2-Lite-shaped;
#              MODEL=v3: the V3-layer-shaped model), the weights' memory from the log
#   fp8bench   benchmark/experiments/fp8_bench.py --quick: BASE=DIR first where given, then this tree
#   fp8dense   tune the FP8 linear layers' dense GEMM (tune_fp8.py --dense: V2-Lite's and V3's shapes at 1, 64, 256,
#              8,192 rows; DENSE_SHAPES, DENSE_ROWS pick others); the tables land in $OUT/fp8_gemm_tables.tgz (the
#              next parts of the same call read them)
#   fp8tune    tune V2-Lite's FP8 expert GEMMs: decode's layout at 1 / 64 / 128 / 256 tokens (tune_fp8.py
#              --decode-batches, shared slots), then 768 rows an expert (prefill; tiles from a map among the
#              candidates; FP8_PHASES picks); the tables land in $OUT/fp8_grouped_tables.tgz (the next parts of the
#              same call read them)
#   fp8graph   tune the FP8 GEMMs at decode sizes in CUDA graphs, V2-Lite's experts and linear layers, each candidate
#              against the table's entry (benchmark/kernels/fp8_graph_tune.py --write); the tables land in
#              $OUT/fp8_graph_tables.tgz (the next parts of the same call read them)
#   gluonab    the Gluon FP8 grouped GEMM, BASE=DIR (as onebatch) beside this tree, twice in turn: its GPU tests
#              (this tree), then benchmark/experiments/fp8_tile_cost.py at V2-Lite's prefill shapes (gate/up at K 1,024 and
#              2,048, down at its K 1,408) and benchmark/experiments/fp8_gemm_pair.py (beside cuBLAS)
#   prefillab  one-batch prefill at 4 x 2,048 (the default flags): BASE=DIR (as onebatch), then this tree
#   fusion     one-batch decode at batch 1/64/256 and prefill at 4 x 2048, --disable-shared-experts-fusion / the default
#              (fused on one CUDA rank)
#   gaps       where the device idles in the traces `profile` / `prefprof` left in /tmp/prof (benchmark/experiments/trace_gaps.py)
#   tune       re-tune the V2-Lite MoE tables at prefill sizes (tune_moe.py --tokens 2048 4096 8192, TUNE_TOKENS picks); the tables
#              it writes land in $OUT (the next parts of the same call read them)
#   serving    `moeserve serve` + `bench serving` at concurrency 64 (random 256-512-token prompts, 128-256 out),
#              overlap off / on / on with --enable-mixed-chunk (CFGS picks; mixed2k: chunks of 2,048 tokens; nopcg,
#              mixednopcg: on and mixed with --disable-piecewise-cuda-graph)
# Results: $OUT/*.jsonl and $OUT/log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmark/setup.sh
M="--model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --context-length 4096"
OFF_ON=("--disable-overlap-schedule" "")
# MODEL=v3: the FP8 parts that take it run the V3-layer-shaped model (MP: its flags, MF: the memory fraction)
MP=$M; MF=0.5
[ "${MODEL:-}" = v3 ] && MF=0.85 && MP="--model-path benchmarks/configs/deepseek-v3-4layer --load-format dummy --dtype bfloat16 --context-length 4096"
for part in "$@"; do
case $part in
tests)
  echo "== tests $(date -u +%T)"
  timeout 170 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/rank/test_overlap.py \
    tests/rank/test_cuda_graph.py tests/models/test_gpu.py tests/kernels/test_mla_rope_cache.py \
    tests/kernels/test_mla_decode.py -k "not v2_lite_dummy" 2>&1 | grep -E "FAIL|Error|passed|failed" | tail -20
  timeout 60 python3 benchmark/experiments/bench_mla_rope_cache.py --result-file "$OUT/rope.jsonl" 2>&1 | tail -8
  timeout 60 python3 benchmark/experiments/bench_mla_rope_cache.py --interleaved --heads 128 --result-file "$OUT/rope.jsonl" \
    2>&1 | tail -8
  ;;
pcgtests)
  echo "== piecewise tests $(date -u +%T)"
  timeout ${TESTS_S:-240} python3 -m pytest -o addopts="" -q -p no:cacheprovider -x tests/rank/test_piecewise_graph.py \
    tests/rank/test_cuda_graph.py tests/rank/test_overlap.py tests/kernels/test_moe_select.py \
    tests/models/test_shared_experts_fusion.py tests/kernels/test_moe_gemm.py tests/kernels/test_moe_route.py \
    tests/kernels/test_extend_attention.py tests/kernels/test_activation.py tests/kernels/test_router_gemm.py \
    tests/kernels/test_moe_combine.py tests/kernels/test_moe_config.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_fp8_kernels.py tests/models/test_mla_projections.py tests/models/test_gpu.py -k "not v2_lite_dummy" 2>&1 \
    | grep -vE "^\s*$|it/s\]" | tail -40 | tee "$OUT/pcgtests.log"
  grep -qE "[0-9]+ passed" "$OUT/pcgtests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/pcgtests.log" || exit 1
  ;;
attn)
  echo "== extend attention tests $(date -u +%T)"
  timeout 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider -x tests/kernels/test_extend_attention.py \
    tests/models/test_attention_ops.py tests/models/test_gpu.py tests/rank/test_piecewise_graph.py -k "not v2_lite_dummy" \
    2>&1 | grep -vE "^\s*$|it/s\]" | tail -30 | tee "$OUT/attntests.log"
  grep -qE "[0-9]+ passed" "$OUT/attntests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/attntests.log" || exit 1
  timeout 150 python3 benchmark/experiments/bench_extend_attention.py --result-file "$OUT/extend_attention.jsonl" 2>&1 \
    | tee "$OUT/extend_attention.log" | grep -vE "Warning|warn"
  ;;
prefillon)
  for shape in ${SHAPES:-"1 4:512" "4:2048"}; do
    echo "== prefill piecewise ${shape} $(date -u +%T)"
    timeout 100 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 64 \
      --repeat 3 --batch-size ${shape%:*} --input-len ${shape#*:} --output-len 4 --chunked-prefill-size 8192 \
      --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 8 --result-file "$OUT/prefill.jsonl" 2>&1 \
      | grep -E "^batch|Error|error|piecewise"
  done
  ;;
prefill)
  for flag in "--disable-piecewise-cuda-graph" ""; do
    for shape in "1 4:512" "4:2048"; do
      echo "== prefill ${flag:-piecewise} ${shape} $(date -u +%T)"
      timeout 100 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 64 \
        --repeat 3 --batch-size ${shape%:*} --input-len ${shape#*:} --output-len 4 --chunked-prefill-size 8192 \
        --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 8 $flag \
        --result-file "$OUT/prefill${flag:+_off}.jsonl" 2>&1 | grep -E "^batch|Error|error|piecewise"
    done
  done
  ;;
fp8prof)  # QUANTS="bf16 fp8" profiles both (default fp8); MODEL=v3 the V3-layer-shaped model
  for q in ${QUANTS:-fp8}; do
    F=""; [ $q = fp8 ] && F="--quantization fp8"
    echo "== ${MODEL:-v2lite} $q decode profile $(date -u +%T)"
    timeout 150 python3 -m moeserve.cli bench one-batch $MP $F --mem-fraction-static $MF \
      --max-running-requests 256 --cuda-graph-max-bs 256 --input-len 128 --output-len 16 --batch-size ${PROF_BS:-64 256} \
      --profile --profile-dir /tmp/prof_$q --result-file "$OUT/${MODEL:-v2lite}_${q}_profile.jsonl" 2>&1 \
      | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy weights|^traces"
  done
  ;;
fp8prefprof)  # QUANTS="bf16 fp8" profiles both (default fp8); MODEL=v3 the V3-layer-shaped model
  for q in ${QUANTS:-fp8}; do
    F=""; [ $q = fp8 ] && F="--quantization fp8"
    echo "== ${MODEL:-v2lite} $q prefill profile $(date -u +%T)"
    timeout 120 python3 -m moeserve.cli bench one-batch $MP $F --mem-fraction-static $MF \
      --max-running-requests 8 --input-len 2048 --output-len 2 --batch-size 4 --chunked-prefill-size 8192 \
      --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 --profile --profile-dir /tmp/prof_$q \
      --result-file "$OUT/${MODEL:-v2lite}_${q}_prefprof.jsonl" 2>&1 \
      | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy weights|^traces" | sed -n '/prefill of/,/decode step/p'
  done
  ;;
fp8ab)
  SITE=${PYTHONPATH#*:}
  for side in ${SIDES:-base on}; do
    tree=$PWD; [ $side = base ] && tree=$(realpath "$BASE")
    echo "== V2-Lite FP8 decode $side $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 120 python3 -m moeserve.cli bench one-batch $M --quantization fp8 \
      --context-length 1024 --mem-fraction-static 0.5 --max-running-requests 256 --cuda-graph-max-bs 256 \
      --repeat 3 --input-len 128 --output-len 64 --batch-size 64 256 --result-file "$OUT/fp8_decode_$side.jsonl" \
      2>&1 | grep -E "^batch|Error|error")
    echo "== V2-Lite FP8 prefill 4 x 2048 $side $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 80 python3 -m moeserve.cli bench one-batch $M --quantization fp8 \
      --mem-fraction-static 0.5 --max-running-requests 8 --repeat 3 --input-len 2048 --output-len 2 --batch-size 4 \
      --chunked-prefill-size 8192 --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 \
      --result-file "$OUT/fp8_prefill_$side.jsonl" 2>&1 | grep -E "^batch|Error|error")
  done
  ;;
gluonab)
  SITE=${PYTHONPATH#*:}
  python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/kernels/test_fp8_wgmma.py 2>&1 | tail -2
  for round in 1 2; do
    for side in base on; do
      tree=$PWD; [ $side = base ] && tree=$(realpath "$BASE")
      echo "== Gluon FP8 grouped GEMM, $side, round $round $(date -u +%T)"
      (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 benchmark/experiments/fp8_tile_cost.py --rows 768 --ks 1024 2048 \
        2>&1 | grep -E "^K|^fit|Error")
      (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 benchmark/experiments/fp8_tile_cost.py --rows 768 --n 2048 --ks 1408 \
        2>&1 | grep -E "^K|Error")
      (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 benchmark/experiments/fp8_gemm_pair.py 2>&1 | grep -vE "^\s*$|Warning")
    done
  done
  ;;
fp8vsbf16)
  for q in ${QUANTS:-bf16 fp8}; do
    F=""; [ $q = fp8 ] && F="--quantization fp8"
    echo "== ${MODEL:-v2lite} $q decode $(date -u +%T)"
    timeout 120 python3 -m moeserve.cli bench one-batch $MP $F --context-length 1024 --mem-fraction-static $MF \
      --max-running-requests 256 --cuda-graph-max-bs 256 --repeat 3 --input-len 128 --output-len 64 \
      --batch-size 64 256 --result-file "$OUT/${MODEL:-v2lite}_${q}_decode.jsonl" 2>&1 | grep -E "^batch|Error|error|weights"
    echo "== ${MODEL:-v2lite} $q prefill 4 x 2048 $(date -u +%T)"
    timeout 90 python3 -m moeserve.cli bench one-batch $MP $F --mem-fraction-static $MF --max-running-requests 8 \
      --repeat 3 --input-len 2048 --output-len 2 --batch-size 4 --chunked-prefill-size 8192 \
      --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 \
      --result-file "$OUT/${MODEL:-v2lite}_${q}_prefill.jsonl" 2>&1 | grep -E "^batch|Error|error"
  done
  ;;
fp8bench)
  SITE=${PYTHONPATH#*:}; HERE=$PWD
  for side in ${BASE:+base} on; do
    tree=$HERE; [ $side = base ] && tree=$(realpath "$BASE")
    echo "== fp8_bench.py --quick, $side $(date -u +%T)"  # this tree's script over each tree's kernels
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 150 python3 "$HERE/benchmark/experiments/fp8_bench.py" --quick \
      --result-file "$OUT/fp8_bench_$side.jsonl" 2>&1 | grep -vE "Warning|warn")
  done
  ;;
fp8dense)
  echo "== tune the FP8 dense GEMM $(date -u +%T)"
  timeout ${DENSE_S:-300} python3 benchmark/kernels/tune_fp8.py --dense ${DENSE_SHAPES:+--shapes $DENSE_SHAPES} \
    ${DENSE_ROWS:+--rows $DENSE_ROWS} --stats "$OUT/tune_fp8_dense.jsonl" 2>&1 | grep -vE "skip|WRONG"
  tar -czf "$OUT/fp8_gemm_tables.tgz" -C moeserve/kernels/configs fp8_gemm  # one file: a call returns few
  ;;
fp8tune)  # FP8_PHASES="decode prefill" by default
  if [[ " ${FP8_PHASES:-decode prefill} " == *" decode "* ]]; then
    echo "== tune V2-Lite's FP8 expert GEMMs, decode $(date -u +%T)"
    timeout ${DECODE_S:-240} python3 benchmark/kernels/tune_fp8.py --experts 64 --shapes 2816x2048 2048x1408 \
      --decode-batches ${DECODE_T:-1 64 128 256} --top-k 6 --shared 2 --stats "$OUT/tune_fp8_decode.jsonl" 2>&1 \
      | grep -vE "skip|Warning|warn"
  fi
  if [[ " ${FP8_PHASES:-decode prefill} " == *" prefill "* ]]; then
    echo "== tune V2-Lite's FP8 expert GEMMs, 768 rows an expert $(date -u +%T)"
    timeout ${PREFILL_S:-200} python3 benchmark/kernels/tune_fp8.py --experts 64 --shapes 2816x2048 2048x1408 \
      --rows-per-expert 768 --stats "$OUT/tune_fp8_prefill.jsonl" 2>&1 | grep -vE "skip|Warning|warn"
  fi
  tar -czf "$OUT/fp8_grouped_tables.tgz" -C moeserve/kernels/configs fp8_grouped_gemm fp8_grouped_gemm_masked
  ;;
fp8graph)
  echo "== FP8 GEMMs tuned in CUDA graphs, decode sizes $(date -u +%T)"
  timeout ${GRAPH_S:-360} python3 benchmark/kernels/fp8_graph_tune.py --write --result-file "$OUT/fp8_graph.jsonl" 2>&1 \
    | grep -vE "skip|Warning|warn"
  tar -czf "$OUT/fp8_graph_tables.tgz" -C moeserve/kernels/configs fp8_gemm fp8_grouped_gemm
  ;;
prefillab)
  SITE=${PYTHONPATH#*:}
  for side in ${SIDES:-base on}; do
    tree=$PWD; [ $side = base ] && tree=$(realpath "$BASE")
    echo "== V2-Lite prefill 4 x 2048 $side $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 80 python3 -m moeserve.cli bench one-batch $M \
      --mem-fraction-static 0.5 --max-running-requests 8 --repeat 3 --input-len 2048 --output-len 2 --batch-size 4 \
      --chunked-prefill-size 8192 --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 \
      --result-file "$OUT/prefill_$side.jsonl" 2>&1 | grep -E "^batch|Error|error")
  done
  ;;
fusion)
  for flag in "--disable-shared-experts-fusion" ""; do
    echo "== V2-Lite one-batch ${flag:-fused (default)} $(date -u +%T)"
    timeout 110 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 256 \
      --repeat 3 --input-len 128 --output-len 64 --batch-size 1 64 256 $flag \
      --result-file "$OUT/fusion_decode${flag:+_unfused}.jsonl" 2>&1 | grep -E "^batch|Error|error"
    timeout 80 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 8 \
      --repeat 3 --input-len 2048 --output-len 2 --batch-size 4 --chunked-prefill-size 8192 \
      --piecewise-cuda-graph-max-tokens 8192 --cuda-graph-max-bs 4 $flag \
      --result-file "$OUT/fusion_prefill${flag:+_unfused}.jsonl" 2>&1 | grep -E "^batch|Error|error"
  done
  ;;
onebatch)  # BASE (a tree without this work, $BASE) back to back; this tree overlap off; this tree overlap on
  SITE=${PYTHONPATH#*:}
  for side in ${SIDES:-base off on}; do
    tree=$PWD; flag=""
    [ $side = base ] && tree=$(realpath "$BASE")
    [ $side = off ] && flag="--disable-overlap-schedule"
    echo "== V2-Lite one-batch $side $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 110 python3 -m moeserve.cli bench one-batch $M \
      --mem-fraction-static 0.5 --max-running-requests 256 --repeat 3 --input-len 128 --output-len 64 \
      --batch-size 1 64 256 $flag --result-file "$OUT/v2lite_one_batch_$side.jsonl" 2>&1 | grep -E "^batch|Error|error")
  done
  ;;
v3)
  for flag in "${OFF_ON[@]:${V3_FROM:-0}}"; do
    echo "== V3-layer one-batch ${flag:-overlap} $(date -u +%T)"
    timeout 100 python3 -m moeserve.cli bench one-batch --model-path benchmarks/configs/deepseek-v3-4layer \
      --load-format dummy --dtype bfloat16 --context-length 4096 --mem-fraction-static 0.85 \
      --max-running-requests 128 --repeat 3 --batch-size 128 --input-len 128 --output-len 64 $flag \
      --result-file "$OUT/v3layer_one_batch${flag:+_off}.jsonl" 2>&1 | grep -E "^batch|Error|error"
  done
  ;;
v3ab)
  SITE=${PYTHONPATH#*:}
  for side in base on; do
    tree=$PWD; [ $side = base ] && tree=$(realpath "$BASE")
    echo "== V3-layer one-batch $side $(date -u +%T)"
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 100 python3 -m moeserve.cli bench one-batch \
      --model-path benchmarks/configs/deepseek-v3-4layer --load-format dummy --dtype bfloat16 --context-length 4096 \
      --mem-fraction-static 0.85 --max-running-requests 128 --repeat 3 --batch-size 128 --input-len 128 \
      --output-len 64 --result-file "$OUT/v3layer_one_batch_$side.jsonl" 2>&1 | grep -E "^batch|Error|error")
  done
  ;;
profile)
  echo "== profile $(date -u +%T)"
  timeout 120 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 64 \
    --input-len 128 --output-len 16 --batch-size 1 64 --profile --profile-dir /tmp/prof \
    --result-file "$OUT/profile.jsonl" 2>&1 | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy weights|^traces"
  ;;
prefprof)
  FLAGS=("--disable-shared-experts-fusion" ""); [ -n "${UNFUSED:-}" ] && FLAGS=("--disable-shared-experts-fusion")
  for flag in "${FLAGS[@]}"; do
    echo "== prefill profile ${flag:-fused (default)} $(date -u +%T)"
    timeout 100 python3 -m moeserve.cli bench one-batch $M --mem-fraction-static 0.5 --max-running-requests 8 \
      --input-len 2048 --output-len 2 --batch-size 4 --chunked-prefill-size 8192 --piecewise-cuda-graph-max-tokens 8192 \
      --cuda-graph-max-bs 4 --profile --profile-dir /tmp/prof $flag --result-file "$OUT/prefprof${flag:+_unfused}.jsonl" 2>&1 \
      | grep -vE "^\s*$|it/s\]|Warning|warn|Dummy weights|^traces" | sed -n '/prefill of/,/decode step/p'
  done
  ;;
bs1spy)
  echo "== py-spy, one-batch decode at batch 1 $(date -u +%T)"
  timeout 150 /tmp/site/bin/py-spy record -r 250 -f raw -o "$OUT/pyspy_bs1.txt" -- python3 -m moeserve.cli bench \
    one-batch $M --mem-fraction-static 0.5 --max-running-requests 8 --repeat 3 --input-len 128 --output-len 256 \
    --batch-size 1 --cuda-graph-max-bs 8 --result-file "$OUT/bs1spy.jsonl" 2>&1 | grep -E "^batch|Error|error"
  ;;
gaps)
  for t in /tmp/prof/*.json.gz; do
    echo "== device gaps in $t $(date -u +%T)"
    timeout 60 python3 benchmark/experiments/trace_gaps.py "$t" --top 20
  done
  ;;
tune)
  echo "== tune the MoE tables at prefill sizes $(date -u +%T)"
  timeout 150 python3 benchmark/kernels/tune_moe.py --tokens ${TUNE_TOKENS:-2048 4096 8192} --stats "$OUT/tune.jsonl" 2>&1 \
    | grep -E "^T |wrote|tuned"
  for op in moe_gemm moe_gemm_silu; do cp moeserve/kernels/configs/$op/E=64,*.json "$OUT/${op}_E64.json"; done
  ;;
serving)
  TOK=$(python3 -c "from moeserve.models.default_model import default_model_path; print(default_model_path())")
  for cfg in ${CFGS:-off on mixed}; do
    case $cfg in off) F="--disable-overlap-schedule";; on) F="";; mixed) F="--enable-mixed-chunk";;
      mixed2k) F="--enable-mixed-chunk --chunked-prefill-size 2048";; nopcg) F="--disable-piecewise-cuda-graph";;
      mixednopcg) F="--enable-mixed-chunk --disable-piecewise-cuda-graph";; esac
    echo "== serving $cfg $(date -u +%T)"
    python3 -m moeserve.cli serve $M --tokenizer-path "$TOK" --port 30000 --max-running-requests 128 \
      --cuda-graph-max-bs 128 --mem-fraction-static 0.8 $F > "$OUT/server_$cfg.log" 2>&1 &
    SERVER=$!
    for i in $(seq 1 150); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
    if [ -n "${PYSPY:-}" ]; then  # where the server's processes spend the run (py-spy wheel in .whl)
      (sleep 12; timeout 30 /tmp/site/bin/py-spy record --subprocesses --nonblocking -p $SERVER -d 12 -r 100 -f raw \
        -o "$OUT/pyspy_$cfg.txt" >/dev/null 2>&1) &
    fi
    timeout ${SERVE_S:-140} python3 -m moeserve.cli bench serving --port 30000 --dataset random \
      --random-input-len 512 --random-output-len 256 --random-range-ratio 0.5 --num-prompts ${PROMPTS:-192} \
      --request-rate inf --max-concurrency 64 --warmup-requests 8 --seed 1 --disable-tqdm \
      --output-file "$OUT/serving_$cfg.json" 2>&1 | grep -E "throughput|ITL|TTFT|TPOT|Successful|Error|error" | head -14
    kill -INT $SERVER; wait $SERVER
    grep -E "overlap|captured|Error|Traceback" "$OUT/server_$cfg.log" | head -4
    grep -E "steps:" "$OUT/server_$cfg.log" | sed -E 's/^.*INFO [a-z._]+: //' | tail -8
  done
  ;;
esac
done
echo "== done $(date -u +%T)"
