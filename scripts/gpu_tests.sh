#!/usr/bin/env bash
# The tests with CUDA cases, on a GPU machine (CI has no GPU): kernels, models, CUDA graphs, speculative graphs,
# sampling, static shapes, the hierarchical cache's copies, torch.compile. One call of the device tool:
#   source benchmark/setup.sh && bash scripts/gpu_tests.sh [PYTEST ARGS...]   (carry .whl; about 10 minutes at most)
# The CPU cases of these files run too (on the GPU host's CPU). pytest-timeout may be absent there: addopts reset.
set -uo pipefail
cd "$(dirname "$0")/.."
FILES=(
  tests/kernels/test_kernels_gpu.py tests/kernels/test_fp8_kernels.py tests/kernels/test_fp8_wgmma.py
  tests/kernels/test_moe_gemm_wgmma.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_rope_cache.py
  tests/kernels/test_extend_attention.py tests/kernels/test_moe_select.py tests/kernels/test_moe_route.py
  tests/kernels/test_moe_combine.py tests/kernels/test_moe_gemm.py tests/kernels/test_activation.py
  tests/kernels/test_direct_launch.py tests/kernels/test_router_gemm.py tests/kernels/test_argmax.py
  tests/kernels/test_put_rows.py
  tests/models/test_gpu.py tests/models/test_fp8_gpu.py tests/models/test_shared_experts_fusion.py
  tests/models/test_mla_projections.py tests/models/test_attention_ops.py
  tests/rank/test_cuda_graph.py tests/rank/test_piecewise_graph.py tests/rank/test_speculative_graphs.py
  tests/rank/test_sampling.py tests/rank/test_sampling_limits.py tests/rank/test_forward_batch_copy.py
  tests/rank/test_static_shape.py tests/parallel/test_static_shape_decode.py tests/parallel/test_static_shape_extend.py
  tests/kvcache/test_hicache.py tests/kvcache/test_copy_engine.py tests/rank/test_hicache_engine.py
  tests/rank/test_torch_compile.py
)
PY=${PY:-python3}
exec timeout "${GPU_TESTS_TIMEOUT:-560}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" --maxfail=40 \
  --durations=15 "${FILES[@]}" "$@"
