"""Attention tensor parallelism on 2 CPU ranks (gloo) equals one rank: MLA heads split, and GQA with a single
KV head (each rank keeps a copy of the KV head its query heads read)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.checkpoints import build_checkpoint
from tests.models.harness import Runner, random_tokens

pytestmark = pytest.mark.slow
WORLD = 2


def _steps(runner: Runner) -> list[torch.Tensor]:
    prompts = [("a", random_tokens(9, 1)), ("b", random_tokens(4, 2))]
    return [runner.extend(prompts), runner.decode([("a", 5), ("b", 7)]), runner.decode([("a", 9), ("b", 3)])]


def _rank(rank: int, port: int, paths: list[str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from moeserve.parallel.state import init_parallel_state

    init_parallel_state(WORLD, rank, dp_size=1, ep_size=1)
    out = [[t.tolist() for t in _steps(Runner(p))] for p in paths]
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def test_attention_tp_equals_one_rank(tiny_checkpoint, tmp_path):
    paths = [tiny_checkpoint("v3_q_lora"), build_checkpoint("qwen3_moe", tmp_path / "mqa", num_key_value_heads=1)]
    refs = [_steps(Runner(p)) for p in paths]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, paths, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    outs = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for path, out, ref in zip(paths, outs, refs, strict=True):
        for got, want in zip(out, ref, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4, msg=path)
