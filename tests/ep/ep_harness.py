"""Multi-process harness for the EP dispatcher tests: one gloo process group, many scenarios inside it.

`run_ranks(world_size, fn, *args)` spawns `world_size` CPU processes, gives each a gloo group and calls
`fn(rank, world_size, *args)`; it returns each rank's (picklable) result. A rank that raises sends its traceback
back, and the parent raises it. Scenarios are built from seeds, so every rank (and the parent) builds the same
inputs for all ranks: each rank can compute the single-process dense reference itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_module
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ---------------------------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, queue, fn, args, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report anything back to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Results of fn(rank, world_size, *args) on each rank of a fresh group (gloo on CPU; nccl: one GPU a rank), in
    rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, queue, fn, args, backend), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f} s; results from ranks {sorted(results)}")
                continue
            if ok:
                results[rank] = payload
            else:  # the others are likely stuck in a collective: stop them all
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------
# Scenarios: routings, experts, the dense reference


@dataclass(frozen=True)
class Scenario:
    """One step's inputs on every rank, built from `seed`."""

    name: str
    tokens: tuple[int, ...]  # per rank
    num_experts: int
    topk: int
    routing: str  # uniform | one_expert_all_slots | one_expert_first_slot | same_rank | with_replacement | masked
    seed: int
    hidden: int = 16
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def routing_ids(sc: Scenario, t: int, gen: torch.Generator) -> torch.Tensor:
    """[t, k] int64 physical expert ids for one rank."""
    e, k, r = sc.num_experts, sc.topk, len(sc.tokens)
    if sc.routing in ("uniform", "masked"):
        ids = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
        if sc.routing == "masked":
            ids[torch.rand(t, k, generator=gen) < 0.35] = -1
            ids[:1] = -1  # a token with no expert at all
        return ids
    if sc.routing == "one_expert_all_slots":  # all tokens, all slots: one expert (the same id k times)
        return torch.full((t, k), e - 1, dtype=torch.int64)
    if sc.routing == "one_expert_first_slot":
        ids = torch.full((t, k), -1, dtype=torch.int64)
        ids[:, 0] = 0
        return ids
    if sc.routing == "same_rank":  # all of a token's experts on one rank, repeats allowed
        e_local = e // r
        owner = torch.randint(0, r, (t, 1), generator=gen)
        return owner * e_local + torch.randint(0, e_local, (t, k), generator=gen)
    if sc.routing == "with_replacement":  # repeats of an expert, of a rank, and spread over ranks
        return torch.randint(0, e, (t, k), generator=gen)
    raise ValueError(sc.routing)


def make_inputs(sc: Scenario) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank's (x [T, H], topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
    gen = torch.Generator().manual_seed(sc.seed)
    out = []
    for t in sc.tokens:
        x = torch.randn(t, sc.hidden, generator=gen).to(sc.torch_dtype)
        ids = routing_ids(sc, t, gen)
        weights = torch.rand(t, sc.topk, generator=gen) + 0.1
        out.append((x, ids, weights))
    return out


def make_experts(sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """Per physical expert e: W [E, H, H] and b [E, H] fp32; expert_e(x) = tanh(x @ W[e] + b[e])."""
    gen = torch.Generator().manual_seed(1000 + sc.seed)
    w = torch.randn(sc.num_experts, sc.hidden, sc.hidden, generator=gen) / sc.hidden**0.5
    b = torch.randn(sc.num_experts, sc.hidden, generator=gen) * 0.1
    return w, b


def apply_expert(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x.float() @ w + b).to(x.dtype)


def dense_reference(sc: Scenario, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, H] fp32: sum over valid slots of w * expert(x), one process, all experts."""
    w_all, b_all = make_experts(sc)
    out = torch.zeros(x.shape[0], sc.hidden)
    for t in range(x.shape[0]):
        for j in range(sc.topk):
            e = int(ids[t, j])
            if e >= 0:
                out[t] += weights[t, j] * apply_expert(x[t : t + 1], w_all[e], b_all[e])[0].float()
    return out


def with_header(batch, tokens, any_extend: bool):
    return dataclasses.replace(batch, global_num_tokens=list(tokens), any_extend=any_extend)
