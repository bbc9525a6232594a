"""The experts' GEMMs at a prefill size, each beside its ceiling and with the tuned tables' tile map on and off, in
rounds that alternate the variants (one H200 drifts by a few percent over a minute; alternating keeps the pairs fair).

V2-Lite's shapes (E 64, top-6, H 2048, I 1408) at T tokens (default 8,192: a 4 x 2,048 prefill), random top-k routing
with distinct experts a token (scripts/gpu/tune_moe.py's layout):
- bf16: the gate/up GEMM with SiLU fused (reading the tokens by pairs, as at runtime) and the down GEMM, each with
  the tuned table's entry (`moeserve.kernels.moe_gemm.moe_gemm`: Triton, or torch's grouped GEMM where the table
  says) and the Triton entry without its tile map; beside a dense bf16 8,192^3 `torch.mm` (the peak).
- FP8 (--quantization fp8's recipe): the contiguous gate/up and down grouped GEMMs (table entry, and without the tile
  map) and the masked gate/up; beside `torch._scaled_mm` on the gate/up's M x N x K (per-tensor scales, the ceiling)
  and `torch._scaled_grouped_mm` on the same rows and experts (row-wise scales, groups padded to 16 rows).
Prints the median over the rounds of each, in us and TFLOP/s; --result-file appends them as one JSON line.

Run on the GPU machine: python3 scripts/gpu/expert_gemm_ab.py [--tokens 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_fp8 import masked_rows, rel  # noqa: E402
from tune_moe import layout, wgmma_candidates  # noqa: E402

from moeserve.kernels.fp8_format import FP8_DTYPE  # noqa: E402
from moeserve.kernels.fp8_quant import quantize_activations, quantize_weight  # noqa: E402
from moeserve.kernels.moe_config import get_config  # noqa: E402
from moeserve.kernels.moe_gemm import gemm_op, moe_gemm  # noqa: E402
from moeserve.kernels.triton_ops import moe_gemm as triton_moe_gemm  # noqa: E402
from moeserve.kernels.triton_ops.fp8_grouped_gemm import OPS, fp8_grouped_gemm, fp8_grouped_gemm_masked  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def without_map(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "TILE_MAP"}


WGMMA_FORMS = [dict(BLOCK_M=128, BLOCK_N=bn, num_warps=4, num_stages=st, GROUP_M=8, WGMMA=True, TILE_MAP=True)
               for bn, st in [(128, 4), (128, 5), (128, 6), (64, 6)]]


def add_wgmma(cases: dict, fp8: tuple, offsets, counts, E: int, cap: int, H: int, flops_up: int,
              flops_down: int) -> None:
    """The Gluon kernel's cases, each form checked against the table's kernel on the same inputs (relative error
    of the bf16 outputs; a form that errs is reported and left out)."""
    xq, xs, w13q, w13s, hq, hs, w2q, w2s, sq, ss = fp8

    def up(c=None):
        return fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16, c)

    def down(c=None):
        return fp8_grouped_gemm(hq, hs, w2q, w2s, offsets, counts, torch.bfloat16, c)

    def masked(c=None):
        return fp8_grouped_gemm_masked(sq.view(E, cap, H), ss.view(E, cap, -1), w13q, w13s, counts, torch.bfloat16, c)

    valid = torch.cat([torch.arange(e * cap, e * cap + n, device="cuda") for e, n in enumerate(counts.tolist())])
    refs = {"gate/up": up().float(), "down": down().float(), "gate/up masked": masked().view(E * cap, -1)[valid].float()}
    for c in WGMMA_FORMS:
        tag = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
        for name, fn, flops in (("gate/up", up, flops_up), ("down", down, flops_down),
                                ("gate/up masked", masked, flops_up)):
            try:
                got = fn(c)
                err = rel(got.view(E * cap, -1)[valid] if name == "gate/up masked" else got, refs[name])
            except Exception as e:  # noqa: BLE001 (a form that does not compile or fit: reported, left out)
                print(f"wgmma {tag} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"wgmma {tag} {name}: rel {err:.2e} against the table's kernel", flush=True)
            if err < 2e-2:
                cases[f"fp8 {name}, wgmma {tag}"] = (lambda fn=fn, c=c: fn(c), flops)


def add_bf16_wgmma(cases: dict, x, w13, h, w2, offsets, counts, pairs, k: int, flops_up: int,
                   flops_down: int) -> None:
    """The Gluon bf16 kernel's forms (tune_moe.wgmma_candidates), each checked against the Triton kernel on the
    same inputs first (a form that errs is reported and left out)."""
    tri = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True)
    valid = torch.cat([torch.arange(int(o), int(o) + int(n), device="cuda")
                       for o, n in zip(offsets[:-1].tolist(), counts.tolist(), strict=True)])
    for silu, a, w, p, flops in ((True, x, w13, pairs, flops_up), (False, h, w2, None, flops_down)):
        def fn(c, a=a, w=w, p=p, silu=silu):
            return triton_moe_gemm.moe_gemm(a, w, offsets, counts, silu, c, pairs=p, top_k=k if p is not None else 1)

        ref = fn(tri)[valid].float()
        for c in wgmma_candidates(silu):
            tag = f"{c['BLOCK_N']} s{c['num_stages']} g{c['GROUP_M']}{' map' if c.get('TILE_MAP') else ''}"
            name = f"bf16 {'gate/up + SiLU' if silu else 'down'}, wgmma {tag}"
            try:
                err = rel(fn(c)[valid].float(), ref)
            except Exception as e:  # noqa: BLE001 (a form that does not compile or fit: reported, left out)
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"{name}: rel {err:.2e} against the Triton kernel", flush=True)
            if err < 2e-2:
                cases[name] = (lambda fn=fn, c=c: fn(c), flops)


def add_fp8(cases: dict, wgmma: bool, x, w13, h, w2, offsets, counts, pairs, k: int, flops_up: int,
            flops_down: int) -> dict:
    """The FP8 cases (--quantization fp8's recipe) beside torch._scaled_mm's ceiling, and with `wgmma` the Gluon
    forms; returns the FP8 tables' entries."""
    E, _, H = w13.shape
    M = pairs.shape[0]
    inter = w2.shape[2]
    # FP8: the same layout's rows, quantized as the experts quantize them
    rows = x.index_select(0, pairs.long() // k)
    xq, xs = quantize_activations(rows, mn_major=True)
    hq, hs = quantize_activations(h, mn_major=True)
    w13q, w13s = quantize_weight(w13)
    w2q, w2s = quantize_weight(w2)
    cap = int(counts.max())
    sq, ss = quantize_activations(masked_rows(rows, offsets, counts).view(E * cap, H), mn_major=True)
    f8_up = get_config(OPS[False], M, E, 2 * inter, H, FP8_DTYPE, x.device)
    f8_down = get_config(OPS[False], M, E, H, inter, FP8_DTYPE, x.device)
    f8_masked = get_config(OPS[True], E * cap, E, 2 * inter, H, FP8_DTYPE, x.device)
    print(f"FP8 tables: gate/up {f8_up}; down {f8_down}; masked gate/up {f8_masked}")
    one = torch.ones((), device="cuda")
    wt = w13q[0].t()
    cases.update({
    "fp8 _scaled_mm gate/up shape (ceiling)": (
        lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), flops_up),
    "fp8 gate/up, table": (lambda: fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16),
                           flops_up),
    "fp8 gate/up, no map": (lambda: fp8_grouped_gemm(xq, xs, w13q, w13s, offsets, counts, torch.bfloat16,
                                                     without_map(f8_up)), flops_up),
    "fp8 gate/up masked, table": (lambda: fp8_grouped_gemm_masked(sq.view(E, cap, H), ss.view(E, cap, -1), w13q,
                                                                  w13s, counts, torch.bfloat16), flops_up),
    "fp8 down, table": (lambda: fp8_grouped_gemm(hq, hs, w2q, w2s, offsets, counts, torch.bfloat16), flops_down),
    "fp8 down, no map": (lambda: fp8_grouped_gemm(hq, hs, w2q, w2s, offsets, counts, torch.bfloat16,
                                                  without_map(f8_down)), flops_down),
    })
    add_scaled_grouped_mm(cases, (xq, w13q, hq, w2q), offsets, counts)
    if wgmma:
        add_wgmma(cases, (xq, xs, w13q, w13s, hq, hs, w2q, w2s, sq, ss), offsets, counts, E, cap, H,
                  flops_up, flops_down)
    return dict(fp8_up=f8_up, fp8_down=f8_down, fp8_masked=f8_masked)


def add_scaled_grouped_mm(cases: dict, fp8: tuple, offsets, counts) -> None:
    """torch._scaled_grouped_mm (CUTLASS's FP8 grouped GEMM in PyTorch) on the same e4m3 rows and weights, with
    row-wise scales (one a row of a, one a column of each expert's b: what it takes on Hopper; not DeepSeek's
    128-block recipe, so a peer, not a drop-in). Its groups must start on 16-row boundaries: each expert's rows are
    copied into a layout padded so (the padding rows are computed too, and counted in its TFLOP/s)."""
    xq, w13q, hq, w2q = fp8
    padded = (counts + 15) // 16 * 16
    ends = torch.cumsum(padded, 0).to(torch.int32)
    m_pad = int(ends[-1])
    src = torch.full((m_pad,), -1, dtype=torch.long, device=xq.device)
    starts, dsts = offsets[:-1].tolist(), (ends - padded).tolist()
    for start, n, dst in zip(starts, counts.tolist(), dsts, strict=True):
        src[dst:dst + n] = torch.arange(start, start + n, device=xq.device)
    keep = src >= 0

    def pad_rows(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(m_pad, t.shape[1], dtype=t.dtype, device=t.device)
        out[keep] = t[src[keep]]
        return out

    scale_a = torch.ones(m_pad, dtype=torch.float32, device=xq.device)
    for name, a, w in (("gate/up", pad_rows(xq), w13q), ("down", pad_rows(hq), w2q)):
        b = w.transpose(1, 2)  # [E, K, N], column-major as the op wants it
        scale_b = torch.ones(b.shape[0], b.shape[2], dtype=torch.float32, device=xq.device)

        def fn(a=a, b=b, scale_b=scale_b):
            return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16)

        try:
            busiest = int(torch.argmax(counts))  # its rows against a float32 product of the same values
            start = int(ends[busiest] - padded[busiest])
            rows = slice(start, start + int(counts[busiest]))
            err = rel(fn()[rows].float(), a[rows].float() @ b[busiest].float())
            print(f"fp8 torch._scaled_grouped_mm {name}: rel {err:.2e} against float32 on expert {busiest}", flush=True)
        except Exception as e:  # noqa: BLE001 (this torch's build may not take it: reported, left out)
            print(f"fp8 torch._scaled_grouped_mm {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        flops = 2 * m_pad * b.shape[1] * b.shape[2]
        cases[f"fp8 torch._scaled_grouped_mm {name} (row-wise, {m_pad} rows)"] = (fn, flops)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="run dense matrix products this long first (a machine's first minute measures slow)")
    p.add_argument("--wgmma", action="store_true",
                   help="also the Gluon FP8 kernel (triton_ops/fp8_grouped_wgmma.py) in each of WGMMA_FORMS, checked "
                        "against the table's kernel first")
    p.add_argument("--bf16-wgmma", action="store_true",
                   help="also the Gluon bf16 kernel (triton_ops/moe_gemm_wgmma.py) in each of tune_moe's Gluon forms")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="the FP8 cases (default on)")
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    E, k, H, inter, T = 64, 6, 2048, 1408, ns.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * inter**-0.5
    x, offsets, counts, pairs = layout(T, E, k, H, torch.bfloat16, gen)
    M = pairs.shape[0]
    h = torch.randn(M, inter, device="cuda", dtype=torch.bfloat16, generator=gen)  # the down GEMM's rows
    flops_up, flops_down = 2 * M * 2 * inter * H, 2 * M * H * inter
    cfg_up = get_config(gemm_op(True), M, E, inter, H, torch.bfloat16, x.device)
    cfg_down = get_config(gemm_op(False), M, E, H, inter, torch.bfloat16, x.device)
    print(f"tables: gate/up {cfg_up}; down {cfg_down}")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)
    cases = {  # name -> (fn, flops)
        "bf16 dense mm 8192^3 (peak)": (lambda: torch.mm(a, b), 2 * 8192**3),
        "bf16 gate/up + SiLU, table": (lambda: moe_gemm(x, w13, offsets, counts, silu=True, pairs=pairs, top_k=k),
                                        flops_up),
        "bf16 gate/up + SiLU, no map": (lambda: triton_moe_gemm.moe_gemm(x, w13, offsets, counts, True,
                                                                         without_map(cfg_up), pairs=pairs, top_k=k),
                                         flops_up),
        "bf16 down, table": (lambda: moe_gemm(h, w2, offsets, counts), flops_down),
    }
    before = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True)  # the entry before the map
    cases["bf16 gate/up + SiLU, 4 stages no map"] = (
        lambda: triton_moe_gemm.moe_gemm(x, w13, offsets, counts, True, before, pairs=pairs, top_k=k), flops_up)
    if "BLOCK_M" in cfg_down:  # the down GEMM's table entry is a Triton one: time it without the map too
        cases["bf16 down, no map"] = (lambda: triton_moe_gemm.moe_gemm(h, w2, offsets, counts, False,
                                                                       without_map(cfg_down)), flops_down)
    if ns.bf16_wgmma:
        add_bf16_wgmma(cases, x, w13, h, w2, offsets, counts, pairs, k, flops_up, flops_down)
    tables = dict(bf16_up=cfg_up, bf16_down=cfg_down)
    if ns.fp8:
        tables.update(add_fp8(cases, ns.wgmma, x, w13, h, w2, offsets, counts, pairs, k, flops_up, flops_down))
    end = time.perf_counter() + ns.warmup_s
    while time.perf_counter() < end:
        torch.mm(a, b)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(ns.rounds):  # each round in its own order: a case timed right after the dense product ran 5-9%
        order = list(cases)     # slower than the same configuration later in the round (2026-12-03)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(bench(cases[name][0]))
    out = dict(tokens=T, rows=M, device=torch.cuda.get_device_name(), tables=tables, cases={})
    for name, (_, flops) in cases.items():
        ms = statistics.median(times[name])
        out["cases"][name] = dict(us=ms * 1e3, tflops=flops / ms / 1e9, rounds_us=[t * 1e3 for t in times[name]])
        print(f"{name:40s} {ms * 1e3:9.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s")
    c = out["cases"]
    both = (flops_up + flops_down) / (c["bf16 gate/up + SiLU, table"]["us"] + c["bf16 down, table"]["us"]) / 1e6
    peak = c["bf16 dense mm 8192^3 (peak)"]["tflops"]
    print(f"bf16 experts (gate/up + down, tables): {both:.1f} TFLOP/s = {both / 779:.1%} of 779, "
          f"{both / peak:.1%} of this run's dense mm ({peak:.0f})")
    out.update(bf16_experts_tflops=both, dense_peak_tflops=peak)
    if ns.bf16_wgmma:  # the fastest Gluon form of each GEMM, together
        up = min((v["us"], n) for n, v in c.items() if n.startswith("bf16 gate/up + SiLU, wgmma"))
        down = min((v["us"], n) for n, v in c.items() if n.startswith("bf16 down, wgmma"))
        best = (flops_up + flops_down) / (up[0] + down[0]) / 1e6
        print(f"bf16 experts, fastest Gluon forms ({up[1]}; {down[1]}): {best:.1f} TFLOP/s = {best / 779:.1%} of 779, "
              f"{best / peak:.1%} of this run's dense mm")
        out.update(bf16_wgmma_best_tflops=best)
    if ns.fp8:
        fp8_both = (flops_up + flops_down) / (c["fp8 gate/up, table"]["us"] + c["fp8 down, table"]["us"]) / 1e6
        print(f"fp8 experts (gate/up + down, tables): {fp8_both:.1f} TFLOP/s; gate/up "
              f"{c['fp8 gate/up, table']['tflops'] / 1416:.1%} of 1,416, masked "
              f"{c['fp8 gate/up masked, table']['tflops'] / 1416:.1%}")
        out.update(fp8_experts_tflops=fp8_both)
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
