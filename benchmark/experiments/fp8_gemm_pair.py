"""The Gluon FP8 grouped GEMM (triton_ops/fp8_grouped_wgmma.py) with a single expert beside cuBLAS's block-scaled
FP8 GEMM (torch._scaled_mm with DeepSeek's 1 x 128 / 128 x 128 scales, `cublas_block_fp8`) on the same M x N x K:
both outputs compared (they should agree bit for bit: the same products summed in the same order of K blocks),
then both timed with do_bench, or one of them launched a few times for Nsight Compute to read:

    python3 benchmark/experiments/fp8_gemm_pair.py [--m 16384 --n 2816 --k 2048] [--config '{...}']
    ncu --clock-control none --kernel-name regex:_fp8_grouped --launch-skip 2 --launch-count 1 --set full \\
        python3 benchmark/experiments/fp8_gemm_pair.py --launch gluon        (--launch cublas: --kernel-name regex:nvjet)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_tile_cost import PREFILL  # noqa: E402

from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight  # noqa: E402
from moeserve.kernels.triton_ops.fp8_gemm import cublas_block_fp8  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=2816)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--config", default=None, help="the Gluon kernel's configuration (default: V2-Lite's prefill)")
    p.add_argument("--launch", choices=["gluon", "cublas"], default=None,
                   help="only launch this one a few times (for a profiler), no timing")
    ns = p.parse_args()
    cfg = json.loads(ns.config) if ns.config else PREFILL
    M, N, K = ns.m, ns.n, ns.k
    gen = torch.Generator(device="cuda").manual_seed(0)
    xq, xs = quantize_activations(torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                                  mn_major=True)
    wq, ws = quantize_weight(torch.randn(1, N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5)
    counts = torch.tensor([M], dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, M], dtype=torch.int32, device="cuda")
    runs = {"gluon": lambda: fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16, cfg),
            "cublas": lambda: cublas_block_fp8(xq, xs, wq[0], ws[0])}
    a, b = runs["gluon"]().float(), runs["cublas"]().float()
    print(f"M {M}, N {N}, K {K}: Gluon against cuBLAS, relative difference {float((a - b).norm() / b.norm()):.3g}, "
          f"bits equal: {bool(torch.equal(a, b))}")
    if ns.launch:
        for _ in range(3):
            runs[ns.launch]()
        torch.cuda.synchronize()
        return 0
    for name, fn in runs.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"{name:6s} {ms * 1e3:8.1f} us {2 * M * N * K / ms / 1e9:6.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
