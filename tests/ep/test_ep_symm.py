"""The symm dispatcher's byte counters and its fallback, on 2 and 4 CPU ranks (shared memory).

Bytes: a rank's dispatch bytes are exactly (its tokens' rows routed to other ranks: one per (token, other rank
holding one of its experts)) x the dispatch row bytes, plus a 4-byte count per other rank and round; its combine
bytes are (rows it received from other ranks) x the combine row bytes. Counted from the routing here, in the test,
independently of the dispatcher. The all2all low-latency dispatcher's bytes are the fixed slots whatever the routing.
Fallback: ranks that report different hosts get the all2all dispatcher from make_dispatcher, with the reason logged.
"""

from __future__ import annotations

import pytest
import torch
from ep_harness import run_ranks

from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.symm import SymmLowLatencyDispatcher

pytestmark = pytest.mark.slow

H, K, CAP = 24, 3, 8
STEPS = [(0, 5), (1, 1), (8, 3), (13, 0), (2, 19)]  # (rank 0's tokens, the others'): idle ranks, rounds


def _routing(rank: int, world: int, tokens: int, step: int):
    """Skewed: half the tokens' experts all on rank 0 (some repeated), the rest uniform over every expert."""
    e = 2 * world
    gen = torch.Generator().manual_seed(50 * step + rank)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.rand(tokens, e, generator=gen).argsort(1)[:, :K]
    skew = torch.rand(tokens, generator=gen) < 0.5
    ids[skew] = torch.randint(0, 2, (int(skew.sum()), K), generator=gen)  # rank 0's two experts
    return x, ids, torch.rand(tokens, K, generator=gen) + 0.1


def _rows_to(ids: torch.Tensor, world: int) -> torch.Tensor:
    """[world] how many tokens have an expert on each rank (2 experts a rank)."""
    return torch.stack([((ids // 2) == r).any(1).sum() for r in range(world)])


def _run(rank: int, world: int):
    common = dict(num_experts=2 * world, hidden_size=H, dtype=torch.float32, device="cpu", ep_group=None,
                  ep_rank=rank, ep_size=world, topk=K, max_tokens_per_rank=CAP)
    symm, slots = SymmLowLatencyDispatcher(**common), LowLatencyDispatcher(**common)
    out = []
    for step, (t0, t_other) in enumerate(STEPS):
        tokens = [t0] + [t_other] * (world - 1)
        x, ids, w = _routing(rank, world, tokens[rank], step)
        peer_rows_out = int(_rows_to(ids, world).sum() - _rows_to(ids, world)[rank])
        peer_rows_in = sum(int(_rows_to(_routing(s, world, tokens[s], step)[1], world)[rank])
                           for s in range(world) if s != rank)
        rounds = max(1, -(-max(tokens) // CAP))
        got = {}
        for name, disp in (("symm", symm), ("slots", slots)):
            disp.dispatch_a(x, ids, w, None)
            layout = disp.dispatch_b()
            disp.combine_a(layout.x)
            y = disp.combine_b()
            got[name] = (dict(disp.comm_bytes), y)
        want = (x * w.sum(1, keepdim=True)).float()
        out.append(dict(
            symm=got["symm"][0], slots=got["slots"][0], rounds=rounds, rows_out=peer_rows_out, rows_in=peer_rows_in,
            row_bytes=(symm.dispatch_row_bytes, symm.combine_row_bytes),
            symm_err=float((got["symm"][1] - want).abs().max()) if len(x) else 0.0,
            slots_err=float((got["slots"][1] - want).abs().max()) if len(x) else 0.0))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_symm_bytes_are_routed_rows_times_row_bytes(world):
    for rank, steps in enumerate(run_ranks(world, _run)):
        for s in steps:
            d_row, c_row = s["row_bytes"]
            assert d_row == 4 * (-(-H * 4 // 4) + 2 * K) and c_row == H * 4
            assert s["symm"] == {"dispatch": s["rows_out"] * d_row + 4 * (world - 1) * s["rounds"],
                                 "combine": s["rows_in"] * c_row}, (rank, s)
            slots = s["rounds"] * (world - 1) * CAP
            assert s["slots"] == {"dispatch": slots * (H * 4 + 2 * K * 4), "combine": slots * H * 4}
            assert s["symm_err"] < 1e-5 and s["slots_err"] < 1e-5  # identity experts: x * sum of weights
        assert sum(s["rows_out"] for s in steps) > 0


def _fallback(rank: int, world: int):
    import logging
    import socket

    from moeserve.ep.registry import DispatchOptions, make_dispatcher

    socket.gethostname = lambda: f"host-{rank}"  # as if each rank ran on its own node
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("moeserve.ep.registry").addHandler(handler)
    disp = make_dispatcher(DispatchOptions(backend="symm", deepep_mode="low_latency"), 2 * world, 2,
                           dtype=torch.float32, device="cpu", hidden_size=H, top_k=K, ep_group=None, ep_rank=rank,
                           ep_size=world)
    return type(disp).__name__, type(disp.low_latency).__name__, records


def test_symm_falls_back_to_all2all_across_hosts():
    for cls, ll, records in run_ranks(2, _fallback):
        assert (cls, ll) == ("All2AllDispatcher", "LowLatencyDispatcher")
        assert any("falls back to all2all" in r and "2 hosts" in r for r in records), records


def _barrier_and_modes(rank: int, world: int):
    from moeserve.ep import peer_memory
    from moeserve.ep.registry import DispatchOptions, make_dispatcher

    buffers = peer_memory.open_peer_buffers(100, "cpu", None, rank, world)
    mine = buffers.view(rank, 0, (25,), torch.int32)
    mine.fill_(rank + 7)
    buffers.arrive()
    buffers.wait()
    seen = int(buffers.view(1 - rank, 0, (25,), torch.int32).sum())  # the other rank's fill, read here
    timed_out = None
    if rank == 0:  # rank 1 never arrives a second time: rank 0 gives up at the deadline
        peer_memory.BARRIER_DEADLINE_S = 0.5
        buffers.arrive()
        try:
            buffers.wait()
        except TimeoutError as e:
            timed_out = str(e)
    modes = {}
    for mode in ("auto", "normal", "low_latency"):
        d = make_dispatcher(DispatchOptions("symm", deepep_mode=mode), 2 * world, 2, hidden_size=H, top_k=K,
                            ep_group=None, ep_rank=rank, ep_size=world, dtype=torch.float32, device="cpu")
        modes[mode] = (type(d).__name__, type(d.low_latency).__name__ if d.low_latency else None, d.graph_safe,
                       d.extend_graph_safe)
    return seen, timed_out, modes


def test_peer_memory_barrier_has_a_deadline_and_symm_modes_are_all2alls():
    for rank, (seen, timed_out, modes) in enumerate(run_ranks(2, _barrier_and_modes)):
        assert seen == 25 * (8 - rank)
        assert (timed_out is not None and "EP rank 1" in timed_out) == (rank == 0), timed_out
        ll = "SymmLowLatencyDispatcher"
        assert modes == {"auto": ("SymmAll2AllDispatcher", ll, True, False),
                         "normal": ("SymmAll2AllDispatcher", None, False, False),
                         "low_latency": ("SymmAll2AllDispatcher", ll, True, True)}
