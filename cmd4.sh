source scripts/gpu/setup.sh >/dev/null
echo "== wgmma tests $(date -u +%T)"
timeout 200 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/kernels/test_moe_gemm_wgmma.py tests/rank/test_bench_one_batch.py 2>&1 | grep -E "FAIL|Error|passed|failed|assert" | tail -12
TESTS_S=300 bash scripts/gpu/overlap_ab.sh pcgtests 2>&1 | grep -v "^NVIDIA\|^torch" | tail -15
