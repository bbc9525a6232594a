"""Spawn one process a rank on this host (gloo on CPU, NCCL with one GPU a rank), run a benchmark's body in each
and hand back rank 0's rows."""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.server.launch import free_port

Body = Callable[[int, int, argparse.Namespace], list[dict]]  # (rank, world, args) -> rows


def _rank_main(body: Body, rank: int, world: int, port: int, a: argparse.Namespace, cuda: bool, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    device = {}
    if cuda:
        torch.cuda.set_device(rank)
        device = {"device_id": torch.device("cuda", rank)}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600), **device)
    rows = body(rank, world, a)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def spawn_ranks(body: Body, world: int, a: argparse.Namespace, cuda: bool = False) -> list[dict]:
    """`body` (a module-level function: it is pickled) on `world` ranks; rank 0's rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, world, port, a, cuda, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=3600)
    for p in procs:
        p.join()
    return rows
