"""EP dispatch benchmark: dispatch and combine time and bytes per step for each backend, beside a plain
all_to_all_single of the same bytes, on CPU ranks over gloo or one GPU per rank over NCCL (--device cuda).
Modes: allgather, all2all normal, all2all low_latency (fixed slots) and symm (row puts into peer memory: shared
memory on CPU ranks, torch's symmetric memory on CUDA).

    python -m moeserve.bench.dispatch --world-size 2 --tokens 256 --hidden 2048 --topk 8 --experts 64
    python -m moeserve.bench.dispatch --world-size 2 4 --tokens 64 256 1024      # a table over sizes
    python -m moeserve.bench.dispatch --device cuda --world-size 8 --tokens 128 4096 --hidden 7168 --experts 256

Per step and rank: `tokens` tokens of `hidden` (bf16 by default) with uniform random top-k experts (distinct per
token). Identity experts: the time between dispatch and combine is not measured. Times are the mean over
`--iters` steps after `--warmup`, the slowest rank's; bytes are what a rank sends to the other ranks (the largest
over ranks): rows, expert ids and weights for dispatch, result rows for combine; exact counts, each
dispatcher's own `comm_bytes`. `rows to peers` is what the routing asks for: (token, other rank holding one of
its experts) pairs, the largest over ranks. The baseline is one all_to_all_single per phase with equal splits
that sends each rank that many bytes to its peers.
Low latency and symm run with cap = tokens (one round) unless --cap is given (a server's cap is
--ep-max-tokens-per-rank: give it to see the fixed slots' bytes at small batches). GB/s is a rank's bytes to its peers over
the phase's time. On CUDA, times are host wall time around the phase with the device synchronized at both ends,
and the low-latency step (dispatch, identity experts, combine) is also captured in a CUDA graph and replayed:
`graph_ms` is a replay's time, or the capture's error.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from moeserve.bench.ranks import spawn_ranks
from moeserve.bench.results import append_results
from moeserve.core.forward_batch import ForwardBatch

MODES = ("allgather", "normal", "low_latency", "symm")
LOW_LATENCY = ("low_latency", "symm")  # static shapes, decode: one round per step when cap >= tokens


def _build(mode: str, a: argparse.Namespace, tokens: int, rank: int, world: int, dtype: torch.dtype):
    from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
    from moeserve.ep.all2all_normal import NormalDispatcher
    from moeserve.ep.allgather import AllGatherDispatcher
    from moeserve.ep.symm import SymmLowLatencyDispatcher

    common = dict(num_experts=a.experts, hidden_size=a.hidden, dtype=dtype, device=_device(a, rank), ep_group=None,
                  ep_rank=rank, ep_size=world)
    if mode == "allgather":
        return AllGatherDispatcher(**common, align=a.align)
    if mode == "normal":
        return NormalDispatcher(**common, align=a.align)
    cls = SymmLowLatencyDispatcher if mode == "symm" else LowLatencyDispatcher
    return cls(**common, topk=a.topk, max_tokens_per_rank=a.cap or tokens)


def _device(a: argparse.Namespace, rank: int) -> torch.device:
    return torch.device("cuda", rank) if a.device == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _time_plain_a2a(nbytes_to_peers: int, world: int, iters: int, warmup: int, device: torch.device) -> float:
    """Mean seconds of one equal-split all_to_all_single that sends `nbytes_to_peers` to the other ranks."""
    chunk = max(1, -(-nbytes_to_peers // max(1, world - 1)))
    send = torch.ones(world * chunk, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    total = 0.0
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        _sync(device)
        if i >= warmup:
            total += time.perf_counter() - t0
    return total / iters


def _time_graph(disp, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, batch: ForwardBatch,
                iters: int) -> float | str:
    """Mean seconds of one replay of the captured low-latency step, or why it could not be captured."""
    def step():
        disp.dispatch_a(x, topk_ids, topk_weights, batch)
        disp.combine_a(disp.dispatch_b().rows())
        return disp.combine_b()

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # reported in the table, not raised: the eager numbers still stand
        return f"not captured: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    graph.replay()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        total += time.perf_counter() - t0
    return total / iters


def _rows(rank: int, world: int, a: argparse.Namespace) -> list[dict]:
    device = _device(a, rank)
    dtype = getattr(torch, a.dtype)
    rows = []
    for tokens in a.tokens:
        gen = torch.Generator().manual_seed(1000 * rank + tokens)
        x = torch.randn(tokens, a.hidden, generator=gen).to(dtype).to(device)
        topk_ids = torch.rand(tokens, a.experts, generator=gen).argsort(1)[:, : a.topk].to(device)
        topk_weights = torch.rand(tokens, a.topk, generator=gen).softmax(1).to(device)
        batch = ForwardBatch.idle()
        batch.global_num_tokens = [tokens] * world
        experts_per_rank = a.experts // world
        holds = torch.stack([((topk_ids // experts_per_rank) == r).any(1) for r in range(world)])  # [R, T]
        rows_to_peers = int(holds.sum() - holds[rank].sum())
        for mode in a.modes:
            batch.any_extend = mode not in LOW_LATENCY
            disp = _build(mode, a, tokens, rank, world, dtype)
            t_dispatch = t_combine = 0.0
            for i in range(a.warmup + a.iters):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                disp.dispatch_a(x, topk_ids, topk_weights, batch)
                layout = disp.dispatch_b()
                _sync(device)
                t1 = time.perf_counter()
                dist.barrier()
                _sync(device)
                t2 = time.perf_counter()
                disp.combine_a(layout.rows())  # identity experts
                disp.combine_b()
                _sync(device)
                t3 = time.perf_counter()
                if i >= a.warmup:
                    t_dispatch += t1 - t0
                    t_combine += t3 - t2
            nbytes = disp.comm_bytes
            d_bytes, c_bytes, peer_rows = (int(v) for v in _max_over_ranks(
                [nbytes["dispatch"], nbytes["combine"], rows_to_peers], device))
            base_d = _time_plain_a2a(d_bytes, world, a.iters, a.warmup, device)
            base_c = _time_plain_a2a(c_bytes, world, a.iters, a.warmup, device)
            graph = None
            if device.type == "cuda" and mode in LOW_LATENCY:
                graph = _time_graph(disp, x, topk_ids, topk_weights, batch, a.iters)
            times = _max_over_ranks([t_dispatch / a.iters, t_combine / a.iters, base_d, base_c,
                                     graph if isinstance(graph, float) else 0.0], device)
            rows.append(dict(world=world, tokens=tokens, mode=mode, device=a.device, dispatch_ms=times[0] * 1e3,
                             combine_ms=times[1] * 1e3, dispatch_mb=d_bytes / 1e6, combine_mb=c_bytes / 1e6,
                             dispatch_bytes=d_bytes, combine_bytes=c_bytes, rows_to_peers=peer_rows,
                             cap=(a.cap or tokens) if mode in LOW_LATENCY else None,
                             a2a_dispatch_ms=times[2] * 1e3, a2a_combine_ms=times[3] * 1e3,
                             graph_ms=times[4] * 1e3 if isinstance(graph, float) else graph))
    return rows



def run(a: argparse.Namespace) -> list[dict]:
    rows = []
    for world in a.world_size:
        if a.experts % world:
            raise SystemExit(f"--experts {a.experts} must be a multiple of --world-size {world}")
        rows += spawn_ranks(_rows, world, a, cuda=a.device == "cuda")
    return rows


def _gbps(mb: float, ms: float) -> float:
    return mb / ms if ms > 0 else 0.0  # MB/ms = GB/s


def markdown_table(rows: list[dict]) -> str:
    head = ("| ranks | tokens/rank | mode | cap | rows to peers | dispatch bytes | combine bytes | dispatch ms "
            "| combine ms | dispatch GB/s | combine GB/s | a2a same bytes: dispatch ms | combine ms "
            "| a2a GB/s: dispatch | combine | graph replay ms |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        graph = r.get("graph_ms")
        graph = "-" if graph is None else (f"{graph:.3f}" if isinstance(graph, float) else graph)
        lines.append(
            f"| {r['world']} | {r['tokens']} | {r['mode']} | {r['cap'] or '-'} | {r['rows_to_peers']} "
            f"| {r['dispatch_bytes']} | {r['combine_bytes']} | {r['dispatch_ms']:.3f} | {r['combine_ms']:.3f} "
            f"| {_gbps(r['dispatch_mb'], r['dispatch_ms']):.1f} "
            f"| {_gbps(r['combine_mb'], r['combine_ms']):.1f} | {r['a2a_dispatch_ms']:.3f} "
            f"| {r['a2a_combine_ms']:.3f} | {_gbps(r['dispatch_mb'], r['a2a_dispatch_ms']):.1f} "
            f"| {_gbps(r['combine_mb'], r['a2a_combine_ms']):.1f} | {graph} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, nargs="+", default=[2], help="EP ranks (processes), one or more")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: one GPU a rank, NCCL")
    p.add_argument("--tokens", type=int, nargs="+", default=[256], help="tokens per rank per step, one or more")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64, help="physical experts over all ranks")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--align", type=int, default=1, help="ContiguousLayout segment alignment (allgather, normal)")
    p.add_argument("--cap", type=int, default=0, help="low_latency and symm tokens per rank per round (0: = tokens)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--result-file", default=None, help="append one JSON line per row")
    a = p.parse_args(argv)
    if a.topk > a.experts:
        raise SystemExit(f"--topk {a.topk} exceeds --experts {a.experts}")
    if a.device == "cuda" and max(a.world_size) > torch.cuda.device_count():
        raise SystemExit(f"--world-size {max(a.world_size)} needs as many GPUs; {torch.cuda.device_count()} visible")
    rows = run(a)
    print(markdown_table(rows))
    append_results(a.result_file, rows)


if __name__ == "__main__":
    main()
