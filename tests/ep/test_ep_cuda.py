"""GPU checks (skipped on CPU): every backend over NCCL, and the low-latency steps (all2all's and symm's, over torch's
symmetric memory) inside a CUDA graph. NOTE: symm's CUDA path has not run on a GPU yet.

One process a GPU, up to 4 ranks (one rank on a one-GPU machine still runs NCCL's all_to_all_single). The
low-latency step runs eagerly under `torch.cuda.set_sync_debug_mode("error")` (any host sync raises), is captured
in a CUDA graph, and replays on new routings written into the captured input tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ep_harness import Scenario, dense_reference, make_experts, make_inputs, run_ranks, with_header

from moeserve.core.forward_batch import ForwardBatch
from moeserve.core.layouts import ContiguousLayout
from moeserve.ep.all2all_low_latency import LowLatencyDispatcher
from moeserve.ep.all2all_normal import NormalDispatcher
from moeserve.ep.allgather import AllGatherDispatcher
from moeserve.ep.symm import SymmLowLatencyDispatcher

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CAP = 16


def _experts_fn(sc: Scenario, rank: int, world: int, device: torch.device):
    """Batched tanh(x W + b) over this rank's experts, for either layout (static shapes for the masked one)."""
    w_all, b_all = make_experts(sc)
    e_local = sc.num_experts // world
    w = w_all[rank * e_local : (rank + 1) * e_local].to(device)
    b = b_all[rank * e_local : (rank + 1) * e_local].to(device)

    def run(layout):
        if isinstance(layout, ContiguousLayout):
            out = torch.zeros_like(layout.x)
            offs = layout.expert_offsets.tolist()
            for e in range(e_local):
                seg = layout.x[offs[e] : offs[e + 1]]
                out[offs[e] : offs[e + 1]] = torch.tanh(seg.float() @ w[e] + b[e]).to(seg.dtype)
            return out
        return torch.tanh(torch.baddbmm(b[:, None, :], layout.x.float(), w)).to(layout.x.dtype)

    return run


def _step(disp, experts, x, ids, weights, batch):
    disp.dispatch_a(x, ids, weights, batch)
    disp.combine_a(experts(disp.dispatch_b()))
    return disp.combine_b()


def _gpu_suite(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    report = {}
    sc = Scenario("gpu", tuple(CAP - 3 + r for r in range(world)), 4 * world, 4, "with_replacement", seed=31,
                  hidden=64)
    big = dataclasses.replace(sc, tokens=tuple(3 * CAP + 5 - r for r in range(world)), seed=32)  # 4 rounds
    common = dict(num_experts=sc.num_experts, hidden_size=sc.hidden, dtype=torch.float32, device=device,
                  ep_group=None, ep_rank=rank, ep_size=world)
    for name, disp in [("allgather", AllGatherDispatcher(**common, align=4)),
                       ("normal", NormalDispatcher(**common, align=128)),
                       ("low_latency", LowLatencyDispatcher(**common, topk=sc.topk, max_tokens_per_rank=CAP)),
                       ("symm", SymmLowLatencyDispatcher(**common, topk=sc.topk, max_tokens_per_rank=CAP))]:
        for case in (sc, big):
            x, ids, w = make_inputs(case)[rank]
            run = _experts_fn(case, rank, world, device)
            out = _step(disp, run, x.to(device), ids.to(device), w.to(device),
                        with_header(ForwardBatch.idle(), case.tokens, name not in ("low_latency", "symm")))
            err = (out.cpu() - dense_reference(case, x, ids, w)).abs().max().item() if x.numel() else 0.0
            report[f"{name}/{case.seed}"] = err

    # Low latency (both transports): no host sync eagerly, then the same step captured and replayed on new routings.
    for name, cls in (("low_latency", LowLatencyDispatcher), ("symm", SymmLowLatencyDispatcher)):
        _captured(report, name, cls(**common, topk=sc.topk, max_tokens_per_rank=CAP), sc, rank, world, device)
    torch.cuda.synchronize()
    return report


def _captured(report: dict, name: str, disp, sc: Scenario, rank: int, world: int, device: torch.device) -> None:
    experts = _experts_fn(sc, rank, world, device)
    batch = with_header(ForwardBatch.idle(), sc.tokens, False)
    x, ids, w = (t.to(device) for t in make_inputs(sc)[rank])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(disp, experts, x, ids, w, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(disp, experts, x, ids, w, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(disp, experts, x, ids, w, batch)
    for seed in (41, 42, 43):
        case = dataclasses.replace(sc, seed=seed, routing="uniform" if seed % 2 else "with_replacement")
        nx, nids, nw = make_inputs(case)[rank]
        x.copy_(nx)
        ids.copy_(nids)
        w.copy_(nw)
        graph.replay()
        want = dense_reference(sc, nx, nids, nw)  # sc's experts were captured; the inputs are new
        report[f"graph/{name}/{seed}"] = (static_out.cpu() - want).abs().max().item()


def test_dispatchers_on_gpu() -> None:
    world = min(torch.cuda.device_count(), 4)
    reports = run_ranks(world, _gpu_suite, backend="nccl", timeout=300)
    for rank, report in enumerate(reports):
        for key, err in report.items():
            assert err < 1e-4, f"rank {rank} {key}: max error {err}"
