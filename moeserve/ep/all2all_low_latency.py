"""The all2all dispatcher, low-latency mode (decode): static shapes, no host sync, CUDA-graph capturable.

Each rank owns fixed buffers sized by `cap = ep_max_tokens_per_rank`:
- dispatch: this rank's (up to) `cap` tokens go to every rank in a fixed slot [cap, H] (slot row t = token t; a
  token reaches a rank once however many of its experts live there), with their k local expert ids and weights
  [cap, 2k] (-1 ids where the expert lives elsewhere or the token is padding). Equal-split all_to_all_single.
- the receiver deduplicates each row's experts (a repeated expert's weights are summed) and scatters the rows into
  MaskedLayout x [E_local, C, H], masked_m [E_local] valid rows per expert, C = rounds * R * cap (one row per
  source row at most per round, so no expert can overflow).
- combine: the owning rank applies the top-k weights and sums each received row's experts in fp32, casts to x's
  dtype and sends the [cap, H] slot back by the reverse equal-split all_to_all_single; the source sums over ranks
  in fp32 and casts to x's dtype.

Rounds: a step whose largest per-rank token count (the lock-step header `batch.global_num_tokens`, known on every
rank) exceeds `cap` runs ceil(max / cap) rounds through the same buffers, token chunks [i*cap, (i+1)*cap); every
rank runs the same number of rounds, so nothing is dropped or truncated. The layout then holds all rounds (C grows
with them); a captured graph has a static T <= cap and one round.

FP8 dispatch (`fp8_quantize`, given when the experts are FP8, as DeepEP's low-latency mode does): dispatch_a
quantizes x with it (per token in groups of 128: kernels/fp8_quant.py, handed in by the MoE layer) and each slot row
carries [scales fp32 | x e4m3] in bytes, a little over half of bf16's; the layout hands the experts x in e4m3 with x_scale. Per-token quantization commutes
with moving tokens, so the experts see exactly what they would have quantized themselves. Combine stays in x's
dtype. The byte rows live in the same buffers as combine's rows (dispatch_b has consumed them before combine).

What is captured: every shape depends on T (static per graph), cap, R, E_local and k only; no `.item()`,
`.tolist()`, `nonzero` or boolean indexing runs on the device path.

The transport is a set of hooks (`_allocate`, `_send_dispatch`, `_receive_dispatch`, `_send_combine`,
`_receive_combine`, `_count_bytes`): ep/symm.py replaces them with row puts into peer memory, and the rounds, the
plan and the layout stay here, one copy for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeserve.core.layouts import MaskedLayout
from moeserve.ep.base import Dispatcher
from moeserve.ep.routing import (
    MaskedPlan,
    combine_masked,
    local_topk,
    max_tokens_over_ranks,
    pack_meta,
    plan_masked,
    scatter_masked,
    unpack_meta,
)

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


FP8Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LowLatencyDispatcher(Dispatcher):
    """Dispatcher by fixed-slot equal-split all_to_all_single (see the module doc). The buffers are per instance,
    so two-batch overlap needs one per micro-batch."""

    name = "all2all"
    graph_safe = extend_graph_safe = True

    def __init__(self, *, topk: int, max_tokens_per_rank: int, fp8_quantize: FP8Quantize | None = None,
                 **common) -> None:
        """topk: experts per token; max_tokens_per_rank: the slot size `cap` (--ep-max-tokens-per-rank);
        fp8_quantize: x [T, H] -> (e4m3 [T, H], float32 scales [T, G]); given, tokens travel in FP8 with their
        scales (FP8 experts). `common`: the Dispatcher arguments (num_experts, hidden_size, dtype, device, ep_group,
        ep_rank, ep_size)."""
        if max_tokens_per_rank < 1:
            raise ValueError(f"--ep-max-tokens-per-rank must be >= 1, got {max_tokens_per_rank}")
        assert topk >= 1
        super().__init__(**common)
        self.topk, self.cap = topk, max_tokens_per_rank
        self.fp8, self._quantize = fp8_quantize is not None, fp8_quantize
        self._scale_bytes = 0
        if self.fp8:  # a row: [scales float32 (4 bytes x groups) | x e4m3 | pad to 4 bytes]
            probe = torch.zeros(1, self.hidden_size, dtype=self.dtype, device=self.device)
            self._scale_bytes = fp8_quantize(probe)[1][0].nbytes
            self._row_bytes = self._scale_bytes + -(-self.hidden_size // 4) * 4
        else:
            self._row_bytes = self.hidden_size * self.dtype.itemsize
        self._allocate()

    def _allocate(self) -> None:
        """The communication buffers (a subclass with another transport has its own)."""
        rows = self.size * self.cap  # slot r * cap + t: token t of (to / from) rank r
        # Dispatch sends from _send_x and receives into _recv_x; combine reuses the same two (dispatch_b has
        # consumed _recv_x by then).
        self._send_x = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        self._recv_x = torch.empty_like(self._send_x)
        self._send_meta = torch.empty(rows, 2 * self.topk, dtype=torch.int32, device=self.device)
        self._recv_meta = torch.empty_like(self._send_meta)
        if self.fp8:
            assert self._row_bytes <= self._send_x[0].nbytes, "FP8 rows must fit in combine's rows"
            self._send_bytes, self._recv_bytes = (self._byte_rows(b) for b in (self._send_x, self._recv_x))

    def _byte_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """[rows, row_bytes] uint8 over the start of `buf`'s memory."""
        rows = buf.shape[0]
        return buf.view(-1).view(torch.uint8)[: rows * self._row_bytes].view(rows, self._row_bytes)

    def _pack_rows(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Tokens [lo, hi) as dispatch rows into `dst [R, >= hi - lo, ...]` (the same rows for every rank): x in
        its dtype, or FP8 bytes [scales | e4m3] (dst then uint8 [R, ., >= row_bytes])."""
        n = hi - lo
        if self.fp8:
            sb = self._scale_bytes
            dst[:, :n, :sb] = self._xs[lo:hi].view(torch.uint8)
            dst[:, :n, sb : sb + self.hidden_size] = self._xq[lo:hi].view(torch.uint8)
        else:
            dst[:, :n] = self._x[lo:hi]

    def _local_meta(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, hi - lo, k] int64 local expert ids of tokens [lo, hi) on each rank (-1: none there), and their
        weights [R, hi - lo, k] fp32."""
        ranks = torch.arange(self.size, device=self.device).view(self.size, 1, 1)
        return local_topk(self._topk_ids[lo:hi].unsqueeze(0), self._topk_weights[lo:hi].unsqueeze(0), ranks,
                          self.num_local_experts)

    def describe(self) -> str:
        fp8 = ", FP8 dispatch" if self.fp8 else ""
        return f"all2all low_latency, slots of {self.cap} tokens x {self.size} ranks{fp8}"

    def buffer_bytes(self) -> int:
        """Bytes of the fixed communication buffers of this instance (for the memory log line)."""
        return sum(b.nbytes for b in (self._send_x, self._recv_x, self._send_meta, self._recv_meta))

    def layout_bytes(self, rounds: int = 1) -> int:
        """Bytes of the MaskedLayout x one step allocates (E_local x rounds*R*cap x H); the experts' output is as
        large again. Not part of buffer_bytes: it comes from the allocator (the graph pool under CUDA graphs)."""
        return self.num_local_experts * rounds * self.size * self.cap * self._row_bytes

    def _reset(self) -> None:
        super()._reset()
        self._x = self._topk_ids = self._topk_weights = None
        self._xq = self._xs = None  # FP8 dispatch: x quantized, [T, H] e4m3 and [T, ceil(H/128)] fp32
        self._rounds = 0
        self._plans: list[MaskedPlan] = []
        self._out_flat: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------------------
    # dispatch

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None) -> None:
        """x [T, H] dtype; topk_ids [T, k] int64 physical ids (-1 = none); topk_weights [T, k] fp32.

        T is a host-side shape (static per graph). Rounds come from `batch.global_num_tokens` (no communication);
        without the header an all-reduce agrees on them, which syncs the host and cannot be captured."""
        assert x.dtype == self.dtype and x.shape[1] == self.hidden_size, (x.dtype, x.shape)
        assert topk_ids.shape[1] == self.topk, (topk_ids.shape, self.topk)
        t = x.shape[0]
        bound = max_tokens_over_ranks(batch, t, self.group, self.device)
        self._rounds = max(1, -(-bound // self.cap))
        assert t <= self._rounds * self.cap, (t, self._rounds, self.cap)
        self._x, self._topk_ids, self._topk_weights = x, topk_ids, topk_weights
        if self.fp8:
            self._xq, self._xs = self._quantize(x)
        self._count_bytes()
        self._send_dispatch(0)

    def _count_bytes(self) -> None:
        slots = self._rounds * (self.size - 1) * self.cap  # fixed slots, whatever the routing
        self.comm_bytes = {"dispatch": slots * (self._row_bytes + 2 * self.topk * 4),
                           "combine": slots * self.hidden_size * self.dtype.itemsize}

    def _chunk(self, i: int) -> tuple[int, int]:
        lo = min(i * self.cap, self._x.shape[0])
        return lo, min(lo + self.cap, self._x.shape[0])

    def _send_dispatch(self, i: int) -> None:
        lo, hi = self._chunk(i)
        n, k, r = hi - lo, self.topk, self.size
        # every rank gets the slot; ids say what counts
        self._pack_rows((self._send_bytes if self.fp8 else self._send_x).view(r, self.cap, -1), lo, hi)
        local_ids, weights = self._local_meta(lo, hi)  # [R, n, k]
        meta = self._send_meta.view(r, self.cap, 2 * k)
        meta[:, :n] = pack_meta(local_ids, weights)
        meta[:, n:, :k] = -1  # padding rows: no expert
        meta[:, n:, k:] = 0
        send_x, recv_x = (self._send_bytes, self._recv_bytes) if self.fp8 else (self._send_x, self._recv_x)
        self._works = [
            dist.all_to_all_single(recv_x, send_x, group=self.group, async_op=True),
            dist.all_to_all_single(self._recv_meta, self._send_meta, group=self.group, async_op=True),
        ]

    def dispatch_b(self) -> MaskedLayout:
        """x [E_local, C, H] with C = rounds * R * cap; the first masked_m[e] rows of expert e are valid, the rest
        uninitialized."""
        e_local, cap_total = self.num_local_experts, self._rounds * self.size * self.cap
        # Not zeroed (a memset of the whole layout would cost more than the dispatch): rows past masked_m hold
        # garbage, which grouped GEMMs skip and combine never reads. The last row is a spare for invalid pairs.
        x_flat = torch.empty(e_local * cap_total + 1, self.hidden_size, dtype=self.dtype, device=self.device)
        if self.fp8:  # bytes: e4m3 rows and their scales (index_copy has no float8 kernel on every device)
            x_flat = torch.empty(e_local * cap_total + 1, self.hidden_size, dtype=torch.uint8, device=self.device)
            s_flat = torch.empty(e_local * cap_total + 1, self._scale_bytes, dtype=torch.uint8, device=self.device)
        filled = torch.zeros(e_local, dtype=torch.int64, device=self.device)
        self._plans = []
        for i in range(self._rounds):
            rows, local_ids, weights = self._receive_dispatch()
            plan = plan_masked(local_ids, weights, e_local, cap_total, filled)
            if self.fp8:
                sb = self._scale_bytes
                scatter_masked(rows[:, sb : sb + self.hidden_size], plan, x_flat)
                scatter_masked(rows[:, :sb], plan, s_flat)
            else:
                scatter_masked(rows, plan, x_flat)
            self._plans.append(plan)
            if i + 1 < self._rounds:
                self._send_dispatch(i + 1)
        x = x_flat[: e_local * cap_total].view(e_local, cap_total, self.hidden_size)
        if not self.fp8:
            return MaskedLayout(x=x, masked_m=filled.to(torch.int32))
        scale = s_flat[: e_local * cap_total].view(torch.float32).view(e_local, cap_total, -1)
        return MaskedLayout(x=x.view(torch.float8_e4m3fn), masked_m=filled.to(torch.int32), x_scale=scale)

    def _receive_dispatch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wait for a round's rows: (rows [R * cap, H] in x's dtype, or FP8 bytes [R * cap, >= row_bytes]; local
        expert ids [R * cap, k] int64, -1 on rows that carry nothing; weights [R * cap, k] fp32)."""
        self._wait()
        local_ids, weights = unpack_meta(self._recv_meta)
        return (self._recv_bytes if self.fp8 else self._recv_x), local_ids, weights

    # ------------------------------------------------------------------------------------------------------------
    # combine

    def combine_a(self, expert_out: torch.Tensor) -> None:
        """expert_out [E_local, C, H]: unweighted expert outputs; rows past masked_m are never read."""
        assert self._plans, "combine_a before dispatch_b"
        self._out_flat = expert_out.reshape(-1, self.hidden_size)
        self._send_combine(0)

    def _send_combine(self, i: int) -> None:
        self._send_x.copy_(combine_masked(self._out_flat, self._plans[i]))  # weighted, fp32 sum, cast to dtype
        self._works = [dist.all_to_all_single(self._recv_x, self._send_x, group=self.group, async_op=True)]

    def combine_b(self) -> torch.Tensor:
        """[T, H] in x's dtype: sum_k w_k * expert_k(x_t)."""
        out = self._x.new_empty(self._x.shape)
        for i in range(self._rounds):
            lo, hi = self._chunk(i)
            out[lo:hi] = self._receive_combine(i, hi - lo)
            if i + 1 < self._rounds:
                self._send_combine(i + 1)
        self._reset()
        return out

    def _receive_combine(self, i: int, n: int) -> torch.Tensor:
        """Wait for round i's results: [n, H] in x's dtype, each token's sum over the ranks in fp32."""
        self._wait()
        back = self._recv_x.view(self.size, self.cap, self.hidden_size)[:, :n]
        return back.float().sum(0).to(self.dtype)
