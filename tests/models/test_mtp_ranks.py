"""The MTP layer on 2 CPU ranks (gloo) equals one rank: attention TP with a TP MoE, attention TP with EP
(allgather and all2all dispatch), and DP attention with EP where one rank drafts and the other runs IDLE steps that
join its MoE collectives."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from tests.models.harness import MTPRunner, Runner, random_tokens

pytestmark = pytest.mark.slow
WORLD = 2
# case -> (dp_size, ep_size, ServerArgs of the case)
CASES = {
    "tp_moe": (1, 1, dict(tp_size=2, ep_size=1)),
    "ep_allgather": (1, 2, dict(tp_size=2, ep_size=2)),
    "ep_all2all": (1, 2, dict(tp_size=2, ep_size=2, moe_a2a_backend="all2all")),
    "dp_ep_idle": (2, 2, dict(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True)),
}


def _steps(draft: MTPRunner) -> list[torch.Tensor]:
    """A prompt's rows for two requests, then two chained decode rows each."""
    rows = {"a": (random_tokens(7, 1), torch.randn(7, 64, generator=torch.Generator().manual_seed(2))),
            "b": (random_tokens(4, 3), torch.randn(4, 64, generator=torch.Generator().manual_seed(4)))}
    out = [draft.step(ForwardMode.EXTEND, [(r, *rows[r]) for r in rows])[0]]
    _, h = draft.step(ForwardMode.EXTEND, [(r, t[-1:], h[-1:]) for r, (t, h) in rows.items()], False)
    for tok in ([5, 9], [11, 13]):
        logits, h = draft.step(ForwardMode.DECODE, [("a", [tok[0]], h[:1]), ("b", [tok[1]], h[1:])])
        out.append(logits)
    return out


def _idle_steps(draft: MTPRunner, n: int) -> None:
    for _ in range(n):
        batch = ForwardBatch.idle(draft.pool)
        with torch.no_grad():
            draft.mtp(batch, batch.input_ids, torch.zeros(0, 64))


def _rank(rank: int, port: int, path: str, case: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from moeserve.parallel.state import init_parallel_state

    dp_size, ep_size, args = CASES[case]
    init_parallel_state(WORLD, rank, dp_size=dp_size, ep_size=ep_size)
    draft = MTPRunner(Runner(path, **args))
    if dp_size > 1 and rank == 1:  # its DP group has nothing to draft: IDLE steps, one per step of rank 0
        _idle_steps(draft, 4)
    else:
        out = [t.tolist() for t in _steps(draft)]
        if rank == 0:
            queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one(mtp_checkpoint, case):
    want = _steps(MTPRunner(Runner(mtp_checkpoint)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, mtp_checkpoint, case, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(torch.tensor(g), w, atol=1e-4, rtol=1e-4, msg=f"{case} step {step}")
