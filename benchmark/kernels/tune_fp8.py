"""Tune the Triton block-scaled FP8 grouped GEMMs (moeserve/kernels/triton_ops/fp8_grouped_gemm.py) and write the
tables they read (moeserve/kernels/moe_config.py; ops fp8_grouped_gemm and fp8_grouped_gemm_masked), the way
benchmark/kernels/tune_moe.py tunes the bf16 ones.

For each expert shape (N x K) and rows per expert: E experts with that many rows each, activations quantized per
token in groups of 128, weights in 128 x 128 blocks; every candidate launch configuration of the contiguous (and,
for the first shape, the masked) kernel is checked against the torch reference (dequantize, fp32 matmul) and
timed with triton.testing.do_bench (median; the weights are far larger than L2), beside torch._scaled_mm (one dense
per-tensor FP8 GEMM of the same M x N x K, the ceiling) and torch._grouped_mm in bf16, in the same run.
Prints one line per case with the best configuration, TFLOP/s and its share of _scaled_mm; writes the tables.

--decode-batches T ...: decode's layout instead of equal rows per expert: T tokens routed to --top-k of the E
experts at random (distinct experts a token), plus --shared slots of T rows each (shared-experts fusion); the
candidates are timed on that layout and the weights' TB/s printed beside the bf16 Triton kernel's on the same
layout. The entry goes into E's table at the same rows per expert (T * (k + S) * E / (E + S)), and the table's
entries at or below the largest such key (tuned on equal rows, no shared slots) are replaced.

--dense: the dense block-scaled GEMM of the linear layers (triton_ops/fp8_gemm.py, op fp8_gemm, E = 1) at each
shape and row count, beside F.linear in bf16 (cuBLAS) on the same shape, the activations' quantization timed apart.

Run on the GPU machine:
    python3 benchmark/kernels/tune_fp8.py [--experts 32] [--shapes 4096x7168 7168x2048] [--rows-per-expert 16 128 512 1024]
    python3 benchmark/kernels/tune_fp8.py --experts 64 --shapes 2816x2048 2048x1408 --decode-batches 1 64 256 --top-k 6 \
        --shared 2
    python3 benchmark/kernels/tune_fp8.py --dense [--shapes 3648x2048 2048x2048 ...] [--rows 1 64 256 8192]
    python3 benchmark/kernels/tune_fp8.py --experts 64 --shapes 2816x2048 2048x1408 --masked-only --rows-per-expert 16 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve.kernels.fp8_format import FP8_DTYPE  # noqa: E402
from moeserve.kernels.fp8_quant import (  # noqa: E402
    dequantize_activations,
    dequantize_weight,
    quantize_activations,
    quantize_weight,
)
from moeserve.kernels.moe_config import config_file, device_name  # noqa: E402
from moeserve.kernels.moe_gemm import moe_gemm  # noqa: E402  (the bf16 path: Triton, or torch where its table says)
from moeserve.kernels.triton_ops.fp8_gemm import OP as DENSE_OP  # noqa: E402
from moeserve.kernels.triton_ops.fp8_gemm import cublas_takes, fp8_gemm  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import OPS, fp8_grouped_gemm, fp8_grouped_gemm_masked  # noqa: E402

MAX_REL = 1e-2  # bf16 output against the fp32 reference: a wrong tile is off by far more


def candidates(rows_per_expert: int) -> list[dict]:
    """Launch configurations worth timing: thin tiles when experts hold few rows, tensor-core tiles at prefill."""
    def cfg(bm, bn, w, st, g=8, tma=False):
        return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=g, num_warps=w, num_stages=st, **({"TMA": True} if tma else {}))

    if rows_per_expert <= 64:  # weight streaming: the weights' bytes in flight (BLOCK_N x 128 a stage) count most
        # (the first sweep, 2026-12-03: 16-row tiles, 6 stages and 32 x 128 by pointers lost at 64-256 tokens)
        out = [cfg(16, 64, 4, 4), cfg(64, 64, 4, 4), cfg(64, 128, 4, 3), cfg(64, 128, 4, 4), cfg(64, 128, 8, 4)]
        out += [cfg(32, 128, 4, 4, tma=True), cfg(64, 128, 4, 4, tma=True), cfg(64, 64, 4, 4, tma=True),
                cfg(64, 256, 8, 3, tma=True)]
        # w through a descriptor, the rows by pointers: a tile's rows past its expert's few are not read
        out += [dict(cfg(bm, bn, w, st, tma=True), A_TMA=False)
                for bm, bn, w, st in [(64, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (64, 256, 8, 3), (32, 128, 4, 4)]]
        # registers capped so that 3 programs fit an SM (Nsight Compute, 2026-12-03: 182 a thread held it to 2)
        out += [dict(cfg(64, 128, 4, 3), maxnreg=168), dict(cfg(64, 128, 4, 3, tma=True), A_TMA=False, maxnreg=168)]
        # the next step's scales loaded after the step's add, into the registers it read (SCALE_AHEAD 3)
        out += [dict(c, SCALE_AHEAD=3) for c in (dict(cfg(64, 128, 4, 3, tma=True), A_TMA=False, maxnreg=168),
                                                 dict(cfg(64, 128, 4, 3, tma=True), A_TMA=False),
                                                 cfg(64, 128, 4, 4, tma=True), cfg(64, 128, 4, 3, tma=True),
                                                 cfg(64, 64, 4, 4, tma=True))]
        # (dropped after the sweeps of 2026-12-03: the scales loaded 0 or 2 steps ahead, no better beyond the noise;
        # the Gluon kernel's SWAP_AB form, 1.3x to 3.4x the table's time at every decode size: benchmark/results/)
        # the Gluon kernel's PAIRS form (a 64-row tile a warpgroup, each with half of the slots: up to 8 stages of
        # 16 KB of weights an SM, where Triton's 64 x 128 tile keeps 2-3 in flight a program), its plain 128-row form
        out += [dict(cfg(64, bn, 4, st), WGMMA=True, PAIRS=True, **m)
                for bn, st in [(128, 6), (128, 8), (64, 8), (64, 12)] for m in ({}, {"TILE_MAP": True})]
        out += [dict(cfg(128, 128, 4, 6), WGMMA=True, TILE_MAP=True)]
        return out
    # the first sweep (2026-12-01): wider tiles (x 256), 128 x 128 on 4 warps and grouped-M 16 / 32 lost everywhere;
    # the second (2026-12-03): 128 x 128 on 8 warps and 5 stages lost, and a persistent grid
    out = [cfg(64, 128, 4, 3, 1)]  # the pointer path, for comparison
    out += [cfg(64, 128, 4, st, g, tma=True) for st in (3, 4) for g in (1, 8)] + [cfg(128, 128, 8, 4, tma=True)]
    # (contiguous) the tiles read from a map; then the scales loaded in the step that uses them (0) or 2 steps ahead
    out += [dict(cfg(64, 128, 4, st, g, tma=True), TILE_MAP=True) for st, g in [(3, 8), (4, 8), (3, 1)]]
    out += [dict(cfg(64, 128, 4, 3, 8, tma=True), TILE_MAP=True, SCALE_AHEAD=ahead) for ahead in (0, 2)]
    out += [dict(cfg(64, 128, 4, 3, 8, tma=True), TILE_MAP=True, SCALE_AHEAD=0, maxnreg=168)]  # 3 programs an SM
    # the Gluon kernel (triton_ops/fp8_grouped_wgmma.py: a producer warp and two consumer warpgroups, 128-row tiles)
    out += [dict(cfg(128, bn, 4, st, g), WGMMA=True, TILE_MAP=True) for bn, st in [(128, 4), (128, 5), (128, 6), (64, 6)]
            for g in (8, 16)]
    return out


# DeepSeek-V2-Lite's FP8 linear layers (q_proj + kv_a fused, o_proj, the dense MLP's gate_up and down, kv_b at
# prefill) and V3's (q_a + kv_a fused, q_b, o_proj, the dense MLP's gate_up and down, kv_b at prefill), N x K as the
# layers run them: V2-Lite's dense MLP padded to whole 128-blocks (I 10,944 -> 11,008, layers/quantization/fp8_mlp.py)
DENSE_SHAPES = ["3648x2048", "2048x2048", "22016x2048", "2048x11008", "4096x512", "2112x7168", "24576x1536",
                "7168x16384", "36864x7168", "7168x18432", "32768x512"]


def dense_candidates(M: int, K: int) -> list[dict]:
    """Thin tiles (and more programs) for decode's few rows, tensor-core tiles for prefill's many; cuBLAS where the
    layer runs it (`cublas_takes`: elsewhere a "cublas" entry would run the default tile under cuBLAS's name)."""
    def cfg(bm, bn, w, st):
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)

    def split(c, s):  # K cut in s runs: s times the programs, each with s times fewer dependent K steps
        return dict(c, SPLIT_K=s)

    # (dropped after the sweep in CUDA graphs of 2026-12-04: "SCALE_AHEAD": 3, the scales loaded after the step's
    # add, won no dense shape: benchmark/results/)
    # cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm), timed beside the tiles
    cublas = [{"backend": "cublas"}] if cublas_takes(M, K, torch.bfloat16) else []
    if M <= 64:
        return cublas + [cfg(16, 32, 4, 4), cfg(16, 64, 4, 4), cfg(16, 128, 4, 4), cfg(32, 64, 4, 4),
                         cfg(32, 128, 4, 3), cfg(64, 64, 4, 4), cfg(64, 128, 4, 3)] + [
            split(cfg(bm, bn, 4, st), s) for bm, bn, st, s in [(16, 128, 4, 4), (32, 128, 3, 2), (32, 128, 3, 4),
                                                               (64, 128, 3, 4), (64, 64, 4, 4)]]
    if M <= 512:
        return cublas + [cfg(32, 64, 4, 4), cfg(64, 64, 4, 4), cfg(64, 128, 4, 3), cfg(64, 128, 4, 4),
                         cfg(128, 64, 4, 4), cfg(128, 128, 8, 3)] + [
            split(cfg(bm, bn, w, st), s) for bm, bn, w, st, s in [(64, 128, 4, 3, 2), (64, 128, 4, 3, 4),
                                                                  (64, 128, 4, 3, 8), (64, 64, 4, 4, 2),
                                                                  (64, 64, 4, 4, 4), (128, 128, 8, 3, 4)]]
    return cublas + [cfg(64, 128, 4, 3), cfg(64, 128, 4, 4), cfg(128, 128, 8, 3), cfg(128, 128, 8, 4),
                     cfg(128, 64, 4, 4), cfg(64, 256, 8, 3)]


def tune_dense(N: int, K: int, M: int, gen: torch.Generator) -> tuple[dict | None, dict]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5
    xq, xs = quantize_activations(x, mn_major=True)
    wq, ws = quantize_weight(w)
    ref = dequantize_activations(xq, xs) @ dequantize_weight(wq, ws).t()
    bf16_ms = bench(lambda: torch.nn.functional.linear(x, w))
    quant_ms = bench(lambda: quantize_activations(x))
    best, best_ms, rows = None, float("inf"), []
    for c in dense_candidates(M, K):
        try:
            err = rel(fp8_gemm(xq, xs, wq, ws, torch.bfloat16, c), ref)
            if not err < MAX_REL:
                print(f"  WRONG {c}: rel {err:.2e}", flush=True)
                continue
            ms = bench(lambda c=c: fp8_gemm(xq, xs, wq, ws, torch.bfloat16, c))
        except Exception as e:  # does not compile or fit: skip it
            print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        rows.append(dict(config=c, ms=ms))
        if ms < best_ms:
            best, best_ms = c, ms
    stats = dict(op=DENSE_OP, N=N, K=K, M=M, best=best, best_ms=best_ms, bf16_linear_ms=bf16_ms, act_quant_ms=quant_ms,
                 best_weight_TBps=N * K / best_ms / 1e9, bf16_weight_TBps=2 * N * K / bf16_ms / 1e9,
                 device=torch.cuda.get_device_name(), all=rows)
    return best, stats


def main_dense(shapes: list[str], ms: list[int], stats_path: str | None) -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    for shape in shapes:
        N, K = map(int, shape.split("x"))
        table = {}
        for M in ms:
            best, s = tune_dense(N, K, M, gen)
            if best is None:
                print(f"{DENSE_OP} N={N} K={K} M={M}: no configuration ran")
                continue
            table[M] = best
            print(f"{DENSE_OP} N={N:5d} K={K:5d} M={M:5d}: {s['best_ms'] * 1e3:7.1f} us + quant "
                  f"{s['act_quant_ms'] * 1e3:5.1f} ({s['best_weight_TBps']:.2f} TB/s of weights) | bf16 F.linear "
                  f"{s['bf16_linear_ms'] * 1e3:7.1f} us ({s['bf16_weight_TBps']:.2f} TB/s) | {best}", flush=True)
            if stats_path:
                with open(stats_path, "a") as f:
                    f.write(json.dumps(s) + "\n")
        if table:
            write_table(DENSE_OP, 1, N, K, table)
    print(f"tuned in {time.perf_counter() - start:.0f} s")
    return 0


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def tune_case(N: int, K: int, counts: torch.Tensor, masked: bool, gen: torch.Generator,
              gate_up: bool = False, match: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Every candidate on one layout: counts [E] rows of each expert (contiguous; masked: capacity max(counts)).
    gate_up: the bf16 kernel it is set beside runs the shape as the bf16 path does, with SiLU-and-mul fused.
    match: only the candidates with each of these keys set (the table's own entry is timed beside them)."""
    E, M = counts.shape[0], int(counts.sum())
    cap = int(counts.max())
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5
    wq, ws = quantize_weight(w)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    if masked:
        xq, xs = quantize_activations(masked_rows(x, offsets, counts).view(E * cap, K), mn_major=True)
    else:
        xq, xs = quantize_activations(x, mn_major=True)  # as the experts quantize them
    deq = dequantize_activations(xq, xs)
    wd = dequantize_weight(wq, ws)
    ref = torch.cat([deq[(e * cap if masked else o):][:c] @ wd[e].t()
                     for e, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist(), strict=False))])
    valid = torch.cat([torch.arange(e * cap, e * cap + c) for e, c in enumerate(counts.tolist())]) if masked else None

    def run(c):
        if masked:
            return fp8_grouped_gemm_masked(xq.view(E, cap, K), xs.view(E, cap, -1), wq, ws, counts, torch.bfloat16, c)
        return fp8_grouped_gemm(xq, xs, wq, ws, offsets, counts, torch.bfloat16, c)

    def used_rows(out):  # the rows the reference computes, in its order
        return out.view(E * cap, N)[valid.cuda()] if masked else out

    flops = 2 * M * N * K
    weight_bytes = int((counts > 0).sum()) * N * K  # e4m3: a byte a weight of the experts that got rows
    one = torch.ones((), device="cuda")
    wt = wq[0].t()
    rows16 = max(16, M // 16 * 16)  # (_scaled_mm takes rows in multiples of 16)
    xq16 = xq[:rows16] if xq.shape[0] >= rows16 else torch.randn(rows16, K, device="cuda", generator=gen).to(FP8_DTYPE)
    scaled_ms = bench(lambda: torch._scaled_mm(xq16, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    bf16_ms = bench(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:]))
    bf16_triton_ms = bench(lambda: moe_gemm(x, w, offsets, counts, silu=gate_up))  # the bf16 path, its table
    best, best_ms, rows = None, float("inf"), []
    cands = candidates(M // E)
    if match:
        cands = [c for c in cands if all(c.get(k) for k in match)]
        table_ms = bench(lambda: run(None))
        best, best_ms = "table", table_ms
        rows.append(dict(config="table", ms=table_ms, tflops=flops / table_ms / 1e9))
    if masked:  # the tile map is the contiguous layout's: the masked kernel runs such a candidate without it
        cands = [json.loads(c) for c in dict.fromkeys(json.dumps({k: v for k, v in c.items() if k != "TILE_MAP"})
                                                      for c in cands)]
    for c in cands:
        try:
            err = rel(used_rows(run(c)), ref)
            if not err < MAX_REL:
                print(f"  WRONG {c}: rel {err:.2e}", flush=True)
                continue
            ms = bench(lambda c=c: run(c))
        except Exception as e:  # does not compile or fit (shared memory, registers): skip it
            print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        rows.append(dict(config=c, ms=ms, tflops=flops / ms / 1e9))
        if ms < best_ms:
            best, best_ms = c, ms
    stats = dict(op=OPS[masked], E=E, N=N, K=K, M=M, rows_per_expert=M / E, best=best, best_ms=best_ms,
                 best_tflops=flops / best_ms / 1e9, best_weight_TBps=weight_bytes / best_ms / 1e9,
                 scaled_mm_tflops=2 * rows16 * N * K / scaled_ms / 1e9, bf16_grouped_mm_tflops=flops / bf16_ms / 1e9,
                 bf16_triton_ms=bf16_triton_ms, bf16_triton_weight_TBps=2 * weight_bytes / bf16_triton_ms / 1e9,
                 device=torch.cuda.get_device_name(), all=rows)
    return best, stats


def masked_rows(x: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The contiguous layout's rows x [M, K] as the masked layout [E, max(counts), K]: each expert's rows at the head
    of its slot, zeros after."""
    E, cap = counts.shape[0], int(counts.max())
    slots = x.new_zeros(E, cap, x.shape[1])
    for e, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist(), strict=False)):
        slots[e, :c] = x[o:o + c]
    return slots


def decode_counts(E: int, shared: int, top_k: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[E + shared] rows an expert for T tokens routed to top_k distinct experts at random, the shared slots T each."""
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(top_k, dim=1).indices
    routed = torch.bincount(ids.flatten(), minlength=E)
    return torch.cat([routed, torch.full((shared,), T, device="cuda", dtype=routed.dtype)]).to(torch.int32)


def write_table(op: str, E: int, N: int, K: int, table: dict[int, dict], replace_below: int = -1) -> None:
    """Merge the tuned rows into the table (rows tuned now replace theirs; rows at or below replace_below go)."""
    path = config_file(op, E, N, K, FP8_DTYPE, device_name())
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {int(m): c for m, c in json.loads(path.read_text()).items()} if path.exists() else {}
    kept = {m: c for m, c in kept.items() if m > replace_below}
    table = {**kept, **table}
    path.write_text(json.dumps({str(m): c for m, c in sorted(table.items())}, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32, help="local experts (DeepSeek-V3 at EP 8: 32)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="N x K: gate_up, down (default 4096x7168 7168x2048); with --dense the linear layers' shapes")
    p.add_argument("--rows-per-expert", type=int, nargs="+", default=[16, 128, 512, 1024])
    p.add_argument("--stats", default=None, help="append the measurements as JSON lines here")
    p.add_argument("--decode-batches", type=int, nargs="+", default=None,
                   help="tune decode's layout at these token counts (random top-k routing, shared slots)")
    p.add_argument("--top-k", type=int, default=6, help="--decode-batches: experts a token")
    p.add_argument("--shared", type=int, default=2, help="--decode-batches: shared-expert slots (T rows each)")
    p.add_argument("--drop-below", action="store_true",
                   help="--decode-batches: drop the table's rows at or below the largest one tuned now (rows tuned "
                        "from another layout); by default the rows not tuned now stay")
    p.add_argument("--masked", action=argparse.BooleanOptionalAction, default=True,
                   help="also tune the first shape's masked layout (default on; not with --decode-batches)")
    p.add_argument("--masked-only", action="store_true",
                   help="tune only the masked layout, of every shape given (the low-latency decode's down GEMM "
                        "too); the contiguous tables stay as they are. A lone shape is taken as a down projection")
    p.add_argument("--dense", action="store_true", help="tune the linear layers' dense GEMM instead")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 8192], help="--dense: the row counts")
    p.add_argument("--match", nargs="+", default=(),
                   help="experts: time only the candidates with these keys set, beside the table's entry, and write "
                        "one only where it beats that entry")
    ns = p.parse_args()
    if ns.dense:
        return main_dense(ns.shapes or DENSE_SHAPES, ns.rows, ns.stats)
    ns.shapes = ns.shapes or ["4096x7168", "7168x2048"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    for i, shape in enumerate(ns.shapes):
        N, K = map(int, shape.split("x"))
        if ns.decode_batches:
            layouts_of_shape = (False,)
        elif ns.masked_only:
            layouts_of_shape = (True,)
        else:  # the masked layout with the first shape (gate/up), by default
            layouts_of_shape = (False, True) if i == 0 and ns.masked else (False,)
        for masked in layouts_of_shape:
            table = {}
            if ns.decode_batches:
                layouts = [decode_counts(ns.experts, ns.shared, ns.top_k, T, gen) for T in ns.decode_batches]
            else:
                layouts = [torch.full((ns.experts,), r, dtype=torch.int32, device="cuda") for r in ns.rows_per_expert]
            for counts in layouts:
                # the bf16 comparator runs the first shape as gate/up + SiLU, except a lone --masked-only shape
                # (a down projection: the low-latency decode's missing tables)
                best, s = tune_case(N, K, counts, masked, gen,
                                    gate_up=i == 0 and (len(ns.shapes) > 1 or not ns.masked_only), match=ns.match)
                key = round(s["M"] * ns.experts / counts.shape[0])  # the same rows per expert in E's table
                if best is None:
                    print(f"{s['op']} N={N} K={K} M={s['M']}: no configuration ran")
                    continue
                if best != "table":
                    table[key] = best
                print(f"{s['op']:24s} E={counts.shape[0]} N={N:5d} K={K:5d} M={s['M']:6d}: {s['best_tflops']:6.0f} "
                      f"TFLOP/s = {s['best_tflops'] / s['scaled_mm_tflops']:.0%} of _scaled_mm "
                      f"{s['scaled_mm_tflops']:.0f} (bf16 grouped {s['bf16_grouped_mm_tflops']:.0f}); "
                      f"{s['best_ms'] * 1e3:.1f} us, {s['best_weight_TBps']:.2f} TB/s of weights (bf16 Triton "
                      f"{s['bf16_triton_ms'] * 1e3:.1f} us, {s['bf16_triton_weight_TBps']:.2f}) | {best}", flush=True)
                if ns.stats:
                    with open(ns.stats, "a") as f:
                        f.write(json.dumps(s) + "\n")
            if table:
                write_table(OPS[masked], ns.experts, N, K, table,
                            max(table) if ns.decode_batches and ns.drop_below else -1)
    print(f"tuned in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
