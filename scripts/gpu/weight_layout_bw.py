"""Does a tile-contiguous weight layout stream faster than the row-major one, for the way the FP8 decode GEMM reads
its weights? Decode's expert GEMMs read every weight once a step (3.0-3.35 TB/s measured for V2-Lite's FP8 experts
at 256 tokens, bf16's 3.6: docs/BENCHMARKS.md); a program reads its 128 weight rows 128 bytes at a time, each row
K bytes from the next. Re-laid per 128 x 128 tile, each K step of a program is one contiguous 16 KB read instead.

Two Triton kernels read the same bytes as the grouped GEMM's grid does (a program a 128-row block of one expert,
K in steps of 128, STAGES loads in flight) and sum them (so nothing is optimized away); the sums are checked equal
between the layouts, and each is timed (do_bench, median), beside a plain device copy of the same bytes.

    python3 scripts/gpu/weight_layout_bw.py [--experts 66] [--n 2816] [--k 2048] [--stages 3 4] [--warps 4]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_kernel(w_ptr, out_ptr, K, ROW_STRIDE: tl.constexpr, STEP: tl.constexpr, BLOCK_STRIDE,
                   STAGES: tl.constexpr):
    """Program p reads rows 128p.. of the weights, K in steps of 128: block base p * BLOCK_STRIDE, row r of step s
    at base + s * STEP + r * ROW_STRIDE (row-major: STEP 128, ROW_STRIDE K; tiled: STEP 16,384, ROW_STRIDE 128)."""
    p = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, 128)
    cols = tl.arange(0, 128)
    ptrs = w_ptr + p * BLOCK_STRIDE + rows[:, None] * ROW_STRIDE + cols[None, :]
    acc = tl.zeros([128, 128], dtype=tl.int32)
    for _ in tl.range(0, K // 128, num_stages=STAGES):
        acc += tl.load(ptrs).to(tl.int32)
        ptrs += STEP
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, 1), 0))


def tiled(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> the same bytes per 128 x 128 tile: [E, N / 128, K / 128, 128, 128], contiguous."""
    E, N, K = w.shape
    return w.view(E, N // 128, 128, K // 128, 128).permute(0, 1, 3, 2, 4).contiguous()


def stream(w: torch.Tensor, K: int, row_stride: int, step: int, stages: int, warps: int) -> torch.Tensor:
    blocks = w.numel() // (128 * K)
    out = torch.empty(blocks, dtype=torch.int32, device=w.device)
    _stream_kernel[(blocks,)](w, out, K, ROW_STRIDE=row_stride, STEP=step, BLOCK_STRIDE=128 * K, STAGES=stages,
                              num_warps=warps)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=66)  # V2-Lite's 64 routed + 2 shared slots
    p.add_argument("--n", type=int, default=2816)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--warps", type=int, default=4)
    ns = p.parse_args()
    E, N, K = ns.experts, ns.n, ns.k
    assert N % 128 == 0 and K % 128 == 0, "whole 128 x 128 tiles"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device=dev, generator=gen)
    wt = tiled(w)
    nbytes = w.numel()
    for stages in ns.stages:
        a = stream(w, K, K, 128, stages, ns.warps)
        b = stream(wt, K, 128, 128 * 128, stages, ns.warps)
        assert torch.equal(a, b), "the two layouts' sums differ"
        if dev == "cpu":
            print(f"stages {stages}: sums equal ({a.numel()} blocks)")
            continue
        row_ms = triton.testing.do_bench(lambda st=stages: stream(w, K, K, 128, st, ns.warps), return_mode="median")
        tile_ms = triton.testing.do_bench(lambda st=stages: stream(wt, K, 128, 128 * 128, st, ns.warps),
                                          return_mode="median")
        print(f"E {E}, N {N}, K {K}, {stages} stages, {ns.warps} warps: row-major {nbytes / row_ms / 1e9:.2f} TB/s, "
              f"tiled {nbytes / tile_ms / 1e9:.2f} TB/s ({row_ms / tile_ms:.2f}x)", flush=True)
    if dev != "cpu":
        copy_ms = triton.testing.do_bench(lambda: w.clone(), return_mode="median")
        print(f"a device copy of the same bytes: {2 * nbytes / copy_ms / 1e9:.2f} TB/s (read + write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
