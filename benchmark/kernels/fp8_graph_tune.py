"""In-graph tuner of the FP8 GEMMs at decode sizes: each candidate launch configuration timed as a decode step
runs it, in CUDA graphs, against the tuned table's entry.

V2-Lite's shapes at T tokens of decode: the experts' gate/up (its rows gathered from the tokens, random top-6
routing plus the 2 shared slots, E 66, N 2,816, K 2,048) and down (silu(gate) * up of the gate/up output, N 2,048, K
1,408), through fp8_grouped_gemm_act, with benchmark/kernels/tune_fp8.py's candidates at the layout's rows per expert (as
its --decode-batches sweep takes them: Triton tiles, tiles from a map, the Gluon kernel's forms); the linear layers'
q + kv_a (3,648 x 2,048) and o_proj (2,048 x 2,048) and layer 0's dense MLP (gate/up 22,016 x 2,048, down 2,048 x
11,008 from [gate | up] rows: I 10,944 padded to whole 128-blocks, as the FP8 layer holds it), through fp8_linear,
with tune_fp8.py's dense candidates at T rows (Triton tiles and cuBLAS). Each runs as the layers run it: the
quantizer (triton_ops/fp8_quant.py), then the GEMM; q + kv_a the GEMM alone, its rows quantized by the RMSNorm
before it (kernels/rms_norm.py rms_norm_quant). tune_fp8.py times
the GEMM alone under do_bench, where a 10-us GEMM's time is mostly the host's; here a case runs --layers times, each
with its own copy of the weights (nothing stays in L2), captured in one CUDA graph, and the replay's time a layer is
reported (the median of --rounds timings of its replays). Each candidate is checked against the table's entry's
output first (the same e4m3 rows, so the same sums up to their order and the MMA's precision).

--write: at each T measured the tables (the experts' ops at decode's rows-per-expert key, as tune_fp8.py
--decode-batches writes them; fp8_gemm at T rows) get the best candidate where it beats the table's entry by more
than --margin, else the entry the lookup found, pinned at that key (so that a new entry's nearest-key reach stops at
the sizes measured without it: 1,024 tokens is a prefill's size).

Run on the GPU machine (CUDA graphs: no CPU run):
    python3 benchmark/kernels/fp8_graph_tune.py [--tokens 64 128 256 1024] [--layers 26] [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_fp8 import candidates, dense_candidates, write_table  # noqa: E402

from moeserve.kernels.fp8_format import FP8_DTYPE  # noqa: E402
from moeserve.kernels.fp8_quant import quantize_weight  # noqa: E402
from moeserve.kernels.moe_config import get_config  # noqa: E402
from moeserve.kernels.triton_ops import fp8_gemm as dense  # noqa: E402
from moeserve.kernels.triton_ops import fp8_grouped_gemm as grouped  # noqa: E402
from moeserve.kernels.triton_ops.fp8_quant import quantize_rows  # noqa: E402

E, SHARED, TOP_K, H, INTER = 64, 2, 6, 2048, 1408
DENSE_INTER = 11008  # layer 0's MLP, 10,944 padded to whole 128-blocks (layers/quantization/fp8_mlp.py)


def layout(T: int, gen: torch.Generator):
    """Decode's contiguous layout: (offsets [E + S + 1], counts [E + S], pairs [T * (k + S)]): each token's top-6
    routed experts and the shared slots, rows sorted by expert (row r holds pair pairs[r], token pairs[r] // 8)."""
    routed = torch.rand(T, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    shared = torch.arange(E, E + SHARED, device="cuda").expand(T, SHARED)
    flat = torch.cat([routed, shared], dim=1).flatten()
    pairs = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=E + SHARED).to(torch.int32)
    offsets = torch.zeros(E + SHARED + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets, counts, pairs


def graph_us(step, rounds: int, layers: int) -> float:
    """us a layer: the step (layers launches) captured once, replayed `rounds` times (median)."""
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    times = [triton.testing.do_bench(g.replay, warmup=3, rep=30, return_mode="median") for _ in range(rounds)]
    return sorted(times)[len(times) // 2] * 1e3 / layers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def run_case(name: str, fn, weights: list, cands: list[dict], table_cfg: dict, ns, rows=None) -> dict:
    """fn(w, s, config) -> out. The table's entry against each other candidate, in graphs."""
    ref = fn(*weights[0], table_cfg)
    ref = ref if rows is None else ref[rows]
    res = {"table": (table_cfg, graph_us(lambda: [fn(w, s, table_cfg) for w, s in weights], ns.rounds,
                                         len(weights)))}
    print(f"{name}: the table's entry {res['table'][1]:7.1f} us a layer | {table_cfg}", flush=True)
    for c in cands:
        if c == table_cfg:
            continue
        try:
            out = fn(*weights[0], c)
            err = rel(out if rows is None else out[rows], ref)
            if not err < 1e-3:
                print(f"  WRONG {c}: rel {err:.2e}", flush=True)
                continue
            us = graph_us(lambda c=c: [fn(w, s, c) for w, s in weights], ns.rounds, len(weights))
        except Exception as e:  # noqa: BLE001 (does not compile or fit: reported, left out)
            print(f"  skip {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        res[json.dumps(c)] = (c, us)
        print(f"  {us:7.1f} us a layer ({res['table'][1] / us:.2f}x as fast) | {c}", flush=True)
    return res


def best_candidate(res: dict) -> tuple[dict | None, float]:
    cands = [v for k, v in res.items() if k != "table"]
    return min(cands, key=lambda v: v[1]) if cands else (None, float("inf"))


def step_cases(T: int, key: int, x, h, offsets, counts, pairs, w13, w2, dense_w) -> list:
    """(name, op, (table E, N, K), table key, fn(w, s, config), weight copies, candidates) at T tokens."""
    bf = torch.bfloat16
    expert_cands = candidates(pairs.shape[0] // (E + SHARED))  # tune_fp8.py's, at the layout's rows per expert
    return [
        ("experts gate/up", grouped.OPS[False], (E, 2 * INTER, H), key,
         lambda w, s, c: grouped.fp8_grouped_gemm_act(x, w, s, offsets, counts, bf, pairs, TOP_K + SHARED, config=c),
         w13, expert_cands),
        ("experts down", grouped.OPS[False], (E, H, INTER), key,
         lambda w, s, c: grouped.fp8_grouped_gemm_act(h, w, s, offsets, counts, bf, silu=True, config=c), w2,
         expert_cands),
    ] + [(name, dense.OP, (1, *ws[0][0].shape), T, dense_fn(name, a, silu), ws,
          dense_candidates(T, ws[0][0].shape[1]))
         for name, (ws, a, silu) in dense_inputs(x, dense_w).items()]


def dense_fn(name: str, a: torch.Tensor, silu: bool):
    """fn(w, s, config) of a linear layer as the step runs it: the quantizer, then the GEMM; q + kv_a's rows come
    quantized by the norm before it (kernels/rms_norm.py rms_norm_quant), so there only the GEMM is timed."""
    if name == "q + kv_a":
        aq, as_ = quantize_rows(a, False, mn_major=True)
        return lambda w, s, c: dense.fp8_gemm(aq, as_, w, s, a.dtype, config=c)
    return lambda w, s, c: dense.fp8_linear(a, w, s, silu, config=c)


def dense_inputs(x: torch.Tensor, dense_w: dict) -> dict:
    """Each linear layer's (weights, input, silu): x for the attention's and the dense MLP's gate/up, [gate | up]
    rows for the dense MLP's down."""
    out = {}
    for name, ws in dense_w.items():
        silu = name == "dense MLP down"
        a = torch.randn(x.shape[0], 2 * ws[0][0].shape[1], device=x.device, dtype=x.dtype) if silu else x
        out[name] = (ws, a, silu)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 1024])
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--write", action="store_true")
    p.add_argument("--margin", type=float, default=0.02, help="--write: a candidate must be this much faster")
    p.add_argument("--cases", nargs="+", default=None, help="only the cases whose names hold one of these words")
    p.add_argument("--match", default=None, help="only the candidates whose JSON holds this text (and the table's)")
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def copies(n: int, k: int, e: int | None = None):
        shape = (n, k) if e is None else (e, n, k)
        w, s = quantize_weight(torch.randn(*shape, device="cuda", generator=gen) * k**-0.5)
        return [(w.clone(), s.clone()) for _ in range(ns.layers)]

    w13, w2 = copies(2 * INTER, H, E + SHARED), copies(H, INTER, E + SHARED)
    dense_w = {"q + kv_a": copies(3648, H), "o_proj": copies(H, H), "dense MLP gate/up": copies(2 * DENSE_INTER, H),
               "dense MLP down": copies(H, DENSE_INTER)}
    tables: dict[tuple, dict] = {}
    out = dict(device=torch.cuda.get_device_name(), layers=ns.layers, cases=[])
    for T in ns.tokens:
        offsets, counts, pairs = layout(T, gen)
        M = pairs.shape[0]
        valid = torch.zeros(M, dtype=torch.bool, device="cuda")
        valid[: int(offsets[-1])] = True
        x = torch.randn(T, H, device="cuda", dtype=bf, generator=gen)
        h = torch.randn(M, 2 * INTER, device="cuda", dtype=bf, generator=gen)
        key = round(M * E / (E + SHARED))  # tune_fp8.py --decode-batches' key in E's table
        cases = step_cases(T, key, x, h, offsets, counts, pairs, w13, w2, dense_w)
        for name, op, (e, n, k), tkey, fn, weights, cands in cases:
            if ns.cases and not any(c in name for c in ns.cases):
                continue
            if ns.match:
                cands = [c for c in cands if ns.match in json.dumps(c)]
            table_cfg = get_config(op, M if e > 1 else T, E + SHARED if e > 1 else 1, n, k, FP8_DTYPE,
                                   default=grouped.default_config if e > 1 else dense.default_config)
            res = run_case(f"T={T} {name}", fn, weights, cands, table_cfg, ns, None if e == 1 else valid)
            c, us = best_candidate(res)
            base_us = res["table"][1]
            print(f"T={T} {name}: best candidate {us:.1f} us against {base_us:.1f} ({base_us / us:.2f}x) | {c}",
                  flush=True)
            out["cases"].append(dict(T=T, case=name, table=res["table"][0], table_us=base_us, best=c, best_us=us))
            if ns.write:
                wins = c is not None and us < base_us * (1 - ns.margin)
                tables.setdefault((op, e, n, k), {})[tkey] = c if wins else res["table"][0]
    for (op, e, n, k), table in tables.items():
        write_table(op, e, n, k, table)
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
