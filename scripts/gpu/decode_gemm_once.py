"""One decode-sized expert GEMM, launched a few times, for a profiler to read (Nsight Compute: why the FP8 grouped GEMM
streams its weights slower than the bf16 one on the same layout).

V2-Lite's gate/up shape (E 64 + 2 shared slots, N 2,816, K 2,048) at T tokens of decode (random top-6 routing, the
shared slots T rows each: scripts/gpu/tune_fp8.py's decode layout), with the tuned tables' entries: --which fp8
runs the FP8 contiguous grouped GEMM, bf16 the bf16 gate/up + SiLU kernel.

Run on the GPU machine, e.g.:
    ncu --kernel-name regex:"_fp8_grouped_kernel|_moe_gemm_kernel" --launch-skip 2 --launch-count 1 --set full \
        python3 scripts/gpu/decode_gemm_once.py --which fp8
(--tokens 8192 gives a prefill's layout; --config '{"BLOCK_M": 64, ..., "WGMMA": true}' a configuration of one's
choice instead of the table's; --model v3 DeepSeek-V3's gate/up shape.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_fp8 import decode_counts  # noqa: E402

from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight  # noqa: E402
from moeserve.kernels.moe_gemm import moe_gemm  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--launches", type=int, default=4)
    p.add_argument("--config", default=None, help="fp8: a launch configuration (JSON) instead of the table's entry")
    p.add_argument("--model", choices=["v2-lite", "v3"], default="v2-lite",
                   help="v3: DeepSeek-V3's gate/up (E 256 + 1 shared slot, top-8, N 4,096, K 7,168)")
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, shared, top_k, N, K = (256, 1, 8, 4096, 7168) if ns.model == "v3" else (64, 2, 6, 2816, 2048)
    counts = decode_counts(E, shared, top_k, ns.tokens, gen)
    E, M = counts.shape[0], int(counts.sum())
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5
    cfg = json.loads(ns.config) if ns.config else None
    if ns.which == "fp8":
        xq, xs = quantize_activations(x, mn_major=True)
        wq, ws = quantize_weight(w)
        del w

        def run():
            return fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16, cfg)
    else:
        def run():
            return moe_gemm(x, w, offsets, counts, silu=True)
    for _ in range(ns.launches):
        run()
    torch.cuda.synchronize()
    print(f"{ns.which}: {ns.launches} launches of E {E}, N {N}, K {K}, M {M}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
