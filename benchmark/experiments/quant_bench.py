"""Time the FP8 activation quantizers (moeserve/kernels/triton_ops/fp8_quant.py) at V2-Lite's sizes, beside a copy of
the same bytes (torch's clone of the input, then of an output-sized tensor: the bandwidth the kernel could reach).

Cases (4 x 2,048 prefill: 8,192 tokens, top-6 of 64 experts plus 2 shared slots = 65,536 rows; decode at 256;
--model v3: V3's sizes):
the experts' SiLU-and-mul + quantize of [rows, 2 x 1,408], the gathered quantize of the experts' rows from [tokens,
2,048], the plain quantize of [tokens, 2,048]. Each line: us (median of do_bench, L2 flushed), GB/s of the bytes the
op must move (read + written, the gathered rows' reads counted once a row), and the copy's us.

Run on the GPU machine, in two trees to compare:  python3 benchmark/experiments/quant_bench.py [--label NAME]
(--sweep, other launch shapes beside the default, needed a hook in the kernel: run it from 401bd23.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve.kernels.fp8_quant import quantize_activations, quantize_gathered, silu_and_mul_quantize  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def pairs_for(tokens: int, top_k: int, experts: int, shared: int, gen: torch.Generator) -> torch.Tensor:
    """The contiguous layout's pair ids (token * (top_k + shared) + slot), sorted by expert as dispatch sorts them."""
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices
    ids = torch.cat([ids, experts + torch.arange(shared, device="cuda").expand(tokens, shared)], 1)
    return ids.flatten().argsort(stable=True).to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="")
    p.add_argument("--model", choices=["v2lite", "v3"], default="v2lite",
                   help="v3: DeepSeek-V3's sizes (H 7,168, I 2,048, top-8 of 256 plus 1 shared slot)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 256])
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, inter, top_k, E, S = (2048, 1408, 6, 64, 2) if ns.model == "v2lite" else (7168, 2048, 8, 256, 1)
    for tokens in ns.tokens:
        rows = tokens * (top_k + S)
        x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen)
        t = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        pairs = pairs_for(tokens, top_k, E, S, gen)
        cases = [
            ("silu_and_mul_quantize", lambda x=x: silu_and_mul_quantize(x, mn_major=True),
             x.numel() * 2 + rows * inter, x),
            ("quantize_gathered", lambda t=t, pairs=pairs: quantize_gathered(t, pairs, top_k + S, mn_major=True),
             rows * H * 2 + rows * H, None),
            ("quantize_activations", lambda t=t: quantize_activations(t, mn_major=True), t.numel() * 3, t),
        ]
        for name, fn, nbytes, src in cases:
            us = bench(fn)
            copy = f"{bench(lambda src=src: src.clone()):8.1f} us to copy the input" if src is not None else ""
            print(f"{ns.label:8s} {tokens:5d} tokens {name:22s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s  {copy}",
                  flush=True)


if __name__ == "__main__":
    main()
