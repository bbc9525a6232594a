#!/usr/bin/env bash
# One GPU call: the FP8 kernel tests, the FP8 GEMM benchmark (scripts/gpu/fp8_bench.py) on a base tree (before),
# the sweep of tune_fp8.py (writes the tables), the benchmark again on this tree (after), in the same call.
# Usage: bash scripts/gpu/fp8_tune_ab.sh BASE_DIR   (BASE_DIR: e.g. `git archive main moeserve scripts`, unpacked)
# Results in $OUT: before.jsonl, after.jsonl, sweep.jsonl, sweep.log and the tables written.
set -uo pipefail
BASE=$(realpath "$1"); cd "$(dirname "$0")/../.."
[ -d .whl ] || cp -r ../../.whl . 2>/dev/null; source scripts/gpu/setup.sh
echo "== tests $(date -u +%T)"
timeout 150 python3 -m pytest -o addopts="" -q --tb=line -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/kernels/test_moe_gemm.py 2>&1 | tail -12
echo "== before (main) $(date -u +%T)"
(cd "$BASE" && PYTHONPATH=$PWD:/tmp/site timeout 120 python3 scripts/gpu/fp8_bench.py --result-file $OUT/before.jsonl)
echo "== sweep $(date -u +%T)"
timeout 300 python3 scripts/gpu/tune_fp8.py --stats $OUT/sweep.jsonl 2>&1 | tee $OUT/sweep.log | grep -v "^  skip\|WRONG"
echo "skipped $(grep -c '^  skip' $OUT/sweep.log), wrong $(grep -c WRONG $OUT/sweep.log)"; grep -m4 "^  skip\|WRONG" $OUT/sweep.log | cut -c1-200
echo "== after $(date -u +%T)"
timeout 120 python3 scripts/gpu/fp8_bench.py --result-file $OUT/after.jsonl
cp moeserve/kernels/configs/fp8_grouped_gemm*/*.json $OUT/ 2>/dev/null; ls $OUT
echo "== done $(date -u +%T)"
