"""Lock-step between ranks: request fan-out inside an attention group and the per-step header.

Every rank of an attention TP group runs the same scheduler on the same messages: the group's leader (attention
TP rank 0) reads the ZeroMQ socket and broadcasts what it got. Before each forward, all ranks exchange a small
header (tokens this step, is it a prefill, the rebalancer's state, can it run a static-shape decode or extend)
because MoE layers are collective: a rank with nothing to do runs an IDLE batch (or, in a static-shape step, the
agreed padded batch: rank/static_shape.py, rank/static_extend.py), and when no rank has work nobody runs. After sampling, the leader's token ids are broadcast so the
group's schedulers never diverge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.parallel.state import ParallelState

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch has only the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class StepHeader:
    """What every rank knows of every other before a step."""

    global_num_tokens: list[int]  # tokens of each DP group this step
    any_extend: bool  # some group prefills (all2all `auto` picks normal dispatch)
    any_stop: bool  # some rank is shutting down: every rank leaves its loop at this step
    eplb: list[int]  # each rank's online-rebalancer status (moeserve/eplb/rebalancer.py)
    all_static: bool = False  # every rank can run a static-shape decode step (rank/static_shape.py)
    any_verify: bool = False  # some group runs a speculative verify step: every rank runs the k draft forwards
    all_static_extend: bool = False  # every rank can run a static-shape extend step (rank/static_extend.py)

    def padded_decode_size(self, buckets: list[int]) -> int | None:
        """The batch size every DP group runs this decode step (padded), or None: the step runs eagerly."""
        from moeserve.rank.static_shape import padded_size

        if not self.all_static or self.any_extend:
            return None
        return padded_size(self.global_num_tokens, buckets)

    def padded_extend_size(self, buckets: list[int]) -> int | None:
        """The token count every DP group runs this extend step (padded), or None: the step runs eagerly."""
        from moeserve.rank.static_extend import padded_extend_size

        if not self.all_static_extend or not self.any_extend:
            return None
        return padded_extend_size(self.global_num_tokens, buckets)


class RankSync:
    """Collectives of the worker loop for one rank (a no-op object for a single-rank server)."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.multi = state.world_size > 1
        self.group_size = state.attn_tp_size
        self.leader = state.dp_rank * state.attn_tp_size  # global rank of this group's leader

    @property
    def is_leader(self) -> bool:
        return self.state.attn_tp_rank == 0

    def share_messages(self, msgs: Any) -> Any:
        """The leader's messages (any picklable object), on every rank of its attention group."""
        if self.group_size == 1:
            return msgs
        box = [msgs if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.state.attn_tp_cpu_group)
        return box[0]

    def gather_group(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in attention-TP rank order, on every rank of the group."""
        if self.group_size == 1:
            return [obj]
        parts: list[Any] = [None] * self.group_size
        dist.all_gather_object(parts, obj, group=self.state.attn_tp_cpu_group)
        return parts

    def exchange_header(self, num_tokens: int, is_extend: bool, stop: bool = False,
                        eplb: int = 0, static_ok: bool = False, verify: bool = False,
                        static_extend_ok: bool = False) -> StepHeader:
        """Every rank's part of this step's header, the same on all ranks (see StepHeader). static_ok: this rank
        can run its part of a static-shape decode step; verify: it runs a speculative verify step;
        static_extend_ok: it can run its part of a static-shape extend step."""
        if not self.multi:
            return StepHeader([num_tokens], is_extend, stop, [eplb], static_ok, verify, static_extend_ok)
        t = torch.tensor([num_tokens, int(is_extend), int(stop), eplb, int(static_ok), int(verify),
                          int(static_extend_ok)], dtype=torch.int64)
        n = t.numel()
        out = torch.zeros(self.state.world_size * n, dtype=torch.int64)  # flat: gloo wants [R * n] for [n]
        _all_gather(out, t, group=self.state.world_cpu_group)
        out = out.view(self.state.world_size, n)
        return StepHeader(out[:: self.group_size, 0].tolist(), bool(out[:, 1].any()), bool(out[:, 2].any()),
                          out[:, 3].tolist(), bool(out[:, 4].all()), bool(out[:, 5].any()), bool(out[:, 6].all()))

    def share_sample(self, sample: Any) -> Any:
        """The leader's sampling result on every rank of the group."""
        if self.group_size == 1:
            return sample
        box = [(sample.next_token_ids, sample.logprobs, sample.top_logprobs) if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.state.attn_tp_cpu_group)
        sample.next_token_ids, sample.logprobs, sample.top_logprobs = box[0]
        return sample
