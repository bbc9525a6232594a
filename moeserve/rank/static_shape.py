"""Static-shape decode with several DP groups: every group runs one agreed, padded batch size each step.

With DP attention the MoE layers are collective: each step every rank's dispatch sizes follow the lock-step header's
`global_num_tokens`. For a CUDA graph those sizes must be fixed, so before a decode step all ranks agree on one
padded size P (rank/rank_sync.py: `StepHeader.padded_decode_size`): the largest group's batch, rounded up to the
graph buckets (cuda_graph_runner.batch_buckets). Every group, an idle one included, then runs P rows, and the
step's header is [P] * groups. The agreement needs every rank able to run the step this way (`static_ready`): all
decode or idle, none larger than the largest bucket; otherwise the step runs eagerly with the exact sizes.

Padding rows decode token 0 at position 0 with their cached tokens in the scratch slot 0 (which no request owns),
as the graph runner's padding does. They never reach sampling (logits of the real rows only) or a request's KV; with
the expert-distribution recorder on, no rank is ready (ModelRunner.static_ready), since it would count them.

On a GPU the CUDA graph runner runs these steps; on a CPU (or without graphs), `StaticShapeDecode` runs the same
padded step eagerly, behind `--enable-static-shape-decode`, so that CPU tests prove the tokens and collectives.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from moeserve.core.forward_batch import DECODE_LEN, ForwardBatch, ForwardMode


def padded_size(global_num_tokens: list[int], buckets: list[int]) -> int | None:
    """The bucket of the largest group's batch (requests of DECODE_LEN tokens), or None when it is larger than every
    bucket or nobody runs."""
    top = -(-max(global_num_tokens, default=0) // DECODE_LEN)
    if top <= 0 or top > buckets[-1]:
        return None
    return buckets[bisect.bisect_left(buckets, top)]


def static_ready(batch: ForwardBatch | None, max_bs: int, max_len: int | None = None) -> bool:
    """Whether this rank can run its part of a static-shape decode step (an idle rank always can)."""
    if batch is None or batch.mode.is_idle:
        return True
    return (batch.mode.is_decode and 0 < batch.batch_size <= max_bs and batch.decode_slots is not None
            and (max_len is None or batch.decode_slots.shape[1] <= max_len) and not batch.return_all_logits)


def pad_decode(batch: ForwardBatch, size: int, groups: int) -> ForwardBatch:
    """`batch` (a decode batch, or IDLE) with padding requests up to `size` (DECODE_LEN tokens each, all cached in
    the scratch slot 0); its header [size * DECODE_LEN] * groups. The logits rows stay the real requests' (the
    padding is never sampled)."""
    pad = size - batch.batch_size
    dev = batch.input_ids.device
    i64 = dict(dtype=torch.int64, device=dev)
    zeros, lens = torch.zeros(pad, **i64), torch.full((pad,), DECODE_LEN, **i64)
    tokens = torch.zeros(pad * DECODE_LEN, **i64)  # token 0 at position 0, each padding token
    width = batch.decode_slots.shape[1] if batch.decode_slots is not None else 1
    slots = batch.decode_slots if batch.decode_slots is not None else torch.zeros(0, width, **i64)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.cat([batch.input_ids, tokens]),
        positions=torch.cat([batch.positions, tokens]), seq_lens=torch.cat([batch.seq_lens, lens]),
        extend_lens=torch.cat([batch.extend_lens, lens]), prefix_lens=torch.cat([batch.prefix_lens, zeros]),
        out_cache_loc=torch.cat([batch.out_cache_loc, tokens]), kv_indices=torch.cat([batch.kv_indices, tokens]),
        kv_indptr=torch.cat([batch.kv_indptr, batch.kv_indptr[-1:] + DECODE_LEN * torch.arange(1, pad + 1, **i64)]),
        qo_indptr=torch.cat([batch.qo_indptr, batch.qo_indptr[-1:] + DECODE_LEN * torch.arange(1, pad + 1, **i64)]),
        kv_pool=batch.kv_pool, seq_lens_cpu=[*batch.seq_lens_cpu, *[DECODE_LEN] * pad],
        extend_lens_cpu=[*batch.extend_lens_cpu, *[DECODE_LEN] * pad],
        prefix_lens_cpu=[*batch.prefix_lens_cpu, *[0] * pad],
        global_num_tokens=[size * DECODE_LEN] * groups, any_extend=False, logits_indices=batch.logits_indices,
        decode_slots=torch.cat([slots, torch.zeros(pad, width, **i64)]),
    )


class StaticShapeDecode:
    """The static-shape decode step without CUDA graphs (a CPU, or --disable-cuda-graph): the padded batch, eagerly.
    A graph runner for ModelRunner (can_run / run / capture_all)."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], bs_buckets: list[int], groups: int):
        self.forward = forward
        self.groups = groups
        self.bs_buckets = bs_buckets  # the decode graphs' (cuda_graph_runner.batch_buckets)
        self.num_steps = 0  # padded steps run
        self.max_bs = self.bs_buckets[-1]

    def capture_all(self, progress: bool = True) -> None:
        del progress  # nothing to capture

    def ready(self, batch: ForwardBatch | None) -> bool:
        return static_ready(batch, self.max_bs)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.static_bs is not None and self.ready(batch)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_steps += 1
        return self.forward(pad_decode(batch, batch.static_bs, self.groups))


__all__ = ["StaticShapeDecode", "pad_decode", "padded_size", "static_ready"]
