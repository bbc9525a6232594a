"""When and where each program of the FP8 experts' GEMMs runs at decode: what a launch's fixed cost is made of.

docs/BENCHMARKS.md (2026-12-04) fits the FP8 decode gate/up GEMM to about 25 us a launch plus 4.1 TB/s, bf16's to
13 us plus 3.7: the FP8 step loses some 13 us a launch that no change to the K loop removed. This script records,
for every program of the Triton FP8 grouped GEMM (its TIMELINE flag, triton_ops/timeline.py), its start and end on
the GPU's global timer, its SM and its expert, over V2-Lite's decode chain as a step runs it (the gathered rows
quantized, gate/up, SiLU-and-mul + quantize, down; --layers layers with their own weights, in one CUDA graph, the
same random layout as scripts/gpu/fp8_graph_tune.py's), and prints for each GEMM:
- the span (first program's start to last one's end) and the gap after the launch before it;
- the programs' durations (median, 90th percentile, max);
- the rate of the middle 80% of the span (each program's bytes counted as streamed evenly over its life), and
  the ramp and tail: how long the first and last 10% of the bytes take, beside what they would take at that rate;
- the SMs' last ends: how far apart the SMs finish.
The raw buffers go to --out (torch.save) for a closer look.

    python3 scripts/gpu/decode_gemm_timeline.py [--tokens 64 256] [--layers 4] [--out timeline.pt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_graph_tune import INTER, SHARED, TOP_K, E, H, layout  # noqa: E402

from moeserve.kernels.fp8_format import BLOCK  # noqa: E402
from moeserve.kernels.fp8_quant import quantize_weight  # noqa: E402
from moeserve.kernels.moe_config import get_config  # noqa: E402
from moeserve.kernels.triton_ops import fp8_grouped_gemm as grouped  # noqa: E402
from moeserve.kernels.triton_ops.fp8_quant import quantize_rows  # noqa: E402


def gemm(xq, xs, w, ws, offsets, counts, timeline):
    """fp8_grouped_gemm with the table's entry, its programs' times appended to timeline."""
    m, k = xq.shape
    cfg = get_config(grouped.OPS[False], m, w.shape[0], w.shape[1], k, xq.dtype, xq.device,
                     default=grouped.default_config)
    assert not cfg.get("WGMMA"), "the decode entries run the Triton kernel"
    out = torch.empty(m, w.shape[1], dtype=torch.bfloat16, device=xq.device)
    grouped._launch(xq, xs, w, ws, out, offsets, counts, 0, False, cfg, timeline=timeline)
    return out, cfg


def _bytes_between(live: torch.Tensor, bytes_each: int, t0: float, t1: float) -> float:
    """The bytes the programs [start, end] (ns, float64, from the launch's start) streamed between t0 and t1, each
    evenly over its life (a program's share of its time inside the window)."""
    s, e = live[:, 0], live[:, 1]
    inside = (e.clamp(max=t1) - s.clamp(min=t0)).clamp(min=0)
    return float((inside / (e - s).clamp(min=1)).sum()) * bytes_each


def _bytes_done_at(live: torch.Tensor, bytes_each: int, target: float) -> float:
    """The time (ns, as live's) by which the programs had streamed `target` bytes (bisection on `_bytes_between`)."""
    lo, hi = float(live[:, 0].min()), float(live[:, 1].max())
    first = lo
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _bytes_between(live, bytes_each, first, mid) < target else (lo, mid)
    return hi


def summary(name: str, t: torch.Tensor, prev_end: int | None, bytes_each: int) -> int:
    """One line for a launch's [programs, 4] buffer (start, end, SM, expert; expert -1: an empty tile)."""
    live = t[t[:, 3] >= 0]
    start, end = int(t[:, 0].min()), int(t[:, 1].max())
    dur = (live[:, 1] - live[:, 0]).double() / 1e3
    n = live.shape[0]
    rel = (live[:, :2] - start).double()  # ns from the launch's first start: float64 keeps them exact
    lo = start + _bytes_done_at(rel, bytes_each, 0.1 * n * bytes_each)
    hi = start + _bytes_done_at(rel, bytes_each, 0.9 * n * bytes_each)
    t0, t1 = 0.1 * (end - start), 0.9 * (end - start)
    mid_rate = _bytes_between(rel, bytes_each, t0, t1) / (t1 - t0)  # bytes a ns in the span's middle 80%
    ramp_ideal = 0.1 * n * bytes_each / mid_rate
    sm_last = torch.zeros(int(t[:, 2].max()) + 1, dtype=torch.int64)
    sm_last.scatter_reduce_(0, live[:, 2], live[:, 1], reduce="amax")
    sm_last = sm_last[sm_last > 0].double()
    gap = f"{(start - prev_end) / 1e3:5.1f}" if prev_end is not None else "    -"
    print(f"{name:10s} span {(end - start) / 1e3:6.1f} us (gap before {gap}) | {n:5d} programs "
          f"({t.shape[0] - n} empty), {dur.median():5.1f} / {dur.quantile(0.9):5.1f} / {dur.max():5.1f} us | "
          f"middle {mid_rate / 1e3:.2f} TB/s, {n * bytes_each / (end - start) / 1e3:.2f} overall | "
          f"ramp {(lo - start) / 1e3:5.1f} us (at the middle's rate {ramp_ideal / 1e3:4.1f}), "
          f"tail {(end - hi) / 1e3:5.1f} ({ramp_ideal / 1e3:4.1f}) | SMs end within "
          f"{(sm_last.max() - sm_last.min()) / 1e3:5.1f} us (10th-90th pct {(sm_last.quantile(0.9) - sm_last.quantile(0.1)) / 1e3:5.1f})",
          flush=True)
    return end


def chain_timeline(T: int, w13: list, w2: list, gen: torch.Generator, ns) -> dict[str, torch.Tensor]:
    """T tokens' chain over the layers in one graph: its time a layer and one line a GEMM; the buffers by name."""
    offsets, counts, pairs = layout(T, gen)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    timeline: list[torch.Tensor] = []
    cfgs: list[dict] = []

    def step():
        timeline.clear()
        for (wa, sa), (wb, sb) in zip(w13, w2, strict=True):
            xq, xs = quantize_rows(x, False, mn_major=True, pairs=pairs, top_k=TOP_K + SHARED)
            h, c1 = gemm(xq, xs, wa, sa, offsets, counts, timeline)
            hq, hs = quantize_rows(h, True, mn_major=True)
            _, c2 = gemm(hq, hs, wb, sb, offsets, counts, timeline)
            cfgs[:] = [c1, c2]

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(ns.replays):
        g.replay()
    ms = triton.testing.do_bench(g.replay, warmup=3, rep=30, return_mode="median")
    g.replay()  # the buffers read below: this replay's
    torch.cuda.synchronize()
    print(f"T={T}: {pairs.shape[0]} rows, the chain {ms * 1e3 / ns.layers:.1f} us a layer in the graph | "
          f"gate/up {cfgs[0]} | down {cfgs[1]}", flush=True)
    prev, saved = None, {}
    for i, t in enumerate(timeline):
        t = t.cpu()
        bn, k = cfgs[i % 2]["BLOCK_N"], (H if i % 2 == 0 else INTER)
        prev = summary(f"L{i // 2} {'gate/up' if i % 2 == 0 else 'down'}", t, prev,
                       bn * triton.cdiv(k, BLOCK) * BLOCK)
        saved[f"T{T}_{i}"] = t
    return saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replays", type=int, default=5, help="the graph replayed this often; the last one is read")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weights(n: int, k: int):
        return [quantize_weight(torch.randn(E + SHARED, n, k, device="cuda", generator=gen) * k**-0.5)
                for _ in range(ns.layers)]

    w13, w2 = weights(2 * INTER, H), weights(H, INTER)
    saved = {}
    for T in ns.tokens:
        saved.update(chain_timeline(T, w13, w2, gen, ns))
    if ns.out:
        torch.save(saved, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
