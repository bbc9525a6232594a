"""How a decode step's expert GEMMs spend their time: a fixed cost a launch, or bytes at some rate?

V2-Lite's expert GEMMs at a decode batch (T tokens, top-6, the 2 shared slots of T rows each), through the tuned
tables, FP8 (the block-scaled grouped GEMM) and bf16 (gate/up with SiLU fused, then down):

1. The fit: each GEMM timed alone (`do_bench`, L2 flushed) with T * u / 64 tokens routed to the first u = 8, 16,
   32 and 64 of the 64 experts (each expert's rows as at T tokens over all of them), so the weights read scale
   with the experts used; every u runs the launch configuration the tables give T tokens over all the experts
   (looked up at each u's own rows, the tiles changed with u: 2026-12-03's run did not fit). A least-squares line
   through (bytes, us) gives the fixed cost a launch (us) and the rate the bytes stream at (TB/s).
2. The chain: --layers copies of a layer's experts (their own weights: nothing stays in L2), FP8's gate/up GEMM,
   SiLU-and-mul + quantize and down GEMM (bf16: gate/up + SiLU, down), captured in one CUDA graph as a decode step
   runs them. Its replay time beside the sum of the same kernels timed alone (each with a cold L2, as in the chain)
   says what running them back to back gains or costs.

Run on the GPU machine:  python3 scripts/gpu/decode_gemm_fit.py [--tokens 256] [--layers 26] [--result-file F]
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
from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight, silu_and_mul_quantize  # noqa: E402
from moeserve.kernels.moe_config import get_config  # noqa: E402
from moeserve.kernels.moe_gemm import gemm_op, moe_gemm  # noqa: E402
from moeserve.kernels.triton_ops import moe_gemm as triton_moe  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import OPS, default_config, fp8_grouped_gemm  # noqa: E402

E, S, TOP_K, H, INTER = 64, 2, 6, 2048, 1408


def bench(fn) -> float:
    """us, median, L2 flushed between launches."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def layout(tokens: int, used: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [E + S + 1], counts [E + S]): tokens routed to TOP_K of the first `used` experts, the shared slots
    `tokens` rows each."""
    ids = torch.rand(tokens, used, device="cuda", generator=gen).topk(min(TOP_K, used), dim=1).indices
    counts = torch.cat([torch.bincount(ids.flatten(), minlength=E),
                        torch.full((S,), tokens, device="cuda", dtype=torch.int64)]).to(torch.int32)
    offsets = torch.zeros(E + S + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets, counts


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares us = a + bytes / rate over (bytes, us): (a in us, rate in TB/s)."""
    xs, ys = torch.tensor([p[0] for p in points], dtype=torch.float64), torch.tensor([p[1] for p in points],
                                                                                      dtype=torch.float64)
    slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
    return float(ys.mean() - slope * xs.mean()), 1e-6 / slope  # bytes per us -> TB/s


def full_configs(T: int) -> dict:
    """The launch configurations the tables give T tokens routed over all E experts (rows T * (top-k + S))."""
    M = T * (TOP_K + S)
    fp8 = {n: get_config(OPS[False], M, E + S, n, k, FP8_DTYPE, default=default_config)
           for n, k in ((2 * INTER, H), (H, INTER))}
    bf16 = {silu: get_config(gemm_op(silu), M, E + S, INTER if silu else H, H if silu else INTER, torch.bfloat16)
            for silu in (True, False)}
    return dict(fp8=fp8, bf16=bf16)


def bf16_gemm(x, w, offsets, counts, silu: bool, cfg: dict) -> torch.Tensor:
    """The bf16 expert GEMM with this configuration (Triton), or torch's grouped GEMM where it names that backend."""
    if cfg.get("backend") == "torch":
        return moe_gemm(x, w, offsets, counts, silu=silu)
    return triton_moe.moe_gemm(x, w, offsets, counts, silu, cfg)


def time_layout(T: int, used: int, w13, w2, w13q, w13s, w2q, w2s, gen: torch.Generator) -> dict:
    """Each GEMM alone on T * used / E tokens routed to the first `used` experts (an expert's rows as at T tokens
    over all E), with T tokens' launch configurations (`full_configs`): {name: (weight bytes read, us)}."""
    cfg = full_configs(T)
    offsets, counts = layout(max(1, T * used // E), used, gen)
    M = int(counts.sum())
    slots = int((counts > 0).sum())
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(M, INTER, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq, xs = quantize_activations(x, mn_major=True)
    hq, hs = quantize_activations(h, mn_major=True)
    up_bytes, down_bytes = slots * 2 * INTER * H, slots * H * INTER  # e4m3: a byte a weight
    cases = {
        "fp8 gate/up": (lambda: fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16,
                                                 cfg["fp8"][2 * INTER]), up_bytes),
        "fp8 down": (lambda: fp8_grouped_gemm(hq, hs, w2q, w2s, offsets, counts, torch.bfloat16, cfg["fp8"][H]),
                     down_bytes),
        "bf16 gate/up + SiLU": (lambda: bf16_gemm(x, w13, offsets, counts, True, cfg["bf16"][True]), 2 * up_bytes),
        "bf16 down": (lambda: bf16_gemm(h, w2, offsets, counts, False, cfg["bf16"][False]), 2 * down_bytes),
    }
    out = {}
    for name, (fn, nbytes) in cases.items():
        us = bench(fn)
        out[name] = (nbytes, us)
        print(f"{used:3d} experts used ({slots} slots, {M} rows)  {name:20s} {us:8.1f} us  "
              f"{nbytes / us / 1e6:5.2f} TB/s", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = ns.tokens
    w13 = torch.randn(E + S, 2 * INTER, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H**-0.5
    w2 = torch.randn(E + S, H, INTER, device="cuda", dtype=torch.bfloat16, generator=gen) * INTER**-0.5
    w13q, w13s = quantize_weight(w13)
    w2q, w2s = quantize_weight(w2)
    out: dict = dict(tokens=T, device=torch.cuda.get_device_name(), fit={}, chain={})
    points: dict[str, list[tuple[float, float]]] = {k: [] for k in ("fp8 gate/up", "fp8 down", "bf16 gate/up + SiLU",
                                                                    "bf16 down")}
    for used in (8, 16, 32, 64):
        for name, (nbytes, us) in time_layout(T, used, w13, w2, w13q, w13s, w2q, w2s, gen).items():
            points[name].append((nbytes, us))
    for name, pts in points.items():
        a, rate = fit(pts)
        out["fit"][name] = dict(fixed_us=a, TBps=rate, points=pts)
        print(f"fit {name:20s}: {a:6.1f} us a launch + bytes at {rate:.2f} TB/s")
    # the chain: a decode step's expert GEMMs over --layers layers of their own weights, in one CUDA graph
    offsets, counts = layout(T, E, gen)
    M = int(counts.sum())
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq, xs = quantize_activations(x, mn_major=True)
    h16 = moe_gemm(x, w13, offsets, counts, silu=True)
    hq, hs = silu_and_mul_quantize(fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16),
                                   mn_major=True)
    up8 = fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16)
    kernels = {  # one layer's kernels, each timed alone
        "fp8": {"gate/up": lambda: fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16),
                "silu + quantize": lambda: silu_and_mul_quantize(up8, mn_major=True),
                "down": lambda: fp8_grouped_gemm(hq, hs, w2q, w2s, offsets, counts, torch.bfloat16)},
        "bf16": {"gate/up + SiLU": lambda: moe_gemm(x, w13, offsets, counts, silu=True),
                 "down": lambda: moe_gemm(h16, w2, offsets, counts)},
    }
    fp8_layers = [(w13q.clone(), w2q.clone()) for _ in range(ns.layers)]

    def fp8_step():
        for a13, a2 in fp8_layers:
            y = fp8_grouped_gemm(xq, xs, a13, w13s, offsets, counts, torch.bfloat16)
            fp8_grouped_gemm(*silu_and_mul_quantize(y, mn_major=True), a2, w2s, offsets, counts, torch.bfloat16)

    bf16_layers = [(w13.clone(), w2.clone()) for _ in range(ns.layers)]

    def bf16_step():
        for a13, a2 in bf16_layers:
            moe_gemm(moe_gemm(x, a13, offsets, counts, silu=True), a2, offsets, counts)

    for name, step in (("fp8", fp8_step), ("bf16", bf16_step)):
        alone = {k: bench(fn) for k, fn in kernels[name].items()}
        step()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        step_us = bench(g.replay)
        sum_us = ns.layers * sum(alone.values())
        out["chain"][name] = dict(graph_us=step_us, sum_alone_us=sum_us, alone_us=alone)
        print(f"{name} chain, {ns.layers} layers in one graph: {step_us:.0f} us; its kernels alone, summed: "
              f"{sum_us:.0f} us ({', '.join(f'{k} {v:.1f}' for k, v in alone.items())} us a layer)", flush=True)
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
