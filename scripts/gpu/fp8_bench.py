"""FP8 GEMM benchmark (GPU): moeserve's block-scaled FP8 Triton kernels beside torch._scaled_mm (per-tensor FP8,
the dense ceiling) and bf16 (torch._grouped_mm / torch.mm), in the same run, in TFLOP/s.

Shapes: the routed experts' gate_up GEMM of DeepSeek-V3 at prefill sizes (32 local experts, as with EP 8; K = 7168,
N = 2 x 2048), the contiguous and the masked layouts; a dense linear (q_b_proj: K = 1536, N = 24576).
Usage: python3 scripts/gpu/fp8_bench.py [--result-file F.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch

from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight


def bench(fn, iters: int = 20) -> float:
    """Median seconds of fn() over iters runs, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def grouped(rows_per_expert: int, experts: int = 32, n: int = 4096, k: int = 7168) -> list[dict]:
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_masked

    m = rows_per_expert * experts
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    counts = torch.full((experts,), rows_per_expert, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    xq, xs = quantize_activations(x)
    wq, ws = quantize_weight(w)
    flops = 2 * m * n * k
    # the dense FP8 ceiling: one [M, K] x [K, N] GEMM with per-tensor scales
    wt = wq[0].t()
    one = torch.ones((), device="cuda")
    runs = {
        "fp8_grouped_contiguous": lambda: fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16),
        "fp8_grouped_masked": lambda: fp8_grouped_gemm_masked(xq.view(experts, rows_per_expert, k),
                                                              xs.view(experts, rows_per_expert, -1), wq, ws, counts,
                                                              torch.bfloat16),
        "torch_scaled_mm_dense_fp8": lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16),
        "bf16_grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:]),
    }
    return [dict(op=name, m=m, n=n, k=k, experts=experts, tflops=flops / bench(fn) / 1e12) for name, fn in runs.items()]


def dense(m: int, n: int = 24576, k: int = 1536) -> list[dict]:
    from moeserve.kernels.triton_ops.fp8_gemm import fp8_gemm

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    xq, xs = quantize_activations(x)
    wq, ws = quantize_weight(w)
    flops = 2 * m * n * k
    runs = {"fp8_gemm": lambda: fp8_gemm(xq, xs, wq, ws, torch.bfloat16),
            "fp8_gemm_with_act_quant": lambda: fp8_gemm(*quantize_activations(x), wq, ws, torch.bfloat16),
            "bf16_mm": lambda: x @ w.t()}
    return [dict(op=name, m=m, n=n, k=k, tflops=flops / bench(fn) / 1e12) for name, fn in runs.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    rows = [r for rpe in (128, 512, 1024) for r in grouped(rpe)] + [r for m in (64, 4096) for r in dense(m)]
    device = torch.cuda.get_device_name()
    for r in rows:
        r["device"] = device
        print(f"{r['op']:28s} M={r['m']:6d} N={r['n']:6d} K={r['k']:5d}  {r['tflops']:7.1f} TFLOP/s")
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
