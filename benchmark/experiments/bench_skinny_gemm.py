"""Dense layers at decode sizes (1 to 8 rows): the Triton GEMV (moeserve/kernels/triton_ops/skinny_gemm.py) beside
cuBLAS (F.linear), in CUDA graphs as decode runs them, on distinct random inputs, each checked against F.linear
first. A decode step reads each layer's weight once, from HBM: every timed graph calls the op over as many copies
of the weight as fill 256 MB (past the H200's 50 MB L2), and a call's time is the graph's over the copies. Beside
the kernel's own block choice, its neighbours (`_neighbours`).
  python3 benchmark/experiments/bench_skinny_gemm.py [--result-file out.jsonl]
  python3 benchmark/experiments/bench_skinny_gemm.py --only mla   # MLA's per-head W_UK / W_UV products, beside torch.bmm
Shapes (N, K): DeepSeek-V2-Lite's q_proj and kv_a_proj as one weight (as the model holds them), kv_a_proj alone, o_proj, the dense MLP's gate_up and down, the LM head; V3's
q_a, q_b, kv_a, o_proj."""

import argparse
import json

import torch
import triton
import triton.testing

from moeserve.kernels.skinny_gemm import (
    MAX_ROWS,
    MAX_WORK_BYTES,
    batched_skinny_gemm_reference,
    skinny_gemm_reference,
)
from moeserve.kernels.triton_ops.skinny_gemm import batched_skinny_gemm, blocks, blocks_kn, skinny_gemm

SHAPES = {"v2lite.qkv_a": (3648, 2048), "v2lite.kv_a_proj": (576, 2048), "v2lite.o_proj": (2048, 2048),
          "v2lite.lm_head": (102400, 2048), "v2lite.mlp.gate_up": (21888, 2048), "v2lite.mlp.down": (2048, 10944),
          "v3.q_a_proj": (1536, 7168), "v3.q_b_proj": (24576, 1536), "v3.kv_a_proj": (576, 7168),
          "v3.o_proj": (7168, 16384)}
# MLA's absorbed decode, per head (G heads, N, K, w stored [K, N]?): W_UK [nope, r] read in place, W_UV [v, r]
BATCHED = {"v2lite.w_uk": (16, 512, 128, True), "v2lite.w_uv": (16, 128, 512, False),
           "v3.w_uk": (128, 512, 128, True), "v3.w_uv": (128, 128, 512, False)}
FILL = 256 << 20


def _per_call_us(fn, x, ws) -> float:
    """One CUDA graph of fn(x, w) over every copy in ws; its replay time over len(ws), in us."""
    def all_copies():
        for w in ws:
            fn(x, w)
    return triton.testing.do_bench_cudagraph(all_copies, rep=60) * 1e3 / len(ws)


def _neighbours(block: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Half / twice the columns, the other warp count, and K in pipelined steps (a quarter / an eighth of the
    step, as many more columns, 3 or 4 stages)."""
    bn, bk, nw, sk, st = block
    out = [(max(bn // 2, 1), bk, nw, sk, st), (bn * 2, bk, nw, sk, st), (bn, bk, 12 - nw, sk, st),
           (bn * 4, max(bk // 4, 64), nw, sk, 3), (bn * 4, max(bk // 4, 64), nw, sk, 4), (bn * 8, max(bk // 8, 64), nw, sk, 4)]
    return [b for b in dict.fromkeys(out) if b != block]


def bench_batched(gen: torch.Generator, rows: list[dict]) -> None:
    """MLA's per-head products as the model runs them: torch.bmm (cuBLAS) against the GEMV over the weight as
    kv_b_proj holds it, and for W_UK also over a contiguous [G, N, K] copy (what reading it in place saves)."""
    for name, (G, N, K, kn) in BATCHED.items():
        nbytes = G * N * K * 2
        def weight(G=G, N=N, K=K, kn=kn):
            if kn:  # kv_b_proj's [h, nope + v, r] rows: W_UK is the first nope of each head, viewed [h, r, nope]
                return torch.randn(G, K + 128, N, device="cuda", generator=gen).bfloat16()[:, :K].transpose(1, 2)
            return torch.randn(G, N, K + 128, device="cuda", generator=gen).bfloat16()[:, :, 128:]
        ws = [weight() for _ in range(max(1, min(64, FILL // nbytes)))]
        for M in [1, 2, 4]:
            x = torch.randn(M, G, K, device="cuda", generator=gen).bfloat16().transpose(0, 1)
            ref = batched_skinny_gemm_reference(x, ws[0])
            chosen = (blocks_kn if kn else blocks)(M, N, K)
            times = {}
            for blk in [chosen, *_neighbours(chosen)]:
                torch.testing.assert_close(batched_skinny_gemm(x, ws[0], block=blk), ref, atol=2e-2, rtol=2e-2)
                times[str(blk)] = round(_per_call_us(lambda a, b, blk=blk: batched_skinny_gemm(a, b, block=blk),
                                                     x, ws), 2)
            if kn:
                copies = [w.contiguous() for w in ws]
                blk = blocks(M, N, K)
                times[f"copy {blk}"] = round(_per_call_us(lambda a, b, blk=blk: batched_skinny_gemm(a, b, block=blk), x,
                                                          copies), 2)
                del copies
            ref_us = _per_call_us(batched_skinny_gemm_reference, x, ws)
            ker_us = times[str(chosen)]
            row = {"shape": name, "G": G, "N": N, "K": K, "M": M, "kn": kn, "blocks": chosen,
                   "cublas_us": round(ref_us, 2), "triton_us": ker_us, "others_us": times,
                   "cublas_TBps": round(nbytes / ref_us / 1e6, 2), "triton_TBps": round(nbytes / ker_us / 1e6, 2)}
            rows.append(row)
            print(f"{name:14s} G {G:3d} N {N:4d} K {K:4d} M {M}  bmm {ref_us:6.2f} us  triton {ker_us:6.2f} us "
                  f"{chosen}  others {times}", flush=True)
        del ws


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--result-file")
    p.add_argument("--only", choices=["dense", "mla"], help="one of the two sets of shapes")
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    if ns.only != "dense":
        bench_batched(gen, rows)
    for name, (N, K) in (SHAPES.items() if ns.only != "mla" else ()):
        nbytes = N * K * 2
        ws = [torch.randn(N, K, device="cuda", generator=gen).mul_(K**-0.5).bfloat16()
              for _ in range(max(1, min(64, FILL // nbytes)))]
        for M in [1, 2, 4]:
            x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
            ref = skinny_gemm_reference(x, ws[0])
            chosen = blocks(M, N, K)
            times = {}
            for blk in [chosen, *_neighbours(chosen)]:
                torch.testing.assert_close(skinny_gemm(x, ws[0], blk), ref, atol=2e-2, rtol=2e-2)
                times[str(blk)] = round(_per_call_us(lambda a, b, blk=blk: skinny_gemm(a, b, blk), x, ws), 2)
            ref_us = _per_call_us(skinny_gemm_reference, x, ws)
            ker_us = times[str(chosen)]
            row = {"shape": name, "N": N, "K": K, "M": M, "copies": len(ws), "blocks": chosen,
                   "cublas_us": round(ref_us, 2), "triton_us": ker_us, "others_us": times,
                   "cublas_TBps": round(nbytes / ref_us / 1e6, 2), "triton_TBps": round(nbytes / ker_us / 1e6, 2),
                   "dispatched_to_triton": M <= MAX_ROWS and M * nbytes <= MAX_WORK_BYTES}
            rows.append(row)
            print(f"{name:20s} N {N:6d} K {K:5d} M {M}  cuBLAS {ref_us:7.2f} us {row['cublas_TBps']:4.2f} TB/s  "
                  f"triton {ker_us:7.2f} us {row['triton_TBps']:4.2f} TB/s {chosen}{' (used)' if row['dispatched_to_triton'] else ''}"
                  f"  others {times}", flush=True)
        del ws
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
