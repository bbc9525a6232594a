"""Does the shape of a GEMM's weight reads cap the rate they stream at? V2-Lite's expert weights at decode (66 slots
x 2,816 rows x 2,048 columns: 380 MB of e4m3, or twice that in bf16) read as a decode GEMM reads them: a program a
row tile, K in steps, through tensor descriptors, each step's tile multiplied by a small operand on the tensor cores
(so the loop is pipelined as a GEMM's is), with the same number of programs an SM.

The forms: the weights row-major [rows, K] read in boxes of R rows x C bytes (the FP8 kernel's 128 x 128 B, wider
boxes: two scale groups a step, 256 B of a row at once), or laid out at load as whole tiles, each tile's K steps one
run of R x C bytes after another (every box one contiguous run). The rate of each is the weights' bytes over the
kernel's time (median of do_bench, L2 flushed); a device-to-device copy of the same bytes is the ceiling.

Run on the GPU machine:  python3 scripts/gpu/stream_pattern_ab.py [--rounds 3] [--result-file F]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SLOTS, N, K = 66, 2816, 2048


@triton.jit
def _stream_kernel(desc, out_ptr, nk, TILED: tl.constexpr, PAIR: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   M: tl.constexpr):
    t = tl.program_id(0)
    a = tl.full((M, C), 1.0, tl.float16).to(desc.dtype)  # (e4m3 has no full of its own)
    acc = tl.zeros((M, R), tl.float32)
    for kb in range(0, nk, 2 if PAIR else 1):
        if TILED:  # tile t's step kb: rows (t * nk + kb) * R of the [tiles * nk * R, C] view
            b = desc.load([(t * nk + kb) * R, 0])
        else:
            b = desc.load([t * R, kb * C])
        acc = tl.dot(a, b.T, acc)
        if PAIR:  # the next step's box issued in the same iteration (two boxes side by side, one stage)
            acc = tl.dot(a, desc.load([t * R, (kb + 1) * C]).T, acc)
    tl.store(out_ptr + t * R + tl.arange(0, R), tl.sum(acc, axis=0))


def run(w: torch.Tensor, R: int, cbytes: int, tiled: bool, stages: int, warps: int,
        pair: bool = False) -> tuple[float, float]:
    """(us, TB/s) of one pass over w ([rows, K], any dtype) in boxes of R rows x cbytes bytes (pair: two boxes side
    by side an iteration)."""
    rows, k = w.shape
    c = cbytes // w.element_size()
    nk, tiles = k // c, rows // R
    if tiled:  # each tile's steps laid end to end: [tiles, nk, R, c]
        src = w.view(tiles, R, nk, c).permute(0, 2, 1, 3).contiguous().view(tiles * nk * R, c)
        desc = TensorDescriptor(src, list(src.shape), [c, 1], [R, c])
    else:
        src = w
        desc = TensorDescriptor(w, [rows, k], [k, 1], [R, c])
    out = torch.empty(tiles * R, device=w.device, dtype=torch.float32)
    m = 64

    def fn():
        _stream_kernel[(tiles,)](desc, out, nk, TILED=tiled, PAIR=pair, R=R, C=c, M=m, num_warps=warps, num_stages=stages)

    us = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
    del src
    return us, w.numel() * w.element_size() / us / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w16 = (torch.randn(SLOTS * N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05)
    w8 = w16.to(torch.float8_e4m3fn)
    forms = [  # (name, tensor, R rows, bytes a row a step, tiled, stages, warps[, pair])
        ("fp8 128 x 128 B (the kernel's box)", w8, 128, 128, False, 3, 4),
        ("fp8 128 x 128 B, 4 stages", w8, 128, 128, False, 4, 4),
        ("fp8 128 x 256 B", w8, 128, 256, False, 3, 4),
        ("fp8 64 x 256 B", w8, 64, 256, False, 4, 4),
        ("fp8 two 128 x 128 B boxes a stage", w8, 128, 128, False, 3, 4, True),
        ("fp8 64 x 128 B", w8, 64, 128, False, 4, 4),
        ("fp8 128 x 128 B tiled", w8, 128, 128, True, 3, 4),
        ("fp8 128 x 128 B tiled, 4 stages", w8, 128, 128, True, 4, 4),
        ("fp8 128 x 256 B tiled", w8, 128, 256, True, 3, 4),
        ("bf16 128 x 128 B (64 values)", w16, 128, 128, False, 4, 4),
        ("bf16 128 x 256 B (128 values)", w16, 128, 256, False, 3, 4),
        ("bf16 128 x 256 B tiled", w16, 128, 256, True, 3, 4),
    ]
    results: dict = {}
    for r in range(ns.rounds):
        for name, w, R, cb, tiled, st, nw, *pair in forms:
            try:
                us, rate = run(w, R, cb, tiled, st, nw, *pair)
            except Exception as e:  # noqa: BLE001 (a form that does not compile or fit: reported, left out)
                print(f"skip {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            results.setdefault(name, []).append(rate)
            print(f"round {r}  {name:36s} {us:8.1f} us  {rate:5.2f} TB/s", flush=True)
        for name, w in (("copy fp8", w8), ("copy bf16", w16)):
            dst = torch.empty_like(w)
            us = triton.testing.do_bench(lambda d=dst, s=w: d.copy_(s), warmup=10, rep=100,
                                         return_mode="median") * 1e3
            rate = w.numel() * w.element_size() / us / 1e6  # read bytes over the time (it also writes as many)
            results.setdefault(name, []).append(rate)
            print(f"round {r}  {name:36s} {us:8.1f} us  {rate:5.2f} TB/s read (+ as much written)", flush=True)
            del dst
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.write(json.dumps(dict(device=torch.cuda.get_device_name(), TBps=results)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
