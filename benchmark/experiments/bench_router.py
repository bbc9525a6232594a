"""The MoE gate's fp32 logits at decode sizes: the Triton kernel (moeserve/kernels/triton_ops/router_gemm.py) beside
torch's upcast + cuBLAS fp32 linear (router_logits_reference), each replayed in a CUDA graph as decode runs it
(triton.testing.do_bench_cudagraph), on distinct random inputs, each checked against the reference first; beside
the kernel's own block choice, its neighbours (half / twice the tokens, twice the experts a program).
  python3 benchmark/experiments/bench_router.py [--result-file out.jsonl]
Shapes: DeepSeek-V2-Lite's gate (E 64, H 2048), V2's (160, 5120), V3's (256, 7168); T tokens 1 to 256. Then the
prefill sizes (T 1,024 to 16,384): the tensor-core split kernel (router_logits_split) and two other tile shapes
beside the reference, timed with triton.testing.do_bench (as a prefill step is not one graph)."""

import argparse
import functools
import json

import torch
import triton
import triton.testing

from moeserve.kernels.router_gemm import MAX_WORK, router_logits_reference
from moeserve.kernels.triton_ops.router_gemm import (
    block_h,
    blocks,
    router_logits,
    router_logits_split,
    split_blocks,
)


def _us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def _neighbours(bt: int, be: int, H: int) -> list[tuple[int, int, int]]:
    out = []
    for t, e in [(max(bt // 2, 1), be), (min(bt * 2, 64), be), (bt, be * 2), (bt, max(be // 2, 1))]:
        if (t, e) != (bt, be):
            out.append((t, e, block_h(t, e, H)))
    return list(dict.fromkeys(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--result-file")
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for E, H in [(64, 2048), (160, 5120), (256, 7168)]:
        w = torch.randn(E, H, device="cuda", generator=gen) * H**-0.5
        for T in [1, 4, 16, 32, 64, 128, 256]:
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            ref = router_logits_reference(x, w)
            torch.testing.assert_close(router_logits(x, w), ref, atol=1e-4, rtol=1e-4)
            ref_us = _us(functools.partial(router_logits_reference, x, w))
            ker_us = _us(functools.partial(router_logits, x, w))
            bt, be, _ = chosen = blocks(T, E, H)
            others = {}
            for blk in _neighbours(bt, be, H):
                torch.testing.assert_close(router_logits(x, w, blk), ref, atol=1e-4, rtol=1e-4)
                others[str(blk)] = round(_us(functools.partial(router_logits, x, w, blk)), 2)
            row = {"E": E, "H": H, "T": T, "blocks": chosen, "reference_us": round(ref_us, 2),
                   "triton_us": round(ker_us, 2), "neighbours_us": others, "dispatched_to_triton": T * E * H < MAX_WORK}
            rows.append(row)
            print(f"E {E:3d} H {H:4d} T {T:3d}  cuBLAS {ref_us:7.2f} us  triton {ker_us:7.2f} us {chosen}"
                  f"{' (used)' if row['dispatched_to_triton'] else ''}  others {others}", flush=True)
    for E, H in [(64, 2048), (256, 7168)]:
        w = torch.randn(E, H, device="cuda", generator=gen) * H**-0.5
        for T in [1024, 4096, 8192, 16384]:
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            ref = router_logits_reference(x, w)
            chosen = split_blocks(T, E)
            times = {}
            for blk in dict.fromkeys([chosen, (128, 64, 64), (64, 64, 128), (128, 128, 64)]):
                torch.testing.assert_close(router_logits_split(x, w, blk), ref, atol=1e-4, rtol=1e-4)
                times[str(blk)] = round(triton.testing.do_bench(functools.partial(router_logits_split, x, w, blk)) * 1e3, 2)
            ref_us = triton.testing.do_bench(functools.partial(router_logits_reference, x, w)) * 1e3
            rows.append({"E": E, "H": H, "T": T, "split_blocks": chosen, "reference_us": round(ref_us, 2),
                         "split_us": times})
            print(f"E {E:3d} H {H:4d} T {T:5d}  upcast + cuBLAS {ref_us:8.2f} us  split (tensor cores) {times}",
                  flush=True)
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
