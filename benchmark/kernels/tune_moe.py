"""Tune the Triton MoE grouped GEMMs (moeserve/kernels/triton_ops/moe_gemm.py) for one model's expert shapes and
write the tables the kernels read (moeserve/kernels/moe_config.py), like SGLang's/vLLM's fused-MoE tuning.

For each token count T: random top-k routing over E experts (distinct experts per token, as a gate picks them),
the contiguous layout moe_route builds (the gate/up GEMM reading each pair's row from the tokens, as the
single-rank dispatcher hands them over), then every candidate launch configuration of the gate/up GEMM (SiLU fused)
and of the down GEMM, timed with triton.testing.do_bench (median, weights far larger than L2), beside torch's
grouped GEMM (+ SiLU-and-mul) on the same layout. Prints, per T and op: the best config, its time, the weight
bytes it streams per second and its TFLOP/s, and torch's time. Where torch wins (bf16), the entry says
{"backend": "torch"}.

Tuning some token counts (--tokens) replaces those rows of an existing table and keeps the others.

Run on the GPU machine:
    python3 benchmark/kernels/tune_moe.py --model benchmarks/configs/deepseek-v2-lite [--tokens 1 64 256 ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve.core.layouts import gather_rows  # noqa: E402
from moeserve.kernels.activation import silu_and_mul  # noqa: E402
from moeserve.kernels.grouped_gemm import grouped_gemm  # noqa: E402
from moeserve.kernels.moe_config import config_file, device_name  # noqa: E402
from moeserve.kernels.moe_gemm import gemm_op, moe_gemm_reference  # noqa: E402
from moeserve.kernels.moe_route import moe_route  # noqa: E402
from moeserve.kernels.triton_ops.moe_gemm import moe_gemm  # noqa: E402


def wgmma_candidates(silu: bool) -> list[dict]:
    """The Gluon kernel's forms (triton_ops/moe_gemm_wgmma.py, Hopper): 128-row tiles, 64 or 128 columns (and 256
    without SiLU: one product a step), persistent programs in grouped-M order."""
    forms = [(128, 4, 8, True), (128, 3, 8, True), (128, 4, 16, True), (128, 4, 8, False), (64, 6, 16, True)]
    if not silu:
        forms += [(128, 6, 8, True), (256, 4, 8, True), (256, 3, 16, True)]
    return [dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=4, num_stages=st, GROUP_M=g, WGMMA=True,
                 **({"TILE_MAP": True} if mapped else {})) for bn, st, g, mapped in forms]


def candidates(rows_per_expert: float, silu: bool = False, hopper: bool = False) -> list[dict]:
    """Launch configurations worth timing at this many rows per expert (weight streaming at few rows, tensor-core
    tiles at many; on Hopper also the Gluon kernel's at many)."""
    out = wgmma_candidates(silu) if hopper and rows_per_expert > 64 else []
    if rows_per_expert <= 24:  # weight streaming: thin tiles, deep pipelines
        for bn, bk in itertools.product([32, 64, 128], [128, 256]):
            out.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4))
        out += [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=st) for st in (3, 5)]
        out.append(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4))
    if 8 < rows_per_expert <= 160:
        for bm, bn in itertools.product([32, 64], [64, 128]):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=4, num_stages=4))
        out.append(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4))
    if rows_per_expert > 64:  # tensor-core tiles
        for bn, st in itertools.product([128, 256], [3, 4]):
            out.append(dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=st))
        out.append(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4))
        out.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3))
        # the same tiles with w (and the down GEMM's rows) read through tensor descriptors
        for bm, bn, nw, st in [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 4),
                               (64, 256, 8, 4), (128, 128, 4, 4)]:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=nw, num_stages=st, TMA=True))
        for bm, bn, nw, st in [(128, 128, 8, 5), (128, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 5)]:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=nw, num_stages=st, TMA=True))
        out.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, TMA=True))
        for st, g in [(3, 8), (4, 8), (3, 4), (4, 16)]:  # grouped-M order: rows and weights shared in L2
            out.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=st, TMA=True, GROUP_M=g))
        for st, g in [(3, 0), (4, 0), (3, 8), (4, 8)]:  # the tiles read from a map built before the GEMM
            out.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=st, TMA=True, GROUP_M=g,
                            TILE_MAP=True))
    return out


def layout(T: int, E: int, k: int, H: int, dtype: torch.dtype, gen: torch.Generator):
    """The tokens and the single-rank dispatcher's plan for them (ep/local.py): the first GEMM reads each pair's
    row from the tokens (pairs), as at runtime."""
    ids = torch.rand(T, E, generator=gen, device="cuda").topk(k, dim=1).indices  # k distinct experts per token
    plan = moe_route(ids, E, all_valid=True)
    x = torch.randn(T, H, device="cuda", dtype=dtype, generator=gen)
    return x, plan.offsets, plan.counts, plan.src


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def tune_op(x, w, offsets, counts, silu: bool, T: int, pairs=None, top_k: int = 1) -> tuple[dict, dict]:
    """pairs: the layout's rows named in x (the first GEMM); the torch baseline gathers them, as its runtime
    path does (kernels/moe_gemm.py moe_gemm_reference)."""
    E, n_w, K = w.shape
    rows = x.shape[0] if pairs is None else pairs.shape[0]
    used = int((counts > 0).sum())
    flops = 2 * rows * n_w * K
    weight_bytes = used * n_w * K * w.element_size()
    torch_ms = bench(lambda: moe_gemm_reference(x, w, offsets, counts, silu, pairs, top_k))
    best, best_ms = None, float("inf")
    times = {}  # every candidate's median, in us
    hopper = torch.cuda.get_device_capability(w.device)[0] >= 9
    for cfg in candidates(rows / E, silu, hopper):
        try:
            ms = bench(lambda cfg=cfg: moe_gemm(x, w, offsets, counts, silu, cfg, pairs=pairs, top_k=top_k))
        except Exception as e:  # a configuration that does not compile or fit (shared memory): skip it
            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
            continue
        times[json.dumps(cfg, sort_keys=True)] = round(ms * 1e3, 1)
        if ms < best_ms:
            best, best_ms = cfg, ms
    entry = dict(best) if best_ms <= torch_ms or x.dtype != torch.bfloat16 else {"backend": "torch"}
    stats = dict(T=T, op=gemm_op(silu), rows=rows, experts_used=used, triton_ms=best_ms, torch_ms=torch_ms,
                 triton_weight_TBps=weight_bytes / best_ms / 1e9, triton_tflops=flops / best_ms / 1e9,
                 torch_weight_TBps=weight_bytes / torch_ms / 1e9, torch_tflops=flops / torch_ms / 1e9, config=best,
                 entry=entry, candidates_us=times)
    return entry, stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmarks/configs/deepseek-v2-lite", help="a config.json folder")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 1024, 4096, 8192])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stats", default=None, help="write the measurements as JSON lines here")
    ns = p.parse_args()
    cfg = json.loads((Path(ns.model) / "config.json").read_text())
    E, k, H, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    dtype = getattr(torch, ns.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=dtype, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, inter, device="cuda", dtype=dtype, generator=gen) * inter**-0.5
    tables: dict[str, dict[int, dict]] = {gemm_op(True): {}, gemm_op(False): {}}
    all_stats = []
    start = time.perf_counter()
    for T in ns.tokens:
        x, offsets, counts, pairs = layout(T, E, k, H, dtype, gen)
        h = silu_and_mul(grouped_gemm(gather_rows(x, pairs, k), w13, offsets, counts))
        for silu, w, a, p in ((True, w13, x, pairs), (False, w2, h, None)):
            entry, stats = tune_op(a, w, offsets, counts, silu, T, p, k if p is not None else 1)
            tables[gemm_op(silu)][stats["rows"]] = entry
            all_stats.append(stats)
            print(f"T {T:5d} {stats['op']:14s} rows {stats['rows']:6d}: triton {stats['triton_ms'] * 1e3:8.1f} us "
                  f"({stats['triton_weight_TBps']:.2f} TB/s of weights, {stats['triton_tflops']:.0f} TFLOP/s) | "
                  f"torch {stats['torch_ms'] * 1e3:8.1f} us ({stats['torch_weight_TBps']:.2f} TB/s, "
                  f"{stats['torch_tflops']:.0f} TFLOP/s) | {entry}", flush=True)
    for op, table in tables.items():
        N = inter if op == gemm_op(True) else H
        K = H if op == gemm_op(True) else inter
        path = config_file(op, E, N, K, dtype, device_name())
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {int(m): c for m, c in json.loads(path.read_text()).items()} if path.exists() else {}
        table = {**kept, **table}  # the rows tuned now replace theirs; the table's other rows stay
        path.write_text(json.dumps({str(m): c for m, c in sorted(table.items())}, indent=1) + "\n")
        print(f"wrote {path}")
    if ns.stats:
        with open(ns.stats, "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in all_stats)
    print(f"tuned in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
