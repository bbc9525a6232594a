"""One MLA layer's extend attention on the CPU, expanded against absorbed (layers/attention/latent_extend.py), for
one request of T new tokens over L cached ones: CPU time of MLAttention._attend on one thread (the latent cache read back, the
attention, the output through W_UV where absorbed), the least of several runs, beside the rule's pick.
    python benchmark/experiments/bench_latent_extend.py [--shapes default,v2lite,forward] [--dtype bfloat16] [--fit]
--fit: after the layer shapes, each form's nanoseconds per unit of work (layers/attention/latent_extend.py's
FormCost, its CPU_FORM_COSTS) fitted to the times by least squares on the relative error, and the fit's picks.
Shapes: the embedded default model's (4 heads, latent 64, rope 16, nope 32, v 32) and DeepSeek-V2-Lite's
(16 heads, latent 512, rope 64, nope 128, v 128), random weights; "forward": the default model's whole forward
(its weights, float32) for 100 new tokens over L cached, each form forced.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import moeserve.models.deepseek as deepseek
from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.core.model_config import ModelConfig
from moeserve.kvcache.kv_pool import make_kv_pool
from moeserve.layers.attention.latent_extend import FormCost, MLAShape, absorbed_requests, query_key_pairs
from moeserve.layers.attention.ops import AttentionMetadata
from moeserve.models.default_model import default_model_path

V2_LITE = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
T_VALUES, L_VALUES = (16, 64, 256, 1024), (0, 512, 2048)


def layer(shape: str, dtype: torch.dtype) -> tuple[deepseek.MLAttention, ModelConfig]:
    config = ModelConfig.from_pretrained(default_model_path())
    if shape == "v2lite":
        raw = json.loads((Path(default_model_path()) / "config.json").read_text())
        raw.update(V2_LITE)
        config = ModelConfig.from_dict(raw)
    attn = deepseek.MLAttention(config, 0, rotary=None)
    gen = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).to(dtype)
    attn.process_weights_after_loading(torch.device("cpu"))
    return attn, config


def time_ms(fn, reps: int) -> float:
    """The least CPU time of `reps` runs on this thread (one torch thread: the VM is shared, and CPU time does not
    count the time other processes hold the core)."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        runs.append((time.thread_time() - t0) * 1e3)
    return min(runs)


def bench(shape: str, dtype: torch.dtype, reps: int) -> list[tuple[MLAShape, int, int, float, float]]:
    """Times one layer of `shape` at every (T, L); (widths, T, L, expanded ms, absorbed ms) per row."""
    rows = []
    attn, config = layer(shape, dtype)
    n = max(T_VALUES) + max(L_VALUES) + 1
    pool = make_kv_pool(config, n, 1, dtype, "cpu")
    gen = torch.Generator().manual_seed(1)
    cache = pool.get_latent(0)
    cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    slots = (torch.randperm(n - 1, generator=gen) + 1).tolist()  # scattered over the pool, as served
    h = attn.num_heads
    print(f"{shape} ({h} heads, latent {attn.kv_lora_rank}), {dtype}, {torch.get_num_threads()} threads")
    print(f"{'T':>5} {'L':>6} {'expanded ms':>12} {'absorbed ms':>12} {'ratio':>6} {'rule picks':>10}")
    for L in L_VALUES:
        for T in T_VALUES:
            kv = slots[: L + T]
            batch = ForwardBatch.build(ForwardMode.EXTEND, [3] * T, [L + T], [T], kv[L:], kv, pool)
            meta = AttentionMetadata.build(batch, None)
            q_nope = torch.randn(T, h, attn.nope_dim, generator=gen).to(dtype)
            q_rope = torch.randn(T, h, attn.rope_dim, generator=gen).to(dtype)
            ms = {}
            with torch.no_grad():
                for absorbed in (False, True):
                    deepseek.absorbed_requests = lambda shape, plan, ext, seq, q, absorbed=absorbed: [absorbed] * len(ext)
                    meta.memo.clear()  # the step's form is memoized by its first layer: choose again
                    ms[absorbed] = time_ms(lambda q=q_nope, r=q_rope, m=meta: attn._attend(q, r, m), reps)
            deepseek.absorbed_requests = absorbed_requests
            pick = "absorbed" if all(absorbed_requests(attn.shape, meta.extend_plan, [T], [L + T], q_nope)) else "expanded"
            print(f"{T:>5} {L:>6} {ms[False]:>12.3f} {ms[True]:>12.3f} {ms[False] / ms[True]:>6.2f} {pick:>10}",
                  flush=True)
            rows.append((attn.shape, T, L, ms[False], ms[True]))
    return rows


def fit(rows: list[tuple[MLAShape, int, int, float, float]]) -> None:
    """Each form's FormCost by least squares on the relative error over `rows`; the fit's pick against the faster
    measured form at each row."""
    def work(absorbed: bool, shape: MLAShape, T: int, L: int) -> list[float]:
        pairs = query_key_pairs([T], [T + L])
        w = shape.absorbed_work(T, T + L, pairs) if absorbed else shape.expanded_work(T + L, pairs)
        return [*map(float, w), 1.0]

    costs = {}
    for absorbed in (False, True):
        x = torch.tensor([work(absorbed, *r[:3]) for r in rows], dtype=torch.float64)
        ms = torch.tensor([r[4 if absorbed else 3] for r in rows], dtype=torch.float64)
        used = x.abs().sum(0) > 0  # a term no row has (the expanded form packs no rows) stays 0
        ns = torch.zeros(x.shape[1], dtype=torch.float64)
        ns[used] = torch.linalg.lstsq(x[:, used] / ms[:, None], torch.ones_like(ms)[:, None]).solution[:, 0] * 1e6
        costs[absorbed] = FormCost(*ns.tolist())
        print(f"{'absorbed' if absorbed else 'expanded'}: {costs[absorbed]}")
    for shape, T, L, exp_ms, abs_ms in rows:
        pick = costs[True].ns(*work(True, shape, T, L)[:4]) < costs[False].ns(*work(False, shape, T, L)[:4])
        agree = pick == (abs_ms < exp_ms)
        print(f"  {shape.heads:>3} heads, latent {shape.kv_lora:>3}, T {T:>5}, L {L:>5}: fit picks "
              f"{'absorbed' if pick else 'expanded'}{'' if agree else f' (measured {exp_ms / abs_ms:.2f}x)'}")


def bench_forward(reps: int, new_tokens: int = 100) -> None:
    """The default model's whole forward (float32, as the CPU server runs it) for one request of 100 new tokens
    over L cached, each form forced in every layer: what the attention's share of a prefill over a prefix is."""
    from moeserve.args import ServerArgs
    from moeserve.models.loader import load_model

    model, config = load_model(ServerArgs(model_path=str(default_model_path()), dtype="float32"),
                               torch.device("cpu"), show_progress=False)
    longest = max(L_VALUES)
    pool = make_kv_pool(config, longest + new_tokens + 1, 1, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    slots = (torch.randperm(longest + new_tokens, generator=gen) + 1).tolist()
    ids = torch.randint(3, config.vocab_size, (longest + new_tokens,), generator=gen).tolist()
    with torch.no_grad():  # the prefix's latents, once (the longest: shorter prefixes are its first rows)
        model(ForwardBatch.build(ForwardMode.EXTEND, ids[:longest], [longest], [longest], slots[:longest],
                                 slots[:longest], pool))
    print(f"default model forward, float32, {new_tokens} new tokens, ms of CPU time")
    print(f"{'L':>6} {'expanded ms':>12} {'absorbed ms':>12} {'ratio':>6}")
    for L in (0, 512, 1030, 2048):
        kv = slots[:L] + slots[longest:longest + new_tokens]
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids[L:L + new_tokens], [L + new_tokens], [new_tokens],
                                   kv[L:], kv, pool)
        ms = {}
        with torch.no_grad():
            for absorbed in (False, True):
                deepseek.absorbed_requests = lambda shape, plan, ext, seq, q, absorbed=absorbed: [absorbed] * len(ext)
                ms[absorbed] = time_ms(lambda b=batch: model(b), reps)
        deepseek.absorbed_requests = absorbed_requests
        print(f"{L:>6} {ms[False]:>12.1f} {ms[True]:>12.1f} {ms[False] / ms[True]:>6.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="default,v2lite,forward")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fit", action="store_true", help="fit each form's FormCost to the layer shapes' times")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes.split(","):
        if shape == "forward":
            bench_forward(args.reps)
        else:
            rows += bench(shape, getattr(torch, args.dtype), args.reps)
    if args.fit and rows:
        fit(rows)


if __name__ == "__main__":
    main()
