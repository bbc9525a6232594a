"""What a tile costs beyond its K steps, in the FP8 grouped GEMM at prefill sizes: the kernel timed at one layout
(E experts, the same rows each) over several K, and a line fitted through time against K, per tile:

    time = tiles / SMs x (fixed + steps x step)     fixed: the cycles a tile spends outside its K steps, in steps

(a persistent kernel walks its tiles in order, so the fixed part is what a program pays at each tile: the first
scales' wait, the epilogue, the pipeline's restart). torch._scaled_mm (per-tensor FP8, cuBLAS) on the same M x N x K
is timed beside it. Fit over K up to about 2,048: from 4,096 on a step itself costs more (the operands a group of
tiles reads outgrow L2), which bends the line (H200, 2026-12-04).

    python3 benchmark/experiments/fp8_tile_cost.py [--experts 64] [--rows 1024] [--n 2816] [--ks 512 1024 2048]
        [--config '{"BLOCK_M": 128, ...}']      (default: the V2-Lite prefill table's entry)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve.kernels.fp8_format import FP8_DTYPE  # noqa: E402
from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm  # noqa: E402

PREFILL = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 16, "num_warps": 4, "num_stages": 4, "WGMMA": True,
           "TILE_MAP": True}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def time_k(M: int, N: int, K: int, E: int, offsets, counts, cfg: dict, gen) -> tuple[float, float]:
    """(the grouped GEMM's ms, torch._scaled_mm's ms on the same M x N x K) at one K, fresh random operands."""
    xq, xs = quantize_activations(torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen),
                                  mn_major=True)
    wq, ws = quantize_weight(torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5)
    ms = bench(lambda: fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16, cfg))
    wd = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen).to(FP8_DTYPE)
    one = torch.ones((), device="cuda")
    return ms, bench(lambda: torch._scaled_mm(xq, wd.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--n", type=int, default=2816)
    p.add_argument("--ks", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--config", default=None)
    ns = p.parse_args()
    cfg = json.loads(ns.config) if ns.config else PREFILL
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, N, M = ns.experts, ns.n, ns.experts * ns.rows
    counts = torch.full((E,), ns.rows, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    tiles = E * triton.cdiv(ns.rows, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    points = []
    print(f"{torch.cuda.get_device_name()}: E {E} x {ns.rows} rows, N {N}, {tiles} tiles on {sms} SMs | {cfg}")
    for K in ns.ks:
        ms, ref_ms = time_k(M, N, K, E, offsets, counts, cfg, gen)
        flop = 2 * M * N * K
        per_tile_us = ms * 1e3 / (tiles / sms)
        points.append((K // 128, per_tile_us))
        print(f"K {K:5d}: {ms * 1e3:8.1f} us, {flop / ms / 1e9:6.0f} TFLOP/s | _scaled_mm {ref_ms * 1e3:8.1f} us, "
              f"{flop / ref_ms / 1e9:6.0f} TFLOP/s ({ms / ref_ms:.2f}x its time) | {per_tile_us:.2f} us a tile an SM",
              flush=True)
    ks = torch.tensor([k for k, _ in points], dtype=torch.float64)
    ts = torch.tensor([t for _, t in points], dtype=torch.float64)
    step, fixed = torch.linalg.lstsq(torch.stack([ks, torch.ones_like(ks)], 1), ts[:, None]).solution[:, 0].tolist()
    print(f"fit: a tile costs {fixed:.3f} us + {step:.4f} us a K step ({fixed / step:.1f} steps of fixed cost)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
