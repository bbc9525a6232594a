"""Two-batch overlap benchmark: model step time with TBO on vs off, same model, same batches, same run.

    python -m moeserve.bench.tbo                                  # 2 gloo ranks, DP attention, EP 2, decode+prefill
    python -m moeserve.bench.tbo --backend all2all --deepep-mode normal --hidden 1024 --decode-bs 8 32 128

Two CPU ranks (gloo, one compute thread each) run DP attention with EP over both ranks: each rank has its own
batch of the same size. The model is the embedded default model's architecture (DeepSeek-V3 form: MLA, grouped
sigmoid gate, shared expert, a dense first layer) with --hidden/--layers/--experts overrides so that the dispatch
traffic is visible next to compute; weights are random (timing only). Decode steps: `bs` requests of --ctx cached
tokens, one new token each. Prefill steps: `--prefill-reqs` prompts of tokens/--prefill-reqs new tokens each.
The same model object runs both paths (the TBO switch is flipped between timings); a step's time is the slower
rank's, averaged over --iters after --warmup, each step starting after a barrier.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from moeserve.bench.ranks import spawn_ranks
from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode
from moeserve.kvcache.kv_pool import make_kv_pool


def _model(a: argparse.Namespace, rank: int, world: int):
    from moeserve.args import ServerArgs
    from moeserve.core.model_config import ModelConfig
    from moeserve.models.default_model import default_config
    from moeserve.models.loader import build_model, finish_loading
    from moeserve.models.options import model_options
    from moeserve.parallel.state import init_parallel_state

    init_parallel_state(world, rank, dp_size=world, ep_size=world)
    raw = default_config()
    raw.update(hidden_size=a.hidden, intermediate_size=2 * a.hidden, moe_intermediate_size=a.hidden // 4,
               num_hidden_layers=a.layers, n_routed_experts=a.experts, n_group=4, topk_group=2,
               num_experts_per_tok=a.topk)
    config = ModelConfig.from_dict(raw)
    args = ServerArgs.from_kwargs(model_path="dummy", tp_size=world, dp_size=world, enable_dp_attention=True,
                                  moe_a2a_backend=a.backend, deepep_mode=a.deepep_mode,
                                  ep_max_tokens_per_rank=max([*a.decode_bs, *a.prefill_tokens]),
                                  enable_two_batch_overlap=True, tbo_token_threshold=1)
    dtype = getattr(torch, a.dtype)
    model = build_model(config, model_options(args, config), torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(1234)  # the same weights on both ranks (their shared parts agree)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * (0.02 if "bias" not in name else 0.001))
    finish_loading(model, torch.device("cpu"))
    max_tokens = max(b * (a.ctx + DECODE_LEN) for b in a.decode_bs)
    max_tokens = max(max_tokens, *a.prefill_tokens) + 16
    pool = make_kv_pool(config, max_tokens, 1, dtype, "cpu")
    return model, pool


def _decode_batch(bs: int, ctx: int, world: int, rank: int) -> ForwardBatch:
    n = ctx + DECODE_LEN  # each request's KV after the step
    slots = list(range(1, bs * n + 1))
    out = [s for b in range(bs) for s in slots[(b + 1) * n - DECODE_LEN:(b + 1) * n]]
    g = torch.Generator().manual_seed(rank * 7 + bs)
    ids = torch.randint(5, 1000, (bs * DECODE_LEN,), generator=g).tolist()
    fb = ForwardBatch.build(ForwardMode.DECODE, ids, [n] * bs, [DECODE_LEN] * bs, out, slots)
    fb.global_num_tokens, fb.any_extend = [bs * DECODE_LEN] * world, False
    return fb


def _prefill_batch(tokens: int, reqs: int, world: int, rank: int) -> ForwardBatch:
    ext = [tokens // reqs + (1 if i < tokens % reqs else 0) for i in range(reqs)]
    slots = list(range(1, tokens + 1))
    g = torch.Generator().manual_seed(rank * 7 + tokens)
    ids = torch.randint(5, 1000, (tokens,), generator=g).tolist()
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, ext, ext, slots, slots)
    fb.global_num_tokens, fb.any_extend = [tokens] * world, True
    return fb


def _time(model, fb: ForwardBatch, tbo: bool, iters: int, warmup: int) -> float:
    model.tbo_enabled = tbo
    total = 0.0
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        model(fb)
        if i >= warmup:
            total += time.perf_counter() - t0
    t = torch.tensor([total / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rows(rank: int, world: int, a: argparse.Namespace) -> list[dict]:
    model, pool = _model(a, rank, world)
    rows = []
    with torch.inference_mode():
        cases = [("decode", bs, _decode_batch(bs, a.ctx, world, rank)) for bs in a.decode_bs]
        cases += [("prefill", t, _prefill_batch(t, a.prefill_reqs, world, rank)) for t in a.prefill_tokens]
        for kind, size, fb in cases:
            fb.kv_pool = pool
            off = _time(model, fb, False, a.iters, a.warmup)
            on = _time(model, fb, True, a.iters, a.warmup)
            rows.append(dict(kind=kind, tokens=size, off_ms=off * 1e3, on_ms=on * 1e3,
                             off_tps=size * world / off, on_tps=size * world / on))
    return rows



def run(a: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_rows, a.world_size, a)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| step | tokens/rank | TBO off ms | TBO on ms | off tok/s | on tok/s | on/off speed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['tokens']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['off_tps']:.0f} "
                     f"| {r['on_tps']:.0f} | {r['off_ms'] / r['on_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="allgather", choices=["allgather", "all2all"])
    p.add_argument("--deepep-mode", default="auto", choices=["normal", "low_latency", "auto"])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--ctx", type=int, default=128, help="cached tokens per decode request")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[4, 16, 64, 128])
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--prefill-reqs", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    rows = run(a)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
