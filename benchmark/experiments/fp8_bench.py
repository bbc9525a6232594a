"""FP8 GEMM benchmark (GPU): moeserve's block-scaled FP8 Triton kernels beside torch._scaled_mm (per-tensor FP8,
the dense ceiling) and bf16 (torch._grouped_mm / torch.mm), in the same run, in TFLOP/s.

Shapes: the routed experts' gate_up GEMM of DeepSeek-V3 at prefill sizes (32 local experts, as with EP 8; K = 7168,
N = 2 x 2048) and V2-Lite's two expert GEMMs (64 experts; gate_up N = 2 x 1408 padded to 2,816, K = 2048; down
N = 2048, K = 1408), the contiguous and the masked layouts; dense linears of both models. The activations' scales
are stored M-major where the tree's quantizer can (`mn_major`, "scales": "mn"), row-major otherwise ("row"); the
grouped GEMMs are also timed on row-major scales. The dense rows add cuBLAS's block-scaled FP8 GEMM
(`torch._scaled_mm` with 1 x 128 activation and 128 x 128 weight scales, DeepSeek's recipe) with its error.
Usage: python3 benchmark/experiments/fp8_bench.py [--result-file F.jsonl] [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch

from moeserve.kernels.fp8_quant import (
    dequantize_activations,
    dequantize_weight,
    quantize_activations,
    quantize_weight,
)


def quantize_mn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """x quantized with M-major scales where this tree's quantizer has them, else row-major; and which."""
    try:
        return (*quantize_activations(x, mn_major=True), "mn")
    except TypeError:  # a tree from before the M-major scales
        return (*quantize_activations(x), "row")


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


def grouped(rows_per_expert: int, experts: int = 32, n: int = 4096, k: int = 7168, gate_up: bool = True) -> list[dict]:
    from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_masked

    m = rows_per_expert * experts
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    counts = torch.full((experts,), rows_per_expert, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    xq, xs, layout = quantize_mn(x)
    xs_row = xs.contiguous()
    wq, ws = quantize_weight(w)
    flops = 2 * m * n * k
    # the dense FP8 ceiling: one [M, K] x [K, N] GEMM with per-tensor scales
    wt = wq[0].t()
    one = torch.ones((), device="cuda")
    runs = {
        "fp8_grouped_contiguous": lambda: fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16),
        "fp8_grouped_contiguous_rowscales": lambda: fp8_grouped_gemm(xq, xs_row, wq, ws, offsets, counts,
                                                                     torch.bfloat16),
        "fp8_grouped_masked": lambda: fp8_grouped_gemm_masked(xq.view(experts, rows_per_expert, k),
                                                              xs.view(experts, rows_per_expert, -1), wq, ws, counts,
                                                              torch.bfloat16),
        "torch_scaled_mm_dense_fp8": lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16),
        "bf16_grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:]),
    }
    if layout == "row":
        del runs["fp8_grouped_contiguous_rowscales"]  # the same run as the first
    if gate_up:  # the first expert GEMM with the SiLU-and-mul + quantize kernel after it, as the experts run them
        from moeserve.kernels.fp8_quant import silu_and_mul_quantize

        runs["gate_up_then_silu_quant"] = lambda: silu_and_mul_quantize(
            fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16), mn_major=True)
    return [dict(op=name, m=m, n=n, k=k, experts=experts, scales=layout, tflops=flops / bench(fn) / 1e12)
            for name, fn in runs.items()]


def dense(m: int, n: int = 24576, k: int = 1536) -> list[dict]:
    from moeserve.kernels.triton_ops.fp8_gemm import fp8_gemm

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    xq, xs, layout = quantize_mn(x)
    xs_mn = xs.t().contiguous().t()  # cuBLAS's 1 x 128 scales: M-major
    wq, ws = quantize_weight(w)
    ref = dequantize_activations(xq, xs) @ dequantize_weight(wq, ws).t()
    flops = 2 * m * n * k
    runs = {"fp8_gemm": lambda: fp8_gemm(xq, xs, wq, ws, torch.bfloat16),
            "fp8_gemm_with_act_quant": lambda: fp8_gemm(*quantize_mn(x)[:2], wq, ws, torch.bfloat16),
            "cublas_blockwise_fp8": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs_mn, scale_b=ws.t(),
                                                             out_dtype=torch.bfloat16),
            "bf16_mm": lambda: x @ w.t()}
    rows = []
    for name, fn in runs.items():
        try:
            err = (fn().float() - ref).norm().item() / ref.norm().item() if name != "bf16_mm" else None
            rows.append(dict(op=name, m=m, n=n, k=k, scales=layout, rel_err=err, tflops=flops / bench(fn) / 1e12))
        except RuntimeError as e:  # cuBLAS without the block-scaled kernels
            print(f"{name} M={m} N={n} K={k}: {str(e)[:160]}")
    return rows


DENSE = [(24576, 1536), (3648, 2048), (2048, 2048), (4096, 512), (22016, 2048), (2048, 11008), (7168, 16384)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer sizes: the prefill ones")
    parser.add_argument("--decode", action="store_true", help="V2-Lite's expert GEMMs at decode sizes only")
    args = parser.parse_args()
    if args.decode:  # V2-Lite's expert GEMMs at decode sizes only (4 and 24 rows an expert: batch 43 and 256)
        rows = [r for rpe in (4, 24) for n, k in ((2816, 2048), (2048, 1408)) for r in grouped(rpe, 64, n, k, n == 2816)]
        return report(rows, args.result_file)
    rows = [r for rpe in ((512,) if args.quick else (128, 512, 1024)) for r in grouped(rpe)]
    rows += [r for rpe in ((768,) if args.quick else (24, 768, 1536)) for n, k in ((2816, 2048), (2048, 1408))
             for r in grouped(rpe, 64, n, k, gate_up=n == 2816)]
    ms = (256, 8192) if args.quick else (64, 256, 4096, 8192)
    rows += [r for m in ms for n, k in DENSE for r in dense(m, n, k)]
    report(rows, args.result_file)


def report(rows: list[dict], result_file: str | None) -> None:
    device = torch.cuda.get_device_name()
    for r in rows:
        r["device"] = device
        err = f"  rel {r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
        print(f"{r['op']:34s} E={r.get('experts', 1):3d} M={r['m']:6d} N={r['n']:6d} K={r['k']:5d} [{r['scales']}] "
              f"{r['tflops']:7.1f} TFLOP/s{err}")
    if result_file:
        with open(result_file, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
